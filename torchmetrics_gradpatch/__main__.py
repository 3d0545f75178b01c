"""``python -m torchmetrics_gradpatch``: the command line of :mod:`torchmetrics_gradpatch.cli`."""

from torchmetrics_gradpatch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
