"""Flake check: run the whole spawned-rank suite N times in a row (default 20); every run must pass.

    python tests/flake_check.py [--runs 20] [-- extra pytest args]

No reruns: the rerunfailures plugin is disabled (``-p no:rerunfailures``), so a flaky test fails its run. The
spawned-rank suite is every ``tests/test_*.py`` that starts ranks (``spawn_ranks``, ``@pytest.mark.ranks`` or
torchrun), without the tests marked slow; the Lightning test is not repeated here (it needs Lightning:
``tox -e lightning``). Stops at the first failing run; writes a summary to ``results/raw/flake.json`` and ends with
a line "N passed, M failed" counting runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


#: what marks a test file as starting real ranks: our runner, the pytest plugin's marker, torchrun.
#: (tests/test_lightning.py, Lightning's ddp_spawn, needs Lightning and has its own environment, `tox -e lightning`;
#: it takes a minute a run.)
SPAWN_MARKERS = ("spawn_ranks", "pytest.mark.ranks", "torchrun")


def spawned_suite() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").glob("test_*.py")
        if any(marker in path.read_text() for marker in SPAWN_MARKERS)
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--files", nargs="+", help="test files to repeat instead of the whole spawned suite")
    parser.add_argument("pytest_args", nargs="*")
    opts = parser.parse_args()
    files = opts.files or spawned_suite()
    print(f"flake check: {opts.runs} runs of {' '.join(files)}", flush=True)
    runs = []
    for run in range(1, opts.runs + 1):
        start = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:rerunfailures",
                "-p",
                "no:cacheprovider",
                *files,
                *opts.pytest_args,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        runs.append(
            {
                "run": run,
                "returncode": proc.returncode,
                "seconds": round(time.monotonic() - start, 1),
                "summary": summary,
            }
        )
        print(f"run {run}/{opts.runs}: exit {proc.returncode} in {runs[-1]['seconds']} s: {summary}", flush=True)
        if proc.returncode != 0:
            print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\n")
            break
    passed = sum(1 for r in runs if r["returncode"] == 0)
    failed = len(runs) - passed
    out = ROOT / "results" / "raw" / ("flake.json" if not opts.files else "flake-subset.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"files": files, "runs": runs, "passed": passed, "failed": failed}, indent=2) + "\n")
    print(f"flake: {passed} passed, {failed} failed")
    return 0 if failed == 0 and passed == opts.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
