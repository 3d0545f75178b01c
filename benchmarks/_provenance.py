"""What every benchmark artifact states about its run: the commit it measured and the machine's load.

The docs quote only figures whose artifact states its command, commit and load (``scripts/check_figures.py``), so
every benchmark says them the same way, from here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
#: The code a benchmark measures: a change here, not yet committed, makes the commit alone an untrue description.
MEASURED = ("src/torchmetrics_gradpatch", "benchmarks")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def commit() -> str:
    """HEAD's short hash, with "+uncommitted changes" when the measured code differs from it ("unknown" outside git).

    Pages and results do not count: re-running a benchmark to update its page must still read as that commit.
    """
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *MEASURED, ":(exclude)benchmarks/results")
    return head + ("+uncommitted changes" if dirty else "")


def load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded (``None`` where the platform has none)."""
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` plus ``extra``, with this checkout's src/ and root first on ``PYTHONPATH``.

    A child interpreter then runs the code :func:`commit` describes, whatever is installed (the native-torchmetrics
    environment installs no torchmetrics_gradpatch at all), and can import the benchmarks package.
    """
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env
