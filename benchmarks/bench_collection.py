"""How a MetricCollection's sync grows with the world: torchmetrics' own, per-member fused, one exchange, floors.

    python benchmarks/bench_collection.py [--world-sizes 2 4 8] [--rounds 5] [--classes 1000] [--plot PATH]
    python benchmarks/bench_collection.py --quick     # a smoke test of the script (the figures mean nothing)

The workload (``benchmarks/workloads.py``): a ``MulticlassConfusionMatrix`` over ``--classes`` classes (``[C, C]``
int64: 8 MB at 1,000) and macro ``MulticlassAccuracy`` and ``MulticlassF1Score`` sharing four ``[C]`` stat-score
states, updated with two uneven batches per rank. For each world size the script starts its own gloo ranks on
loopback (``torch.multiprocessing``, one intra-op thread each) and, per round, runs one ``compute()`` in each arm,
the arms' order rotating from round to round (every member's cached result is dropped first, so each call syncs):

* ``torchmetrics``: torchmetrics' own sync (``patched(sync="torchmetrics")``);
* ``per-member fused``: the fused sync with torchmetrics' own ``MetricCollection.compute`` (each member syncs in its
  own ``compute()``: what ``self.log_dict(collection)`` gets in Lightning);
* ``fused``: ``compute()`` under ``patched(sync="fused")``, one exchange for the collection;
* ``floor``: ``compute()`` of the same collection with every member's ``distributed_available_fn`` returning
  ``False`` (torchmetrics' own, no sync), then one ``all_gather_single`` (``all_gather_into_tensor`` on a torch
  without it) on the default group of the bytes a steady fused exchange moves in its collective 1:
  ``80`` + the group's inline capacity in bytes per rank, the capacity read after the warm-up of ``fused`` (and checked
  again at the end). The collectives the fused exchange issues beside that one (the reduced states' ``all_reduce``)
  are not in the floor;
* ``floor, synced``: ``compute()`` with torchmetrics' own sync, every member's ``_sync_dist`` standing in for
  torchmetrics' own without communication (every other rank's copy of a state this rank's, detached, stacked and
  reduced as torchmetrics does: ``_floor.stand_in``), then the floor's collective: what torchmetrics' path costs
  beside its communication.

Reported per arm: collectives per ``compute()`` (the default group's sequence number), the bytes of the buffers the
collectives fill on one rank (what ``all_gather`` receives into, what ``all_reduce`` reduces in place), the median
``compute()`` time (the slowest rank's) and the medians of the per-round ratios to torchmetrics' arm, to the
floor and to ``floor, synced``, with a distribution-free 95% confidence interval, then the floor's bytes per rank.
``--plot`` draws bytes and time against the world size (matplotlib). It imports nothing from ``tests/``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any

if __package__:
    from benchmarks import _floor, _report, workloads
    from benchmarks._stats import spread
else:  # run as a script: its own directory is on sys.path, here and in the spawned ranks
    import _floor  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]
    import workloads  # type: ignore[no-redef]
    from _stats import spread  # type: ignore[no-redef]

ARMS = ("torchmetrics", "per-member fused", "fused", "floor", "floor, synced")
_FILLING = ("all_gather", "all_reduce", "all_gather_into_tensor", "all_gather_single")


def _count_bytes(counter: list[int]) -> None:
    """Wrap the collectives that fill buffers, adding the bytes they fill on this rank to ``counter[0]``."""
    import torch.distributed as dist

    for name in _FILLING:
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            out = args[0] if args else kwargs.get("tensor_list", kwargs.get("tensor", kwargs.get("output_tensor")))
            tensors = out if isinstance(out, list) else [out]
            counter[0] += sum(t.numel() * t.element_size() for t in tensors)
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


def _unavailable() -> bool:
    return False


def _rank(rank: int, world_size: int, port: int, classes: int, rounds: int, results: Any) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from torchmetrics import MetricCollection

    import torchmetrics_gradpatch as tg

    warnings.filterwarnings("ignore")  # torchmetrics' notes on classes without samples
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    group = dist.distributed_c10d._get_default_group()
    metrics = workloads.scale_collection(classes)
    for preds, target in workloads.scale_batches(rank, classes):
        metrics.update(preds, target)
    members = list(metrics.values(copy_state=False))
    own_compute = MetricCollection.__dict__["compute"]
    filled = [0]
    _count_bytes(filled)
    floor: list[Any] = []  # the floor's collective, made once the capacity has settled
    available = [metric.distributed_available_fn for metric in members]
    stand_ins = [_floor.stand_in(metric, world_size) for metric in members]

    def compute(arm: str) -> None:
        for metric in members:
            metric._computed = None
        if arm == "torchmetrics":
            with tg.patched(sync="torchmetrics"):
                metrics.compute()
        elif arm == "floor":
            for metric in members:
                metric.distributed_available_fn = _unavailable
            try:
                with tg.patched(sync="torchmetrics"):
                    metrics.compute()
            finally:
                for metric, fn in zip(members, available, strict=True):
                    metric.distributed_available_fn = fn
            floor[0]()
        elif arm == "floor, synced":
            for metric, stand_in in zip(members, stand_ins, strict=True):
                metric._sync_dist = stand_in  # an instance attribute, over the class's, for this call
            try:
                with tg.patched(sync="torchmetrics"):
                    metrics.compute()
            finally:
                for metric in members:
                    del metric._sync_dist
            floor[0]()
        else:
            with tg.patched(sync="fused"):
                if arm == "fused":
                    metrics.compute()
                else:  # torchmetrics' own MetricCollection.compute: each member's compute() syncs on its own
                    getattr(own_compute, "__wrapped__", own_compute)(metrics)

    def slowest(seconds: float) -> float:
        value = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    counts: dict[str, dict[str, int]] = {}
    floor_bytes = 0
    for arm in ARMS:
        if arm == "floor":  # after the fused arm's warm-up: the capacity its steady exchanges use
            floor_bytes = _floor.exchange_bytes(group)
            floor.append(_floor.collective(floor_bytes, group))
        compute(arm)  # warm-up, and the counts
        before, filled[0] = group._get_sequence_number_for_group(), 0
        compute(arm)
        counts[arm] = {"collectives": group._get_sequence_number_for_group() - before, "bytes": filled[0]}
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_ in range(rounds):
        for arm in ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]:
            dist.barrier()
            started = time.perf_counter()
            compute(arm)
            times[arm].append(slowest(time.perf_counter() - started))
    if rank == 0:
        results.put({"counts": counts, "times": times, "floor_bytes": [floor_bytes, _floor.exchange_bytes(group)]})
    dist.barrier()
    dist.destroy_process_group()


def measure(world_size: int, classes: int, rounds: int) -> dict[str, Any]:
    """One world: spawn its ranks, return rank 0's counts and every round's times."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:  # a free port for rank 0's store; a race here fails loudly, never silently
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    processes = mp.start_processes(
        _rank, args=(world_size, port, classes, rounds, results), nprocs=world_size, join=False, start_method="spawn"
    )
    while not processes.join(timeout=600):
        pass
    return results.get()  # type: ignore[no-any-return]


def as_text(result: dict[str, Any]) -> str:
    lines = [
        f"{result['command']}  (torch {result['torch']}, torchmetrics {result['torchmetrics']}, {result['classes']} "
        f"classes, {result['rounds']} rounds, load {result['load_at_start']} -> {result['load_at_end']})",
        "bytes: what the collectives fill on one rank; compute(): medians, slowest rank; ratios: median of the "
        "per-round compute() ratios [95% CI]",
        f"{'ranks':>5} {'arm':18} {'collectives':>11} {'MiB filled':>10} {'compute() ms':>12} "
        f"{'/ torchmetrics':>20} {'/ floor':>20} {'/ floor, synced':>20}",
    ]

    def ratio(times: list[float], reference: list[float]) -> str:
        found = spread([t / r for t, r in zip(times, reference, strict=True)])
        return f"{found['median']:.2f} [{found['ci95_lo']:.2f}, {found['ci95_hi']:.2f}]"

    notes = []
    for world_size, row in result["worlds"].items():
        for arm in ARMS:
            count, times = row["counts"][arm], row["times"][arm]
            lines.append(
                f"{world_size:>5} {arm:18} {count['collectives']:>11} {count['bytes'] / 2**20:>10.2f} "
                f"{1e3 * statistics.median(times):>12.1f} {ratio(times, row['times']['torchmetrics']):>20} "
                f"{ratio(times, row['times']['floor']):>20} {ratio(times, row['times']['floor, synced']):>20}"
            )
        start, end = row["floor_bytes"]
        beyond = row["counts"]["fused"]["collectives"] - row["counts"]["floor"]["collectives"]
        notes.append(
            f"{world_size} ranks: the floor's collective, {start} bytes per rank"
            + (f" (at the end: {end})" if end != start else "")
            + (f"; the fused compute() issues {beyond} collective(s) more (reduced states)" if beyond > 0 else "")
        )
    lines += notes
    fused = {int(w): row["counts"]["fused"]["bytes"] for w, row in result["worlds"].items()}
    if len(fused) > 1:
        low, high = min(fused), max(fused)
        lines.append(f"fused bytes per rank, {high} ranks / {low} ranks: {fused[high] / fused[low]:.2f}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], plt: Any) -> Any:
    """Bytes filled per rank and compute() time against the world size, one line per arm."""
    worlds = sorted(int(w) for w in result["worlds"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for arm, style in zip(ARMS, ("o-", "s--", "^-", "x:", "d:"), strict=True):
        rows = [result["worlds"][str(w)] for w in worlds]
        left.plot(worlds, [r["counts"][arm]["bytes"] / 2**20 for r in rows], style, label=arm)
        right.plot(worlds, [1e3 * statistics.median(r["times"][arm]) for r in rows], style, label=arm)
    left.set(xlabel="ranks", ylabel="MiB filled per rank", title="bytes the collectives fill")
    right.set(xlabel="ranks", ylabel="ms (median, slowest rank)", title="compute()")
    for axis in (left, right):
        axis.set_xticks(worlds)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    right.legend()
    figure.suptitle(f"MetricCollection sync, {result['classes']} classes, gloo (torch {result['torch']})", fontsize=10)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--plot", metavar="PATH", help="also draw the figure (needs matplotlib)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.world_sizes, args.rounds, args.classes = [2], 2, 50
    result: dict[str, Any] = {
        **_report.started("bench_collection.py"),
        "classes": args.classes,
        "rounds": args.rounds,
        "worlds": {str(n): measure(n, args.classes, args.rounds) for n in args.world_sizes},
    }
    _report.finished(result, as_text, plot, args.plot)


if __name__ == "__main__":
    main()
