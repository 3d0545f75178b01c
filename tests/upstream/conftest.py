"""Upstream torchmetrics' DDP tests, vendored (README.md here): the project's own pytest runs never collect them.

They run from their own directory, as upstream runs them (``tests/upstream/run.py``, the ``fused-*`` tox
environments), under that directory's pytest.ini, which keeps this file and the project's configuration out.
"""

collect_ignore = ["tm0.11", "tm1.5", "tm1.9", "_hook", "run.py"]
