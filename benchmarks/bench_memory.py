"""Peak memory of one ``Metric.sync()``: torchmetrics' own sync against the fused sync, beside the gathered size.

    python benchmarks/bench_memory.py [--world-sizes 2 4 8] [--elements 20000000]
    python benchmarks/bench_memory.py --quick     # a smoke test of the script (seconds; the figures mean nothing)

Every measurement runs on fresh spawned ranks (gloo on loopback, CPU, one intra-op thread), one arm per spawn, so no
arm inherits another's freed memory. Each rank fills its Metric(s), settles, resets its peak resident set size
(``VmHWM``), syncs once and reads the peak: the memory the sync added, on the rank where it is largest. The arms:
``torchmetrics`` (torchmetrics' own sync, the package unpatched), ``fused`` and, for the large cases, ``fused,
payload`` (the fused sync with the large-state path off: every state in the one payload).

Cases:

* ``BinaryAUROC`` (``thresholds=None``: a float32 ``preds`` and an int64 ``target`` ``cat`` state) holding
  ``--elements`` samples over all ranks, unevenly (rank ``r`` holds its share times ``0.9`` to ``1.1``) in one
  batch, at every world size; at the second world size with one rank holding half of them; at the first, in 20
  batches per rank (so each state is a list of 20 tensors, which torchmetrics joins before it gathers); at the
  first two, in 200 and in 2,000 batches per rank (as a validation epoch builds them: many small tensors).
* at the first world size, mixes: 200 small ``cat`` states and 100 small sum states in one Metric; a
  ``MetricCollection`` (``BinaryAUROC`` and ``BinaryAveragePrecision`` sharing their states, a ``CatMetric``,
  ``MeanSquaredError``) synced by the collection's one exchange against each member's own sync; a 1,000-class
  ``MulticlassConfusionMatrix`` (a reduced state); a ``MeanMetric`` whose two float32 sum states hold 4M values
  each (gathered and stacked: a float sum is not reduced).

The gathered size is the bytes of every rank's states together: what each rank must hold after the sync.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from typing import Any

import _ranks

ARMS = ("torchmetrics", "fused, payload", "fused")


def _fill(case: str, rank: int, world_size: int, elements: int) -> list[Any]:
    """The case's Metric(s) holding rank ``rank``'s data."""
    import torch
    from torchmetrics import CatMetric, MeanMetric, MeanSquaredError, Metric, MetricCollection
    from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, MulticlassConfusionMatrix

    generator = torch.Generator().manual_seed(rank)
    if case.startswith("BinaryAUROC"):
        if case.endswith("half"):  # rank 0 holds half of the samples, the others share the rest
            n = elements // 2 if rank == 0 else elements // (2 * (world_size - 1))
        else:  # 0.9 to 1.1 times an even share
            n = int(elements / world_size * (0.9 + 0.2 * rank / max(1, world_size - 1)))
        metric = BinaryAUROC(thresholds=None, validate_args=False)
        batches = int(case.split(", ")[-1].split()[0].replace(",", "")) if "batches" in case else 1
        for k in range(batches):
            m = n // batches + (n % batches if k == 0 else 0)
            metric.update(torch.rand(m, generator=generator), torch.randint(0, 2, (m,), generator=generator))
        return [metric]
    if case == "200 small cat + 100 sum states":

        class Many(Metric):
            def __init__(self) -> None:
                super().__init__()
                for i in range(200):
                    self.add_state(f"c{i}", default=[], dist_reduce_fx="cat")
                for i in range(100):
                    self.add_state(f"s{i}", default=torch.zeros(1000), dist_reduce_fx="sum")

            def update(self) -> None:
                for i in range(200):
                    getattr(self, f"c{i}").append(torch.randn(20_000 + 100 * rank, generator=generator))
                for i in range(100):
                    setattr(self, f"s{i}", torch.randn(1000, generator=generator))

            def compute(self) -> None:
                pass

        many = Many()
        many.update()
        return [many]
    if case.startswith("MetricCollection"):
        n = 1_000_000 + 100_000 * rank
        collection = MetricCollection(
            {
                "auroc": BinaryAUROC(thresholds=None, validate_args=False),
                "ap": BinaryAveragePrecision(thresholds=None, validate_args=False),
            }
        )
        preds, target = torch.rand(n, generator=generator), torch.randint(0, 2, (n,), generator=generator)
        collection.update(preds, target)
        cat, mse = CatMetric(), MeanSquaredError()
        cat.update(torch.randn(n, generator=generator))
        mse.update(preds, target.float())
        members = [m for _, m in collection.items(keep_base=True, copy_state=False)]
        return [*members, cat, mse]
    if case.startswith("MeanMetric"):  # a float sum: gathered and stacked, not reduced
        mean = MeanMetric()
        mean.mean_value = torch.randn(4_000_000, generator=generator)
        mean.weight = torch.rand(4_000_000, generator=generator)
        return [mean]
    confusion = MulticlassConfusionMatrix(num_classes=1000, validate_args=False)
    confusion.update(torch.randint(0, 1000, (100_000,), generator=generator), torch.randint(0, 1000, (100_000,)))
    return [confusion]


def _state_bytes(metrics: list[Any]) -> int:
    import torch

    seen: set[int] = set()
    total = 0
    for metric in metrics:
        for attr in metric._reductions:
            value = getattr(metric, attr)
            for tensor in value if isinstance(value, list) else [value]:
                if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
    return total


def _rank_main(case: str, arm: str, elements: int) -> dict[str, Any]:
    import _memory
    import torch.distributed as dist
    from soak_workload import rss_kib, settled_rss_kib

    import torchmetrics_gradpatch as tg
    from torchmetrics_gradpatch.fused import collection, large

    warnings.simplefilter("ignore")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = _fill(case, rank, world_size, elements)
    own = _state_bytes(metrics)
    sizes = [None] * world_size
    dist.all_gather_object(sizes, own)
    if arm == "torchmetrics":
        tg.unpatch()
    else:
        tg.patch(sync="fused")
        if arm == "fused, payload":
            large.LARGE_MIN_BYTES = 1 << 62
    gc.collect()
    dist.barrier()
    before, _ = settled_rss_kib()
    _memory.reset_peak()
    started = time.perf_counter()
    if arm != "torchmetrics" and len(metrics) > 1:  # a collection: its one exchange
        for synced in collection.sync_members([(str(i), m) for i, m in enumerate(metrics)], "local").synced.values():
            synced.set_through_sync()
    else:
        for metric in metrics:
            metric.sync()
    seconds = time.perf_counter() - started
    peak = rss_kib("VmHWM")
    synced = sum(m._is_synced for m in metrics)
    dist.barrier()
    return {"peak_mib": (peak - before) / 1024, "seconds": seconds, "gathered": sum(sizes) / 2**20, "synced": synced}


def run(world_sizes: list[int], elements: int, quick: bool, only: str | None = None) -> list[dict[str, Any]]:
    cases: list[tuple[int, str, tuple[str, ...]]] = [(w, "BinaryAUROC, uneven", ARMS) for w in world_sizes]
    if len(world_sizes) > 1:
        cases.append((world_sizes[1], "BinaryAUROC, one rank holds half", ARMS))
    w0 = world_sizes[0]
    cases.append((w0, "BinaryAUROC, uneven, 20 batches per rank", ARMS))
    # as a validation epoch builds the states: many small tensors, and as many copies in sync()'s cache
    for world_size in world_sizes[:2]:
        for batches in ("200", "2,000"):
            cases.append((world_size, f"BinaryAUROC, uneven, {batches} batches per rank", ARMS))
    mixes = ("200 small cat + 100 sum states", "MetricCollection (4 members, 2 sharing)", "confusion matrix 1000",
             "MeanMetric, two 4M float32 sum states")  # fmt: skip
    for case in mixes:
        cases.append((w0, case, ("torchmetrics", "fused")))
    rows = []
    for world_size, case, arms in cases:
        if only is not None and only not in case:
            continue
        row: dict[str, Any] = {"world_size": world_size, "case": case}
        for arm in arms:
            results = _ranks.spawn_ranks(_rank_main, world_size, (case, arm, elements), timeout=900)
            row["gathered"] = results[0]["gathered"]
            row[arm] = max(r["peak_mib"] for r in results)
            row[arm + " s"] = max(r["seconds"] for r in results)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    g = row["gathered"]
    cells = [f"{row['world_size']:>2} ranks  {row['case']:46} gathered {g:8.1f} MiB"]
    for arm in ARMS:
        if arm in row:
            cells.append(f"{arm} {row[arm]:7.1f} MiB ({row[arm] / g:4.2f}x, {row[arm + ' s']:.2f} s)")
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--elements", type=int, default=20_000_000, help="BinaryAUROC samples over all ranks")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import torch
    import torchmetrics

    print(
        f"python benchmarks/bench_memory.py {' '.join(sys.argv[1:])}  (torch {torch.__version__}, torchmetrics "
        f"{torchmetrics.__version__}, {_ranks.package()}, {os.cpu_count()} cores)"
    )
    print("Peak resident memory one sync adds, on the rank where it is largest; x: over the gathered states.")
    run([2] if args.quick else args.world_sizes, 200_000 if args.quick else args.elements, args.quick, args.only)


if __name__ == "__main__":
    main()
