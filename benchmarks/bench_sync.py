"""Fused sync against torchmetrics' own sync and against its floor: collectives and wall time per Metric sync.

    python benchmarks/bench_sync.py [--world-sizes 2 4] [--rounds 15]
    python benchmarks/bench_sync.py --quick     # a smoke test of the script (seconds; the figures mean nothing)

Each spawned rank (gloo on loopback, one intra-op thread) builds every case's Metric on a process group of the
case's own (so one case's exchanges leave the next case's inline capacity alone), updates it once with an uneven
batch, and then, for ``--rounds`` rounds, times one block of syncs per method, the order of the three methods
rotating from round to round:

* ``torchmetrics``: ``Metric._sync_dist`` as torchmetrics ships it, with torchmetrics' gather;
* ``fused``: :func:`torchmetrics_gradpatch.fused.fused_sync` in local mode;
* ``floor``: per Metric, one ``all_gather_single`` (``all_gather_into_tensor`` on a torch without it) on the case's
  group of the bytes a steady fused exchange moves in its collective 1: ``80`` + the group's inline capacity in bytes
  per rank, the capacity read after the warm-up fused syncs of the case (and checked again at the end). Where the
  fused sync issues more collectives than that one (a large ``cat`` state's, a reduced state's), the floor leaves
  them out, and its ratio is marked ``*``;
* ``floor, synced``: per Metric, torchmetrics' own ``_sync_dist`` without its communication (every other rank's copy
  of a state this rank's, detached; ``_floor.stand_in``): the stacking, flattening, reductions and setting of the
  states that any sync with torchmetrics' result does, then the floor's collective.

The states are put back after each sync, so every sync starts from the same local states. Ranks meet at a barrier
before each block, and a block's time is the slowest rank's. Reported per case: collectives per sync (the group's
sequence number), the median time per sync of each method, and the medians of the per-round ratios fused /
torchmetrics and fused / floor with a distribution-free 95% confidence interval; then the floor's bytes per rank
and the fused sync's packing buffer (its one copy of the local states' bytes, plus the description and alignment)
against the bytes of the local states. A 'sync' of the collection case is every member's, one after another.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import _floor
import _ranks
from _stats import spread

#: syncs per timed block, per case (more for the fast ones, so that a scheduler hiccup does not decide a block)
CASES = {"MeanSquaredError": 40, "MulticlassAccuracy macro (4 [C] states)": 30, "10-member MetricCollection": 4,
         "1M-element cat state": 4}  # fmt: skip
METHODS = ("torchmetrics", "fused", "floor", "floor, synced")


def _metrics(case: str, rank: int, group: Any) -> list[Any]:
    """The case's Metric(s) on process group ``group``, updated once with rank ``rank``'s (uneven) batch."""
    import torch
    from torchmetrics import CatMetric, MaxMetric, MeanMetric, MinMetric, SumMetric
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision
    from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, PearsonCorrCoef

    generator = torch.Generator().manual_seed(rank)
    n = 64 + 16 * rank
    preds, target = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    probs, labels = torch.randn(n, 10, generator=generator).softmax(-1), torch.randint(0, 10, (n,), generator=generator)
    on = {"process_group": group}
    if case == "MeanSquaredError":
        metrics = [MeanSquaredError(**on)]
    elif case.startswith("MulticlassAccuracy"):
        metrics = [MulticlassAccuracy(num_classes=10, average="macro", **on)]
    elif case.startswith("10-member"):
        metrics = [MeanSquaredError(**on), MeanAbsoluteError(**on), PearsonCorrCoef(**on), MeanMetric(**on),
                   SumMetric(**on), MaxMetric(**on), MinMetric(**on),
                   MulticlassAccuracy(num_classes=10, average="macro", **on),
                   MulticlassPrecision(num_classes=10, average="macro", **on),
                   MulticlassF1Score(num_classes=10, **on)]  # fmt: skip
    else:
        metric = CatMetric(**on)
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

    from torchmetrics_gradpatch.fused import fused_sync, wire

    torch.set_num_threads(1)
    original = Metric.__dict__["_sync_dist"]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    floor: list[Any] = []  # the case's floor collective, made once its capacity has settled
    stand_ins: list[Any] = []  # the case's stand-ins for torchmetrics' _sync_dist, without communication

    def sync(method: str, metrics: list[Any]) -> None:
        if method == "floor":
            for _ in metrics:
                floor[0]()
            return
        if method == "floor, synced":
            for metric, stand_in in zip(metrics, stand_ins, strict=True):
                saved = {attr: getattr(metric, attr) for attr in metric._reductions}
                stand_in()
                floor[0]()
                for attr, value in saved.items():
                    setattr(metric, attr, value)
            return
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
        group = dist.new_group(list(range(world_size)))
        metrics = _metrics(case, rank, group)
        stand_ins[:] = [_floor.stand_in(metric, world_size) for metric in metrics]
        collectives, floor_bytes = {}, 0
        for method in METHODS:
            if method == "floor":  # after the fused sync's warm-up: the capacity its steady exchanges use
                floor_bytes = _floor.exchange_bytes(group)
                floor[:] = [_floor.collective(floor_bytes, group)]
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
            described = [wire.State(0, tuple(wire.piece_of(t) for t in p)) for p in pieces]
            packed += wire.layout(described, 8 * len(wire.encode(described)))[1]
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        ratios: dict[str, list[float]] = {"torchmetrics": [], "floor": [], "floor, synced": []}
        for round_ in range(rounds):
            order = METHODS[round_ % len(METHODS) :] + METHODS[: round_ % len(METHODS)]
            block = {}
            for method in order:
                dist.barrier()
                started = time.perf_counter()
                for _ in range(syncs):
                    sync(method, metrics)
                block[method] = slowest((time.perf_counter() - started) / syncs)
                times[method].append(block[method])
            for reference, found in ratios.items():
                found.append(block["fused"] / block[reference])
        out[case] = {
            "collectives_per_metric_sync": collectives,
            "metrics_per_sync": len(metrics),
            "seconds_per_sync": {m: spread(v) for m, v in times.items()},
            "ratio_fused_over_torchmetrics": spread(ratios["torchmetrics"]),
            "ratio_fused_over_floor": spread(ratios["floor"]),
            "ratio_fused_over_synced_floor": spread(ratios["floor, synced"]),
            "floor_bytes_per_rank": floor_bytes,
            "floor_bytes_at_end": _floor.exchange_bytes(group),
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
        "A 'sync' is one Metric's (the collection: every member's, one after another); the floor: one collective of "
        "the fused exchange's collective-1 bytes per Metric; the synced floor: the same after torchmetrics' own "
        "_sync_dist without its communication.",
        "ms: median per sync, slowest rank; ratios: median of the per-round ratios [95% CI].",
    ]

    def ratio(found: dict[str, float]) -> str:
        return f"{found['median']:.2f} [{found['ci95_lo']:.2f}, {found['ci95_hi']:.2f}]"

    notes = 0
    for world_size, cases in result["worlds"].items():
        lines.append(f"\n{world_size} gloo ranks")
        lines.append(
            f"{'case':39} {'collectives tm/fused/floors':>27} {'ms tm':>7} {'ms fused':>8} {'ms floor':>8} "
            f"{'ms synced':>9} {'fused / tm':>18} {'fused / floor':>20} {'fused / synced':>20}"
        )
        for case, row in cases.items():
            c, k, t = row["collectives_per_metric_sync"], row["metrics_per_sync"], row["seconds_per_sync"]
            counts = " / ".join(f"{c[m] * k:.0f}" for m in METHODS)
            beyond = c["fused"] > c["floor"]  # collectives the floors leave out
            marked = ratio(row["ratio_fused_over_floor"]) + (" *" if beyond else "  ")
            synced = ratio(row["ratio_fused_over_synced_floor"]) + (" *" if beyond else "  ")
            lines.append(
                f"{case:39} {counts:>27} {1e3 * t['torchmetrics']['median']:>7.3f} {1e3 * t['fused']['median']:>8.3f} "
                f"{1e3 * t['floor']['median']:>8.3f} {1e3 * t['floor, synced']['median']:>9.3f} "
                f"{ratio(row['ratio_fused_over_torchmetrics']):>18} {marked:>20} {synced:>20}"
            )
            notes += beyond
        lines.append(f"{'case':39} {'floor bytes per rank':>26} {'pack/state bytes':>17}")
        for case, row in cases.items():
            nbytes = f"{row['floor_bytes_per_rank']}"
            if row["floor_bytes_at_end"] != row["floor_bytes_per_rank"]:
                nbytes += f" (at the end: {row['floor_bytes_at_end']})"
            lines.append(
                f"{case:39} {nbytes:>26} {row['packing_buffer_bytes'] / max(1, row['local_state_bytes']):>17.3f}"
            )
    if notes:
        lines.append(
            "* the fused sync issues collectives the floors leave out (a large cat state's, a reduced state's): "
            "fused / floor is not against its whole exchange"
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
