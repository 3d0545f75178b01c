"""The name users give pytest (``-p torchmetrics_gradpatch.pytest_plugin``) for :mod:`.testing.plugin`."""

pytest_plugins = ["torchmetrics_gradpatch.testing.plugin"]
