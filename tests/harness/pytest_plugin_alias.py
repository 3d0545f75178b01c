"""The name users give pytest for the ``ranks`` marker: ``-p torchmetrics_gradpatch.pytest_plugin``.

A name only: pytest loads the plugin module it lists, :mod:`tests.harness.plugin`, once, whichever
of the two names a run gives (a second copy of the hooks would register the options twice).
"""

pytest_plugins = ["tests.harness.plugin"]
