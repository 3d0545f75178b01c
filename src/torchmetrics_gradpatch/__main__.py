"""``python -m torchmetrics_gradpatch``: the command line of :mod:`torchmetrics_gradpatch._cli`."""

from torchmetrics_gradpatch._cli import run

if __name__ == "__main__":
    run()
