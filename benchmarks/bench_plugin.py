"""What a ``@pytest.mark.ranks(2)`` test costs against calling ``spawn_ranks`` by hand, as a ratio in one run;
with ``--pool``, what a pooled test (``ranks(2, reuse=True)``) costs against a fresh one.

    python benchmarks/bench_plugin.py [--rounds 10] [--world-size 2] [--json out.json] [--text out.txt]
    python benchmarks/bench_plugin.py --pool [--rounds 50] [--json out.json] [--text out.txt] [--update-docs]

One pytest session (in a subprocess, plugin enabled with ``-p``) runs a generated test file: per round, a marked
test and a plain test that calls ``spawn_ranks`` on an equivalent module-level function, in A B / B A order
from round to round so drift in the machine's load falls on both alike. Both bodies do the same thing: one
all-reduce of a scalar. Each test's wall time is read from pytest's JUnit XML (setup, call and teardown; neither
test has fixtures). Reported: both medians and the median of the per-round ratios marked / by hand with its 95%
confidence interval. What the marker adds on top of the spawn: pickling fixture values, importing pytest and the
test module in every rank, and rendering a failure (none here).

``--pool``: per round a pooled and a fresh marked test with the same body, A B / B A as above, so the pooled tests
run in one warm pool for the whole session while a fresh spawn happens between them (the idle pool waits on its
pipes). Reported: the median cost per test of each with its 95% confidence interval, the pooled cost averaged
over all rounds *including* the first pooled test, which starts the pool, and the per-round ratio fresh /
pooled. Both reports and JSON files state the command, the commit, the machine and its load average at start
and end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: this checkout's src/ (the code measured) and benchmarks first
    _root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(_root / "src"), str(_root)]

from benchmarks._pages import artifact_name, replace_region
from benchmarks._provenance import child_env, commit
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


POOLED = """

@pytest.mark.ranks({world_size}, reuse=True)
def test_r{round:03d}_pooled():
    body()
"""

FRESH = MARKED.replace("_marked", "_fresh")


def _test_file(rounds: int, world_size: int, first: str = MARKED, second: str = BY_HAND) -> str:
    parts = [HEADER]
    for index in range(rounds):
        pair = [first, second] if index % 2 == 0 else [second, first]
        parts.extend(template.format(round=index, world_size=world_size) for template in pair)
    return "".join(parts)


def _session_times(source: str) -> dict[str, float]:
    """Run ``source`` as one pytest session with the plugin; each test's time (setup + call + teardown)."""
    with tempfile.TemporaryDirectory(prefix="tmgp-bench-plugin-") as tmp:
        path = Path(tmp) / "test_bench_plugin.py"
        path.write_text(source)
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
        proc = subprocess.run(command, cwd=tmp, env=child_env(), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"the benchmark session failed:\n{proc.stdout}\n{proc.stderr}")
        return {case.get("name", ""): float(case.get("time", "nan")) for case in ET.parse(junit).iter("testcase")}


def main(rounds: int = 10, world_size: int = 2) -> dict[str, Any]:
    """Run the session; return per-test times and the ratio summary, with the run's provenance (JSON-able)."""
    started = {"loadavg": os.getloadavg(), "commit": commit()}
    times = _session_times(_test_file(rounds, world_size))
    marked = [times[f"test_r{index:03d}_marked"] for index in range(rounds)]
    by_hand = [times[f"test_r{index:03d}_by_hand"] for index in range(rounds)]
    ratios = [m / h for m, h in zip(marked, by_hand, strict=True)]
    return {
        "command": "python " + " ".join(["benchmarks/bench_plugin.py", *sys.argv[1:]]),
        "commit": started["commit"],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "loadavg_start": started["loadavg"],
        "loadavg_end": os.getloadavg(),
        "world_size": world_size,
        "rounds": rounds,
        "marked_s": marked,
        "by_hand_s": by_hand,
        "marked_median_s": statistics.median(marked),
        "by_hand_median_s": statistics.median(by_hand),
        "ratio_marked_over_by_hand": spread(ratios),
    }


def main_pool(rounds: int = 50, world_size: int = 2) -> dict[str, Any]:
    """Pooled against fresh marked tests in one session (see the module docstring); JSON-able."""
    started = {"loadavg": os.getloadavg(), "commit": commit()}
    times = _session_times(_test_file(rounds, world_size, POOLED, FRESH))
    pooled = [times[f"test_r{index:03d}_pooled"] for index in range(rounds)]
    fresh = [times[f"test_r{index:03d}_fresh"] for index in range(rounds)]
    return {
        "command": "python " + " ".join(["benchmarks/bench_plugin.py", *sys.argv[1:]]),
        "commit": started["commit"],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "loadavg_start": started["loadavg"],
        "loadavg_end": os.getloadavg(),
        "world_size": world_size,
        "rounds": rounds,
        "pooled_s": pooled,
        "fresh_s": fresh,
        "pooled_per_test_s": spread(pooled),
        "fresh_per_test_s": spread(fresh),
        "pooled_mean_with_start_s": statistics.fmean(pooled),
        "ratio_fresh_over_pooled": spread([f / p for f, p in zip(fresh, pooled, strict=True)]),
        "ratio_of_totals_fresh_over_pooled": sum(fresh) / sum(pooled),
    }


def _provenance(result: dict[str, Any]) -> list[str]:
    """The report's first lines: command, commit, machine and load (the docs quote only artifacts that state them)."""
    return [
        f"command: {result['command']}",
        f"commit: {result['commit']}; {result['machine']['cpus']} CPUs; load average at start "
        f"{' '.join(f'{x:.2f}' for x in result['loadavg_start'])}, at end "
        f"{' '.join(f'{x:.2f}' for x in result['loadavg_end'])}",
    ]


def _print_pool(result: dict[str, Any]) -> str:
    pooled, fresh, ratio = result["pooled_per_test_s"], result["fresh_per_test_s"], result["ratio_fresh_over_pooled"]
    lines = [
        *_provenance(result),
        f"{result['rounds']} rounds, {result['world_size']} ranks, pooled and fresh tests in A B / B A order",
        f"  fresh test   median {fresh['median']:.3f} s per test, 95% CI [{fresh['ci95_lo']:.3f}, "
        f"{fresh['ci95_hi']:.3f}]",
        f"  pooled test  median {pooled['median']:.3f} s per test, 95% CI [{pooled['ci95_lo']:.3f}, "
        f"{pooled['ci95_hi']:.3f}]; first (starts the pool) {result['pooled_s'][0]:.2f} s; "
        f"mean with it {result['pooled_mean_with_start_s']:.3f} s",
        f"  ratio fresh / pooled per round: median {ratio['median']:.1f}, 95% CI [{ratio['ci95_lo']:.1f}, "
        f"{ratio['ci95_hi']:.1f}]; ratio of the totals (pool start included) "
        f"{result['ratio_of_totals_fresh_over_pooled']:.1f}",
    ]
    text = "\n".join(lines)
    print(text)
    return text


DOCS = Path(__file__).resolve().parent.parent / "docs" / "testing-your-metrics.md"


def update_docs(result: dict[str, Any], artifact: str) -> None:
    """Write the pool's figures into docs/testing-your-metrics.md, between the plugin-pool markers."""
    pooled, fresh, ratio = result["pooled_per_test_s"], result["fresh_per_test_s"], result["ratio_fresh_over_pooled"]
    text = (
        f"From `{artifact}` ({result['rounds']} rounds, {result['world_size']} ranks): a fresh test took "
        f"{fresh['median']:.3f} s (95% CI "
        f"[{fresh['ci95_lo']:.3f}, {fresh['ci95_hi']:.3f}]) and a pooled one {pooled['median']:.3f} s (95% CI "
        f"[{pooled['ci95_lo']:.3f}, {pooled['ci95_hi']:.3f}]), median; per round, fresh / pooled was "
        f"{ratio['median']:.1f} (95% CI [{ratio['ci95_lo']:.1f}, {ratio['ci95_hi']:.1f}]). The first pooled test, "
        f"which starts the pool, took {result['pooled_s'][0]:.2f} s; counting it, a pooled test cost "
        f"{result['pooled_mean_with_start_s']:.3f} s on average, and the fresh tests took "
        f"{result['ratio_of_totals_fresh_over_pooled']:.1f} times as long in total."
    )
    if not replace_region(DOCS, "plugin-pool", textwrap.fill(text, 115, break_long_words=False)):
        raise SystemExit(f"no plugin-pool markers in {DOCS}")


def _print(result: dict[str, Any]) -> str:
    ratio = result["ratio_marked_over_by_hand"]
    text = "\n".join(
        [
            *_provenance(result),
            f"{result['rounds']} rounds, {result['world_size']} ranks, A B / B A order",
            f"  marked test      median {result['marked_median_s']:.2f} s",
            f"  spawn_ranks      median {result['by_hand_median_s']:.2f} s",
            f"  ratio marked / by hand: median {ratio['median']:.3f}, 95% CI [{ratio['ci95_lo']:.3f}, "
            f"{ratio['ci95_hi']:.3f}], range [{ratio['min']:.3f}, {ratio['max']:.3f}]",
        ]
    )
    print(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", action="store_true", help="pooled (reuse=True) against fresh marked tests")
    parser.add_argument("--rounds", type=int, help="rounds of pairs (default 10; 50 with --pool)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--text", type=Path, help="also write the printed report here")
    parser.add_argument("--from-json", type=Path, help="with --pool: do not run, report this earlier --json result")
    parser.add_argument(
        "--update-docs", action="store_true", help="with --pool: write the figures into docs/testing-your-metrics.md"
    )
    args = parser.parse_args()
    rounds = args.rounds if args.rounds is not None else (50 if args.pool else 10)
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.pool:
        fresh_run = args.from_json is None
        summary = main_pool(rounds, args.world_size) if fresh_run else json.loads(args.from_json.read_text())
        report = _print_pool(summary)
        if args.text and fresh_run:
            args.text.write_text(report + "\n")
        if args.update_docs:
            update_docs(summary, artifact_name(args.text) if args.text else "benchmarks/results/plugin-pool.txt")
    else:
        summary = main(rounds, args.world_size)
        report = _print(summary)
        if args.text:
            args.text.write_text(report + "\n")
    if args.json and (not args.pool or args.from_json is None):
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
