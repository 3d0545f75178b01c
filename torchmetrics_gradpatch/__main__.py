"""``python -m torchmetrics_gradpatch``: the command line of :mod:`torchmetrics_gradpatch.cli`."""

from torchmetrics_gradpatch.cli import run

if __name__ == "__main__":
    run()
