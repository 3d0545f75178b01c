"""The sync inside ``MetricCollection.compute()``: one fused exchange, per-member fused syncs, torchmetrics' own.

    python benchmarks/bench_collection.py [--world-sizes 2 4] [--rounds 15] [--computes 3]
    python benchmarks/bench_collection.py --quick     # a smoke test of the script (the figures mean nothing)

Each spawned rank (gloo on loopback, one intra-op thread) builds a ten-member classification collection (five
members sharing the ``[C]`` stat-score states, two a confusion matrix, two the ``cat`` lists of scores and targets,
a calibration error with ``cat`` lists of its own), updates it with two uneven batches, and then, for ``--rounds``
rounds, times a block of ``--computes`` ``compute()`` calls in each arm, the order of the arms rotating from
round to round (every member's cached result is dropped before each call, so each call syncs and computes):

* ``torchmetrics``: torchmetrics' own sync (``patched(sync="torchmetrics")``);
* ``per-member fused``: the fused sync with torchmetrics' own ``MetricCollection.compute`` (each member syncs in its
  own ``compute()``, two collectives each: what ``self.log_dict(collection)`` gets in Lightning);
* ``fused collection``: ``compute()`` under ``patched(sync="fused")``, one exchange for the collection;
* ``no sync``: torchmetrics' ``compute()`` with every member's sync turned off (``_to_sync = False``): the
  members' arithmetic, and everything else ``compute()`` does, alone.

Ranks meet at a barrier before each block, and a block's time is the slowest rank's. The sync's cost in an arm is
its ``compute()`` minus the same round's ``no sync`` one; reported per arm: collectives per ``compute()`` (the
default group's sequence number), the median ``compute()``, the median sync cost, and the median of the
per-round ratios of sync costs to torchmetrics' with a distribution-free 95% confidence interval.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._stats import spread

ARMS = ("torchmetrics", "per-member fused", "fused collection", "no sync")
CLASSES = 10


def _collection(rank: int) -> Any:
    """The ten-member collection, updated with rank ``rank``'s two uneven batches."""
    import torch

    from tests._workloads import classification_collection

    metrics = classification_collection(CLASSES)
    generator = torch.Generator().manual_seed(rank)
    for k in range(2):
        n = 1000 + 250 * rank + 100 * k
        probs = torch.randn(n, CLASSES, generator=generator).softmax(-1)
        metrics.update(probs, torch.randint(0, CLASSES, (n,), generator=generator))
    return metrics


def _rank_main(rounds: int, computes: int) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist
    from torchmetrics import MetricCollection

    import torchmetrics_gradpatch as tg

    warnings.filterwarnings("ignore")  # torchmetrics' per-call notes (empty classes and the like)
    torch.set_num_threads(1)
    group = dist.distributed_c10d._get_default_group()
    metrics = _collection(dist.get_rank())
    members = list(metrics.values(copy_state=False))
    own_compute = MetricCollection.__dict__["compute"]

    def compute(arm: str) -> None:
        for metric in members:
            metric._computed = None
        if arm == "torchmetrics":
            with tg.patched(sync="torchmetrics"):
                metrics.compute()
        elif arm == "no sync":
            saved = [metric._to_sync for metric in members]
            for metric in members:
                metric._to_sync = False
            try:
                with tg.patched(sync="torchmetrics"):
                    metrics.compute()
            finally:
                for metric, value in zip(members, saved, strict=True):
                    metric._to_sync = value
        else:
            with tg.patched(sync="fused"):
                if arm == "fused collection":
                    metrics.compute()
                else:  # torchmetrics' own MetricCollection.compute: each member's compute() syncs on its own
                    getattr(own_compute, "__wrapped__", own_compute)(metrics)

    def slowest(seconds: float) -> float:
        value = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    collectives = {}
    for arm in ARMS:
        compute(arm)  # warm-up, and the count
        before = group._get_sequence_number_for_group()
        compute(arm)
        collectives[arm] = group._get_sequence_number_for_group() - before
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    costs: dict[str, list[float]] = {arm: [] for arm in ARMS[:-1]}
    ratios: dict[str, list[float]] = {arm: [] for arm in ARMS[1:-1]}
    for round_ in range(rounds):
        order = ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]
        block = {}
        for arm in order:
            dist.barrier()
            started = time.perf_counter()
            for _ in range(computes):
                compute(arm)
            block[arm] = slowest((time.perf_counter() - started) / computes)
            times[arm].append(block[arm])
        for arm in costs:
            costs[arm].append(block[arm] - block["no sync"])
        for arm in ratios:
            ratios[arm].append(costs[arm][-1] / costs["torchmetrics"][-1])
    return {
        "collectives": collectives,
        "compute_seconds": {arm: spread(v) for arm, v in times.items()},
        "sync_seconds": {arm: spread(v) for arm, v in costs.items()},
        "sync_ratio_to_torchmetrics": {arm: spread(v) for arm, v in ratios.items()},
    }


def run(world_sizes: list[int], rounds: int, computes: int) -> dict[str, Any]:
    import torch
    import torchmetrics

    from tests.harness import spawn_ranks

    result: dict[str, Any] = {
        "command": "python benchmarks/bench_collection.py " + " ".join(sys.argv[1:]),
        "load_at_start": [round(v, 2) for v in os.getloadavg()],
        "torch": torch.__version__,
        "torchmetrics": torchmetrics.__version__,
        "rounds": rounds,
        "computes": computes,
        "worlds": {},
    }
    for world_size in world_sizes:
        ranks = spawn_ranks(_rank_main, world_size, args=(rounds, computes), timeout=1800)
        result["worlds"][str(world_size)] = ranks[0]
    result["load_at_end"] = [round(v, 2) for v in os.getloadavg()]
    return result


def as_text(result: dict[str, Any]) -> str:
    lines = [
        f"{result['command']}  (torch {result['torch']}, torchmetrics {result['torchmetrics']}, load "
        f"{result['load_at_start']} -> {result['load_at_end']}, {result['rounds']} rounds of "
        f"{result['computes']} compute() per arm)",
        "sync = compute() minus the same round's compute() with every member's sync off; medians, slowest rank",
    ]
    for world_size, row in result["worlds"].items():
        lines.append(f"\n{world_size} gloo ranks")
        lines.append(
            f"{'arm':18} {'collectives':>11} {'compute ms':>11} {'sync ms':>9} {'sync / torchmetrics [95% CI]':>30}"
        )
        for arm in ARMS:
            whole = row["compute_seconds"][arm]["median"]
            sync = row["sync_seconds"].get(arm)
            ratio = row["sync_ratio_to_torchmetrics"].get(arm)
            sync_text = f"{1e3 * sync['median']:9.2f}" if sync else f"{'':9}"
            ratio_text = (
                f"{ratio['median']:>12.3f} [{ratio['ci95_lo']:.3f}, {ratio['ci95_hi']:.3f}]"
                if ratio
                else (f"{1.0:>12.3f}" if arm == "torchmetrics" else "")
            )
            lines.append(f"{arm:18} {row['collectives'][arm]:>11} {1e3 * whole:>11.2f} {sync_text} {ratio_text}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--computes", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    world_sizes, rounds, computes = ([2], 2, 1) if args.quick else (args.world_sizes, args.rounds, args.computes)
    print(as_text(run(world_sizes, rounds, computes)))


if __name__ == "__main__":
    main()
