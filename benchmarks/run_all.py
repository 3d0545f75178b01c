"""Run every benchmark in turn; each prints its own table.

    python benchmarks/run_all.py            # every benchmark (tens of minutes on 2 cores)
    python benchmarks/run_all.py --quick    # each with --quick: a smoke test of the scripts (figures mean nothing)

Each benchmark is also one command of its own (docs/performance.md names them):

    python benchmarks/bench_percall.py      # what the patch adds to one gather call
    python benchmarks/bench_gather.py       # whole gathers patched / unpatched, native >= 1.6, toggle, import, memory
    python benchmarks/bench_sync.py         # the fused sync against torchmetrics' own sync and its floor
    python benchmarks/bench_collection.py   # the sync inside MetricCollection.compute(): fused, torchmetrics', floor
    python benchmarks/bench_step.py         # a DDP step with a MetricCollection loss: the syncs against the floor
    python benchmarks/bench_step_parts.py   # where a fused step's time goes, part by part, beside the floor's
    python benchmarks/bench_memory.py       # the peak memory of one sync against the gathered states' size
    python benchmarks/bench_global.py       # global mode against local mode and torch's differentiable all_gather
    python benchmarks/bench_compile.py      # what torch.compile support costs the eager path
    python benchmarks/bench_soak.py         # RSS and live tensors over many gathers and Metric-loss steps
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "bench_percall",
    "bench_gather",
    "bench_sync",
    "bench_collection",
    "bench_step",
    "bench_step_parts",
    "bench_memory",
    "bench_global",
    "bench_compile",
    "bench_soak",
)
#: the arguments that make each benchmark a smoke test
QUICK = {
    "bench_percall": ["--quick"],
    "bench_gather": ["--quick", "--skip-native"],
    "bench_sync": ["--quick"],
    "bench_collection": ["--quick"],
    "bench_step": ["--quick"],
    "bench_step_parts": ["--quick"],
    "bench_memory": ["--quick"],
    "bench_global": ["--quick"],
    "bench_compile": ["--rounds", "3", "--calls", "200"],
    "bench_soak": ["--gathers", "60", "--steps", "12"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark as a smoke test (figures mean nothing)")
    quick = parser.parse_args(argv).quick
    failed = []
    for name in BENCHMARKS:
        command = [sys.executable, str(HERE / f"{name}.py"), *(QUICK[name] if quick else [])]
        print(f"\n=== python benchmarks/{name}.py {' '.join(command[2:])}".rstrip(), flush=True)
        if subprocess.run(command, cwd=HERE.parent, check=False).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
