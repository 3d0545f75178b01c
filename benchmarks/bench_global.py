"""Cost of the global gradient mode: forward+backward ratios, measured interleaved in one run.

    python benchmarks/bench_global.py [--world-sizes 2 3] [--reps 30] [--json out.json]

Each spawned rank (gloo on loopback, one intra-op thread) repeats, for every case, one timed block per method in
rotating order. A block is a fixed number of steps (more for small tensors, so that one scheduler hiccup on a
shared 2-core machine does not decide a millisecond measurement); a step gathers a float32 tensor that requires
grad, computes ``sum_j (entry_j ** 2).sum()`` over the gathered entries and runs backward. Methods: our local
mode, our global mode and, on equal shapes, ``torch.distributed.nn.functional.all_gather`` (the autograd-aware
all_gather everyone else uses; equal shapes only). A block's time per step is the slowest rank's (ranks
synchronise before each block). Reported: per-method medians, and the median of the per-block ratios
(global/local, global/torch) with its 95% confidence interval, for 2 and 3 ranks.

Targets (issue 6): global <= 1.5x local at every size, and <= 1.1x ``torch.distributed.nn.functional.all_gather``
on equal shapes. ``main()`` returns a JSON-able dict so ``benchmarks/run_all.py`` can call it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._stats import spread

#: name -> (rows per rank as a function of rank, columns); elements per rank = rows * columns
CASES: dict[str, tuple[tuple[int, ...], int]] = {
    "scalar": ((), 0),
    "1k": ((1000,), 1),
    "64k": ((256,), 256),
    "1M": ((1000,), 1000),
    "uneven 64k": ((192, 320, 256), 256),  # rank r has rows[r % 3] rows
    "uneven 1M": ((750, 1250, 1000), 1000),
}
#: steps per timed block, per case
STEPS = {"scalar": 20, "1k": 20, "64k": 10, "1M": 3, "uneven 64k": 10, "uneven 1M": 3}
TARGET_VS_LOCAL = 1.5
TARGET_VS_TORCH = 1.1


def _shape(case: str, rank: int) -> tuple[int, ...]:
    rows, cols = CASES[case]
    if not rows:
        return ()
    return (rows[rank % len(rows)], cols) if cols > 1 else (rows[rank % len(rows)],)


def _rank_bench(reps: int) -> dict[str, dict[str, list[float]]]:
    """Runs in every rank; returns, per case and method, the slowest rank's time per step of each block (s)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as tdnn

    from torchmetrics_gradpatch import gather_all_tensors

    warnings.simplefilter("ignore", FutureWarning)  # tdnn.all_gather is deprecated on new torch
    rank = dist.get_rank()

    def loss_of(entries: Any) -> torch.Tensor:
        return sum((entry * entry).sum() for entry in entries)  # type: ignore[return-value]

    methods: dict[str, Any] = {
        "local": lambda x: gather_all_tensors(x, mode="local"),
        "global": lambda x: gather_all_tensors(x, mode="global"),
        "torch": lambda x: tdnn.all_gather(x),
    }
    results: dict[str, dict[str, list[float]]] = {}
    for case in CASES:
        shape = _shape(case, rank)
        base = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        names = ["local", "global"] + (["torch"] if not case.startswith("uneven") else [])
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps + 2):  # two warm-up repetitions
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                inputs = [base.clone().requires_grad_() for _ in range(STEPS[case])]
                dist.barrier()
                start = time.perf_counter()
                for x in inputs:
                    loss_of(methods[name](x)).backward()
                elapsed = torch.tensor([(time.perf_counter() - start) / len(inputs)], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep >= 2:
                    times[name].append(float(elapsed))
        results[case] = times
    return results


def _ratio_stats(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    return spread([n / d for n, d in zip(numerator, denominator, strict=True)])


def run(world_size: int = 2, reps: int = 30) -> dict[str, Any]:
    """Spawn ``world_size`` ranks, measure, and summarise (see the module docstring)."""
    import torch

    from torchmetrics_gradpatch.testing import spawn_ranks

    raw = spawn_ranks(_rank_bench, world_size, args=(reps,), timeout=600)[0]
    summary: dict[str, Any] = {
        "torch": torch.__version__,
        "world_size": world_size,
        "reps": reps,
        "targets": {"global_vs_local": TARGET_VS_LOCAL, "global_vs_torch_equal_shapes": TARGET_VS_TORCH},
        "cases": {},
    }
    for case, times in raw.items():
        shapes = [_shape(case, r) for r in range(world_size)]
        entry: dict[str, Any] = {
            "elements_per_rank": [int(torch.Size(s).numel()) for s in shapes],
            "median_ms": {name: 1e3 * statistics.median(values) for name, values in times.items()},
            "global_vs_local": _ratio_stats(times["global"], times["local"]),
        }
        entry["global_vs_local"]["target_met"] = entry["global_vs_local"]["median"] <= TARGET_VS_LOCAL
        if "torch" in times:
            entry["global_vs_torch"] = _ratio_stats(times["global"], times["torch"])
            entry["global_vs_torch"]["target_met"] = entry["global_vs_torch"]["median"] <= TARGET_VS_TORCH
        summary["cases"][case] = entry
    return summary


def render(summary: dict[str, Any]) -> str:
    """A plain-text table of :func:`run`'s result, naming every missed target."""
    lines = [
        f"torch {summary['torch']}, {summary['world_size']} ranks, {summary['reps']} interleaved blocks of steps; "
        "fwd+bwd per step, medians (ms), and per-block ratio median [95% CI of the median]",
        f"{'case':<11} {'local':>8} {'global':>8} {'torch':>8}  {'global/local':<22} {'global/torch':<22}",
    ]
    missed = []
    for case, entry in summary["cases"].items():
        ms = entry["median_ms"]
        vs_local = entry["global_vs_local"]
        cells = [f"{case:<11}", f"{ms['local']:8.3f}", f"{ms['global']:8.3f}", f"{ms.get('torch', float('nan')):8.3f}"]
        cells.append(f" {vs_local['median']:.2f} [{vs_local['ci95_lo']:.2f}-{vs_local['ci95_hi']:.2f}]".ljust(23))
        if not vs_local["target_met"]:
            missed.append(f"{case}: global/local {vs_local['median']:.2f} > {TARGET_VS_LOCAL}")
        vs_torch = entry.get("global_vs_torch")
        if vs_torch:
            cells.append(f"{vs_torch['median']:.2f} [{vs_torch['ci95_lo']:.2f}-{vs_torch['ci95_hi']:.2f}]")
            if not vs_torch["target_met"]:
                missed.append(f"{case}: global/torch {vs_torch['median']:.2f} > {TARGET_VS_TORCH}")
        else:
            cells.append("n/a (uneven shapes)")
        lines.append(" ".join(cells))
    lines.append("targets missed: " + ("; ".join(missed) if missed else "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line entry point; returns the JSON-able summary (also for ``benchmarks/run_all.py``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    runs = [run(world_size, args.reps) for world_size in args.world_sizes]
    summary: dict[str, Any] = {"runs": runs, "text": "\n\n".join(render(one) for one in runs)}
    print(summary["text"])
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
