"""What a ``@pytest.mark.ranks(2)`` test costs against calling ``spawn_ranks`` by hand, as a ratio in one run.

    python benchmarks/bench_plugin.py [--rounds 10] [--world-size 2] [--json out.json]

One pytest session (in a subprocess, plugin enabled with ``-p``) runs a generated test file: per round, a marked
test and a plain test that calls ``spawn_ranks`` on an equivalent module-level function, in A B / B A order
from round to round so drift in the machine's load falls on both alike. Both bodies do the same thing: one
all-reduce of a scalar. Each test's wall time is read from pytest's JUnit XML (setup, call and teardown; neither
test has fixtures). Reported: both medians and the median of the per-round ratios marked / by hand with its 95%
confidence interval. What the marker adds on top of the spawn: pickling fixture values, importing pytest and the
test module in every rank, and rendering a failure (none here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._stats import spread

HEADER = """
import pytest
import torch
import torch.distributed as dist

from torchmetrics_gradpatch.testing import spawn_ranks


def body():
    total = torch.tensor(float(dist.get_rank()))
    dist.all_reduce(total)
    assert total.item() == sum(range(dist.get_world_size()))
"""

MARKED = """

@pytest.mark.ranks({world_size})
def test_r{round:03d}_marked():
    body()
"""

BY_HAND = """

def test_r{round:03d}_by_hand():
    spawn_ranks(body, {world_size})
"""


def _test_file(rounds: int, world_size: int) -> str:
    parts = [HEADER]
    for index in range(rounds):
        pair = [MARKED, BY_HAND] if index % 2 == 0 else [BY_HAND, MARKED]
        parts.extend(template.format(round=index, world_size=world_size) for template in pair)
    return "".join(parts)


def main(rounds: int = 10, world_size: int = 2) -> dict[str, Any]:
    """Run the session; return per-test times and the ratio summary (JSON-able)."""
    with tempfile.TemporaryDirectory(prefix="tmgp-bench-plugin-") as tmp:
        path = Path(tmp) / "test_bench_plugin.py"
        path.write_text(_test_file(rounds, world_size))
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "torchmetrics_gradpatch.pytest_plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={junit}",
            str(path),
        ]
        proc = subprocess.run(command, cwd=tmp, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"the benchmark session failed:\n{proc.stdout}\n{proc.stderr}")
        times = {case.get("name", ""): float(case.get("time", "nan")) for case in ET.parse(junit).iter("testcase")}
    marked = [times[f"test_r{index:03d}_marked"] for index in range(rounds)]
    by_hand = [times[f"test_r{index:03d}_by_hand"] for index in range(rounds)]
    ratios = [m / h for m, h in zip(marked, by_hand, strict=True)]
    return {
        "world_size": world_size,
        "rounds": rounds,
        "marked_s": marked,
        "by_hand_s": by_hand,
        "marked_median_s": statistics.median(marked),
        "by_hand_median_s": statistics.median(by_hand),
        "ratio_marked_over_by_hand": spread(ratios),
    }


def _print(result: dict[str, Any]) -> None:
    ratio = result["ratio_marked_over_by_hand"]
    print(
        f"{result['rounds']} rounds, {result['world_size']} ranks, A B / B A order\n"
        f"  marked test      median {result['marked_median_s']:.2f} s\n"
        f"  spawn_ranks      median {result['by_hand_median_s']:.2f} s\n"
        f"  ratio marked / by hand: median {ratio['median']:.3f}, "
        f"95% CI [{ratio['ci95_lo']:.3f}, {ratio['ci95_hi']:.3f}], range [{ratio['min']:.3f}, {ratio['max']:.3f}]"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of (marked, by hand) pairs (default 10)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    summary = main(args.rounds, args.world_size)
    _print(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
