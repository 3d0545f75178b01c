"""What the scripts that draw a figure share: the run's facts, the table printed, the figure saved.

``started(script)`` opens a result with the command, the load average, torch's and torchmetrics' versions;
``finished(result, text, draw, path)`` adds the load at the end, prints ``text(result)`` and, given a ``path``,
draws the figure with ``draw(result, pyplot)`` and saves it without a timestamp (the same run draws the same file).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def started(script: str) -> dict[str, Any]:
    import torch
    import torchmetrics

    return {
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        "load_at_start": [round(v, 2) for v in os.getloadavg()],
        "torch": torch.__version__,
        "torchmetrics": torchmetrics.__version__,
    }


def finished(
    result: dict[str, Any],
    text: Callable[[dict[str, Any]], str],
    draw: Callable[[dict[str, Any], Any], Any],
    path: str | None,
) -> None:
    result["load_at_end"] = [round(v, 2) for v in os.getloadavg()]
    print(text(result))
    if path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure = draw(result, plt)
        figure.tight_layout()
        figure.savefig(path, metadata={"Date": None})
        print(f"plot: {path}")
