"""Cost of the global gradient mode: forward+backward ratios, measured side by side in one run.

    python benchmarks/bench_global.py [--world-sizes 2 3] [--reps 30]
    python benchmarks/bench_global.py --quick     # a smoke test of the script (seconds; the figures mean nothing)

The report starts with the command, the versions and the load average at start, and ends with the load average
at end.

Each spawned rank (gloo on loopback, one intra-op thread) repeats, for every case, one timed block per method in
rotating order. A block is a fixed number of steps (more for small tensors, so that one scheduler hiccup on a
shared 2-core machine does not decide a millisecond measurement); a step gathers a float32 tensor that requires
grad, computes ``sum_j (entry_j ** 2).sum()`` over the gathered entries and runs backward. Methods: our local
mode, our global mode and, on equal shapes, ``torch.distributed.nn.functional.all_gather`` (the autograd-aware
all_gather everyone else uses; equal shapes only). A block's time per step is the slowest rank's (ranks
synchronise before each block). Reported: per-method medians, and the median of the per-block ratios
(global/torch, global/local) with its 95% confidence interval, for 2 and 3 ranks.

Where the time goes: after the timed blocks, every method runs a few more steps with each collective it issues
timed on its own (``torch.distributed`` calls are blocking on gloo); the report lists, per step, the time in
each collective and the rest (Python, autograd, copies), for every case that misses a target.

Targets: global / ``torch.distributed.nn.functional.all_gather`` <= 1.1 at a scalar, <= 1.4 at 1k and
64k elements, <= 1.0 at 1M; global / local <= 2.0 at every size. Per gather, local mode issues ``barrier``,
``all_gather`` (shapes), ``all_gather`` (data) forward and nothing backward; global mode ``all_gather``
(shapes and flags), ``all_gather`` (data) forward (a scalar: one ``all_gather``) and one ``all_to_all_single``
backward; torch's ``all_gather`` one ``all_gather`` forward and one ``all_to_all`` backward on gloo.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import _ranks
from _stats import spread

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
#: steps of the per-collective profile, per method and case
PROFILE_STEPS = 20
TARGET_VS_LOCAL = 2.0
TARGET_VS_TORCH = {"scalar": 1.1, "1k": 1.4, "64k": 1.4, "1M": 1.0}
#: the collectives the profile times (those missing from a torch version are skipped)
COLLECTIVES = ("barrier", "all_gather", "all_to_all_single", "all_to_all", "scatter", "reduce_scatter", "all_reduce")


def _shape(case: str, rank: int) -> tuple[int, ...]:
    rows, cols = CASES[case]
    if not rows:
        return ()
    return (rows[rank % len(rows)], cols) if cols > 1 else (rows[rank % len(rows)],)


@contextmanager
def _timed_collectives(seconds: dict[str, float]) -> Iterator[None]:
    """Add the wall time of every ``torch.distributed`` collective called inside to ``seconds[name]``."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def timer(name: str) -> Any:
        original = originals[name]

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

        return timed

    for name in originals:
        setattr(dist, name, timer(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _rank_bench(reps: int, steps_scale: float, profile_steps: int) -> dict[str, Any]:
    """Runs in every rank; per case and method: the slowest rank's time per step of each block (s), and a profile."""
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
    results: dict[str, Any] = {}
    for case in CASES:
        shape = _shape(case, rank)
        base = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        names = ["global", "torch", "local"] if not case.startswith("uneven") else ["global", "local"]
        times: dict[str, list[float]] = {name: [] for name in names}
        steps = max(1, round(STEPS[case] * steps_scale))
        for rep in range(reps + 2):  # two warm-up repetitions
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                inputs = [base.clone().requires_grad_() for _ in range(steps)]
                dist.barrier()
                start = time.perf_counter()
                for x in inputs:
                    loss_of(methods[name](x)).backward()
                elapsed = torch.tensor([(time.perf_counter() - start) / len(inputs)], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep >= 2:
                    times[name].append(float(elapsed))
        profile: dict[str, dict[str, float]] = {}
        for name in names:
            inputs = [base.clone().requires_grad_() for _ in range(profile_steps)]
            seconds: dict[str, float] = {}
            dist.barrier()
            start = time.perf_counter()
            with _timed_collectives(seconds):
                for x in inputs:
                    loss_of(methods[name](x)).backward()
            total = time.perf_counter() - start
            keys = sorted(seconds)
            row = torch.tensor([total, *(seconds[k] for k in keys)], dtype=torch.float64) / profile_steps
            dist.all_reduce(row, op=dist.ReduceOp.MAX)  # the same keys on every rank: the same collectives ran
            profile[name] = {
                "step": float(row[0]),
                **{k: float(v) for k, v in zip(keys, row[1:].tolist(), strict=True)},
            }
        results[case] = {"times": times, "profile": profile}
    return results


def _ratio_stats(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    return spread([n / d for n, d in zip(numerator, denominator, strict=True)])


def run(
    world_size: int = 2, reps: int = 30, steps_scale: float = 1.0, profile_steps: int = PROFILE_STEPS
) -> dict[str, Any]:
    """Spawn ``world_size`` ranks, measure, and summarise (see the module docstring)."""
    import torch

    raw = _ranks.spawn_ranks(_rank_bench, world_size, (reps, steps_scale, profile_steps), timeout=900)[0]
    summary: dict[str, Any] = {
        "torch": torch.__version__,
        "world_size": world_size,
        "reps": reps,
        "targets": {"global_vs_local": TARGET_VS_LOCAL, "global_vs_torch": TARGET_VS_TORCH},
        "cases": {},
    }
    for case, measured in raw.items():
        times = measured["times"]
        shapes = [_shape(case, r) for r in range(world_size)]
        entry: dict[str, Any] = {
            "elements_per_rank": [int(torch.Size(s).numel()) for s in shapes],
            "median_ms": {name: 1e3 * statistics.median(values) for name, values in times.items()},
            "profile_ms": {
                name: {key: 1e3 * value for key, value in row.items()} for name, row in measured["profile"].items()
            },
            "global_vs_local": _ratio_stats(times["global"], times["local"]),
        }
        entry["global_vs_local"]["target"] = TARGET_VS_LOCAL
        entry["global_vs_local"]["target_met"] = entry["global_vs_local"]["median"] <= TARGET_VS_LOCAL
        if "torch" in times:
            entry["global_vs_torch"] = _ratio_stats(times["global"], times["torch"])
            entry["global_vs_torch"]["target"] = TARGET_VS_TORCH[case]
            entry["global_vs_torch"]["target_met"] = entry["global_vs_torch"]["median"] <= TARGET_VS_TORCH[case]
        summary["cases"][case] = entry
    return summary


def _ratio_cell(stats: dict[str, float]) -> str:
    mark = "" if stats["target_met"] else " MISS"
    return f"{stats['median']:.2f} [{stats['ci95_lo']:.2f}-{stats['ci95_hi']:.2f}] <={stats['target']:g}{mark}"


def render(summary: dict[str, Any]) -> str:
    """A plain-text table of :func:`run`'s result; where a target is missed, where the time goes."""
    lines = [
        f"torch {summary['torch']}, {summary['world_size']} ranks, {summary['reps']} interleaved blocks of steps; "
        "fwd+bwd per step, medians (ms), and per-block ratio median [95% CI of the median] <= target",
        f"{'case':<11} {'global':>8} {'torch':>8} {'local':>8}  {'global/torch':<29} {'global/local':<29}",
    ]
    missed: list[str] = []
    for case, entry in summary["cases"].items():
        ms = entry["median_ms"]
        cells = [f"{case:<11}", f"{ms['global']:8.3f}", f"{ms.get('torch', float('nan')):8.3f}", f"{ms['local']:8.3f}"]
        vs_torch = entry.get("global_vs_torch")
        cells.append(" " + (_ratio_cell(vs_torch) if vs_torch else "n/a (uneven shapes)").ljust(29))
        cells.append(_ratio_cell(entry["global_vs_local"]))
        lines.append(" ".join(cells))
        for label, stats in (("global/torch", vs_torch), ("global/local", entry["global_vs_local"])):
            if stats and not stats["target_met"]:
                missed.append(f"{case}: {label} {stats['median']:.2f} > {stats['target']:g}")
    lines.append("targets missed: " + ("; ".join(missed) if missed else "none"))
    missed_cases = [m.split(":")[0] for m in missed]
    if missed_cases:
        lines.append("where the time goes (ms per step, slowest rank; each collective timed on its own, rest = other):")
        for case in dict.fromkeys(missed_cases):
            for name, row in summary["cases"][case]["profile_ms"].items():
                parts = [f"{key} {value:.3f}" for key, value in row.items() if key != "step"]
                rest = row["step"] - sum(value for key, value in row.items() if key != "step")
                lines.append(
                    f"  {case:<11} {name:<7} step {row['step']:.3f} = " + " + ".join([*parts, f"rest {rest:.3f}"])
                )
    return "\n".join(lines)


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _load_text(values: list[float] | None) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "not available"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: prints the report and returns the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 blocks of a few steps; figures meaningless")
    args = parser.parse_args(argv)
    provenance: dict[str, Any] = {
        "command": " ".join(["python benchmarks/bench_global.py", *(sys.argv[1:] if argv is None else argv)]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "torchmetrics": importlib.metadata.version("torchmetrics"),
        "cpus": os.cpu_count(),
        "loadavg_start": load(),
    }
    header = [
        f"command: {provenance['command']}   (run from the repository root)",
        f"{provenance['when']}; Python {provenance['python']}, torch "
        f"{provenance['torch']}, torchmetrics {provenance['torchmetrics']}, {provenance['cpus']} CPUs",
        _ranks.package(),
        f"load average at start: {_load_text(provenance['loadavg_start'])}",
    ]
    print("\n".join(header), flush=True)
    if args.quick:
        runs = [run(world_size, reps=3, steps_scale=0.2, profile_steps=2) for world_size in args.world_sizes]
    else:
        runs = [run(world_size, args.reps) for world_size in args.world_sizes]
    provenance["loadavg_end"] = load()
    body = "\n\n".join(render(one) for one in runs)
    footer = f"load average at end: {_load_text(provenance['loadavg_end'])}"
    print(body + "\n" + footer)
    return {**provenance, "runs": runs}


if __name__ == "__main__":
    main()
