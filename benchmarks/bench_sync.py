"""Fused sync against torchmetrics' own sync: collectives and wall time per Metric sync, side by side in one run.

    python benchmarks/bench_sync.py [--world-sizes 2 4] [--rounds 15]
    python benchmarks/bench_sync.py --quick     # a smoke test of the script (seconds; the figures mean nothing)

Each spawned rank (gloo on loopback, one intra-op thread) builds every case's Metric, updates it once with an
uneven batch, and then, for ``--rounds`` rounds, times one block of syncs per method, the order of the two methods
alternating from round to round. A sync is ``Metric._sync_dist`` as torchmetrics ships it, with torchmetrics'
gather (``torchmetrics``), or :func:`torchmetrics_gradpatch.fused.fused_sync` in local mode (``fused``); the
states are put back after each sync, so every sync starts from the same local states. Ranks meet at a barrier
before each block, and a block's time is the slowest rank's. Reported per case: collectives per sync (the
process group's sequence number), the median time per sync of each method, and the median of the per-round
ratios fused / torchmetrics with a distribution-free 95% confidence interval. The fused sync's packing buffer
(its one copy of the local states' bytes, plus the description and alignment) is reported against the bytes of
the local states.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import _ranks
from _stats import spread

#: syncs per timed block, per case (more for the fast ones, so that a scheduler hiccup does not decide a block)
CASES = {"MeanSquaredError": 40, "MulticlassAccuracy macro (4 [C] states)": 30, "10-member MetricCollection": 4,
         "1M-element cat state": 4}  # fmt: skip
METHODS = ("torchmetrics", "fused")


def _metrics(case: str, rank: int) -> list[Any]:
    """The case's Metric(s), updated once with rank ``rank``'s (uneven) batch."""
    import torch
    from torchmetrics import CatMetric, MaxMetric, MeanMetric, MinMetric, SumMetric
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision
    from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, PearsonCorrCoef

    generator = torch.Generator().manual_seed(rank)
    n = 64 + 16 * rank
    preds, target = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    probs, labels = torch.randn(n, 10, generator=generator).softmax(-1), torch.randint(0, 10, (n,), generator=generator)
    if case == "MeanSquaredError":
        metrics = [MeanSquaredError()]
    elif case.startswith("MulticlassAccuracy"):
        metrics = [MulticlassAccuracy(num_classes=10, average="macro")]
    elif case.startswith("10-member"):
        metrics = [MeanSquaredError(), MeanAbsoluteError(), PearsonCorrCoef(), MeanMetric(), SumMetric(),
                   MaxMetric(), MinMetric(), MulticlassAccuracy(num_classes=10, average="macro"),
                   MulticlassPrecision(num_classes=10, average="macro"), MulticlassF1Score(num_classes=10)]  # fmt: skip
    else:
        metric = CatMetric()
        metric.update(torch.randn(1_000_000 + 1000 * rank, generator=generator))
        return [metric]
    for metric in metrics:
        name = type(metric).__name__
        if name.startswith("Multiclass"):
            metric.update(probs, labels)
        elif name in ("MeanMetric", "SumMetric", "MaxMetric", "MinMetric"):
            metric.update(preds)
        else:
            metric.update(preds, target)
    return metrics


def _rank_main(rounds: int, cases: dict[str, int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torchmetrics import Metric
    from torchmetrics.utilities.distributed import gather_all_tensors

    from torchmetrics_gradpatch.fused import fused_sync
    from torchmetrics_gradpatch.fused import wire as _fused_pack

    torch.set_num_threads(1)
    original = Metric.__dict__["_sync_dist"]
    group = dist.distributed_c10d._get_default_group()
    rank = dist.get_rank()

    def sync(method: str, metrics: list[Any]) -> None:
        for metric in metrics:
            saved = {attr: getattr(metric, attr) for attr in metric._reductions}
            if method == "fused":
                fused_sync(metric)
            else:
                original(metric, gather_all_tensors)
            for attr, value in saved.items():
                setattr(metric, attr, value)

    def slowest(seconds: float) -> float:
        value = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    out: dict[str, Any] = {}
    for case, syncs in cases.items():
        metrics = _metrics(case, rank)
        collectives = {}
        for method in METHODS:
            sync(method, metrics)  # warm-up, and the count
            before = group._get_sequence_number_for_group()
            sync(method, metrics)
            collectives[method] = (group._get_sequence_number_for_group() - before) / len(metrics)
        state_bytes = sum(
            t.numel() * t.element_size()
            for m in metrics
            for v in (getattr(m, a) for a in m._reductions)
            for t in (v if isinstance(v, list) else [v])
        )
        packed = 0  # the fused sync's send buffer: description, each state's bytes, alignment
        for metric in metrics:
            pieces = [
                [v] if isinstance(v, torch.Tensor) else list(v)
                for v in (getattr(metric, a) for a in metric._reductions)
            ]
            described = [_fused_pack.State(0, tuple(_fused_pack.piece_of(t) for t in p)) for p in pieces]
            packed += _fused_pack.layout(described, 8 * len(_fused_pack.encode(described)))[1]
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        ratios = []
        for round_ in range(rounds):
            order = METHODS if round_ % 2 == 0 else METHODS[::-1]
            block = {}
            for method in order:
                dist.barrier()
                started = time.perf_counter()
                for _ in range(syncs):
                    sync(method, metrics)
                block[method] = slowest((time.perf_counter() - started) / syncs)
                times[method].append(block[method])
            ratios.append(block["fused"] / block["torchmetrics"])
        out[case] = {
            "collectives_per_metric_sync": collectives,
            "metrics_per_sync": len(metrics),
            "seconds_per_sync": {m: spread(v) for m, v in times.items()},
            "ratio_fused_over_torchmetrics": spread(ratios),
            "local_state_bytes": state_bytes,
            "packing_buffer_bytes": packed,
        }
    return out


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def run(world_sizes: list[int], rounds: int, cases: dict[str, int]) -> dict[str, Any]:
    import torch
    import torchmetrics

    result: dict[str, Any] = {
        "command": "python benchmarks/bench_sync.py " + " ".join(sys.argv[1:]),
        "load_at_start": _load(),
        "torch": torch.__version__,
        "torchmetrics": torchmetrics.__version__,
        "package": _ranks.package(),
        "rounds": rounds,
        "worlds": {},
    }
    for world_size in world_sizes:
        result["worlds"][str(world_size)] = _ranks.spawn_ranks(_rank_main, world_size, (rounds, cases))[0]
    result["load_at_end"] = _load()
    return result


def as_text(result: dict[str, Any]) -> str:
    lines = [
        f"{result['command']}  (torch {result['torch']}, torchmetrics "
        f"{result['torchmetrics']}, {result['package']}, load {result['load_at_start']} -> {result['load_at_end']}, "
        f"{result['rounds']} rounds)",
        "A 'sync' is one Metric's (the collection: every member's, one after another).",
    ]
    for world_size, cases in result["worlds"].items():
        lines.append(f"\n{world_size} gloo ranks")
        header = f"{'case':42} {'collectives tm/fused':>21} {'ms tm':>8} {'ms fused':>9}"
        lines.append(header + f" {'fused/tm [95% CI]':>24} {'pack/state bytes':>17}")
        for case, row in cases.items():
            c = row["collectives_per_metric_sync"]
            k = row["metrics_per_sync"]
            t = row["seconds_per_sync"]
            r = row["ratio_fused_over_torchmetrics"]
            lines.append(
                f"{case:42} {c['torchmetrics'] * k:>10.0f} / {c['fused'] * k:<8.0f} "
                f"{1e3 * t['torchmetrics']['median']:>8.3f} {1e3 * t['fused']['median']:>9.3f} "
                f"{r['median']:>8.3f} [{r['ci95_lo']:.3f}, {r['ci95_hi']:.3f}]      "
                f"{row['packing_buffer_bytes'] / max(1, row['local_state_bytes']):>8.3f}"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cases = {name: 1 for name in CASES} if args.quick else CASES
    result = run([2] if args.quick else args.world_sizes, 2 if args.quick else args.rounds, cases)
    print(as_text(result))


if __name__ == "__main__":
    main()
