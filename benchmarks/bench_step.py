"""A DDP training step whose loss is a MetricCollection, against its floor: torchmetrics' own sync, the fused syncs.

    python benchmarks/bench_step.py [--world-sizes 2 4 8] [--modes local global] [--rounds 5] [--steps 8]
                                    [--plot PATH]
    python benchmarks/bench_step.py --quick     # a smoke test of the script (the figures mean nothing)

The loop, on every rank (gloo on loopback, one intra-op thread, ranks started by ``benchmarks/_ranks.py``): a small
model (``Linear(16, 1)`` in float64, wrapped in ``DistributedDataParallel`` over a process group of its own, so
its gradient all-reduce is not counted with the metrics'), uneven batches (``64 + 16 * rank`` samples and a few
more every other step), and a ``MetricCollection`` of ``MeanSquaredError``, ``MeanAbsoluteError``,
``ExplainedVariance``, ``R2Score`` and ``PearsonCorrCoef``, whose outputs make the loss, and a ``SpearmanCorrCoef``
riding along (synced, not in the loss), all ``dist_sync_on_step=True``; backward, an SGD step. Each arm has a
collection of its own, reset at the start of each round (so Spearman's list states hold the same batches in every
arm when timed). Arms, in rotating order from round to round, each ``--steps`` steps a round:

* ``no metrics``: the same step with a plain ``mse_loss``;
* ``floor``: the collection built with ``distributed_available_fn=lambda: False`` for every member (torchmetrics'
  own forward path, less the sync) and, right after its forward, inside the step, one ``all_gather_single``
  (``all_gather_into_tensor`` on a torch without it) on the default group of the bytes a steady fused exchange
  moves in its one collective: ``80`` + the group's inline capacity in bytes per rank, the capacity read after the
  warm-up of ``one exchange`` (and checked again at the end). Its forward and the loss's backward count, as in
  every arm;
  in global mode the floor has no backward collective;
* ``floor, synced``: the floor with what a sync gives each member computed on: each member's ``_sync_dist`` stands
  in (an instance attribute) for torchmetrics' own without communication, every other rank's copy of a state this
  rank's, detached, stacked, flattened and reduced as torchmetrics does. It costs what torchmetrics' own path
  does beside the communication: ``sync()``'s copy of the states, the reductions, and ``compute()`` and its backward
  on the synced states (``PearsonCorrCoef`` aggregates every rank's moments), which the floor leaves out; plus the
  floor's collective;
* ``torchmetrics``: torchmetrics' own sync (``patched(sync="torchmetrics")``; in global mode with this package's
  global gather);
* ``per-member fused``: the fused sync with torchmetrics' own ``MetricCollection.forward`` (each member's forward
  syncs on its own). Its collection is on a process group of its own: its exchanges, smaller than the collection's,
  would otherwise lower the default group's inline capacity (which follows the group's recent exchanges) under the
  next arm;
* ``one exchange``: ``patched(sync="fused")``: the collection's forward syncs every member in one exchange;
* ``one exchange, check``: ``patched(sync="fused", check=True)``: every fused step also runs torchmetrics' own path
  and compares (what check mode costs).

Per round, after the arms, ``bare collective`` times the floor's collective alone in a tight loop (``4 * --steps``
of them, back to back), for reference beside the same collective issued inside the floor's step.

Reported per arm: the collectives per timed step on the arm's metrics' group (its sequence number: forward +
backward; a range where steps differ), the median step time (per round, each rank's median, the slowest rank's),
the thread CPU time per step (``time.thread_time()``: the rank's calling thread, which collectives leave blocked,
not busy; the largest rank's), the CPU over the floor (per round and rank, the arm's median thread CPU per step
less the floor's, the largest rank's; for the fused arms, what the sync adds, collectives excluded: the package's
own CPU and torchmetrics' work on the synced states, which ``floor, synced``'s figure gives alone), the median of
the per-round ratios of the step time to the floor's with a distribution-free 95% confidence interval, the same
against ``floor, synced`` for the arms that sync, and the same for the metrics' time (the step less the ``no
metrics`` step) against torchmetrics' arm. Then, per world and mode: the floor's bytes per rank, its collective's
time inside the step and the bare collective's. ``--plot`` draws the step / floor ratio against the world size, a
panel per mode, with the 1.3x line (matplotlib). It imports nothing from ``tests/``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

if __package__:
    from benchmarks import _floor, _ranks, _report, workloads
    from benchmarks._stats import spread
else:  # run as a script: its own directory is on sys.path, here and in the spawned ranks
    import _floor  # type: ignore[no-redef]
    import _ranks  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]
    import workloads  # type: ignore[no-redef]
    from _stats import spread  # type: ignore[no-redef]

ARMS = (
    "no metrics",
    "floor",
    "floor, synced",
    "torchmetrics",
    "per-member fused",
    "one exchange",
    "one exchange, check",
)
#: the arms whose step issues the floor's collective in place of a sync
FLOORS = ("floor", "floor, synced")
#: the order of the warm-up: ``one exchange`` settles the default group's inline capacity, which the floors read
WARM_UP = ("no metrics", "torchmetrics", "per-member fused", "one exchange, check", "one exchange", *FLOORS)
FEATURES = 16
TICKS = (0.1, 0.2, 0.5, 1, 1.3, 2, 5, 10, 20, 50, 100)  # the plot's ratio axis (logarithmic)


def _batch(rank: int, step: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    n = 64 + 16 * rank + 4 * (step % 2)
    x = torch.randn(n, FEATURES, dtype=torch.float64, generator=generator)
    return x, x[:, :4].sum(-1) + 0.1 * torch.randn(n, dtype=torch.float64, generator=generator)


def _train(mode: str, rounds: int, steps: int) -> dict[str, Any]:
    """One rank's loop (see the module docstring): per arm and round its medians, per arm the collectives seen."""
    import time
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torchmetrics import MetricCollection

    import torchmetrics_gradpatch as tg

    warnings.filterwarnings("ignore")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Linear(FEATURES, 1).double(), process_group=dist.new_group(list(range(world_size)))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    default = dist.distributed_c10d._get_default_group()
    apart = dist.new_group(list(range(world_size)))  # per-member fused's metrics
    collection = workloads.step_collection

    metrics = {arm: collection() for arm in ARMS[2:]}
    metrics["per-member fused"] = collection(process_group=apart)
    metrics["floor"] = collection(distributed_available_fn=lambda: False)
    metrics["floor, synced"] = collection(distributed_available_fn=lambda: True)
    for member in metrics["floor, synced"].values():
        member._sync_dist = _floor.stand_in(member, world_size)
    groups = {arm: apart if arm == "per-member fused" else default for arm in ARMS}
    floor: list[Any] = []  # the floor's collective, made once the capacity has settled

    def own_forward(preds: Any, target: Any) -> Any:  # torchmetrics' own, whatever the class attribute holds now
        forward = MetricCollection.__dict__["forward"]
        return getattr(forward, "__wrapped__", forward)(metrics["per-member fused"], preds, target)

    def step(arm: str, index: int) -> tuple[float, float, int, int, float]:
        x, y = _batch(rank, index)
        group, collective = groups[arm], 0.0
        started, cpu = time.perf_counter(), time.thread_time()
        optimizer.zero_grad()
        preds = model(x).squeeze(-1)
        before = group._get_sequence_number_for_group()
        if arm == "no metrics":
            loss = torch.nn.functional.mse_loss(preds, y)
        else:
            values = own_forward(preds, y) if arm == "per-member fused" else metrics[arm](preds, y)
            if arm in FLOORS:
                issued = time.perf_counter()
                floor[0]()
                collective = time.perf_counter() - issued
            loss = values["MeanSquaredError"] + values["MeanAbsoluteError"] + (1 - values["R2Score"])
            loss = loss + (1 - values["ExplainedVariance"]) + (1 - values["PearsonCorrCoef"])
        middle = group._get_sequence_number_for_group()
        loss.backward()
        after = group._get_sequence_number_for_group()
        optimizer.step()
        return time.perf_counter() - started, time.thread_time() - cpu, middle - before, after - middle, collective

    def run(arm: str, first: int, count: int) -> list[tuple[float, float, int, int, float]]:
        sync = "torchmetrics" if arm in ("no metrics", *FLOORS, "torchmetrics") else "fused"
        with tg.patched(sync=sync, mode=mode, check=arm == "one exchange, check"):
            return [step(arm, first + k) for k in range(count)]

    nbytes = 0
    for arm in WARM_UP:
        if arm == "floor":  # the first of the floors
            nbytes = _floor.exchange_bytes(default)
            floor.append(_floor.collective(nbytes, default))
        run(arm, 0, 2)
    counts: dict[str, set[tuple[int, int]]] = {arm: set() for arm in ARMS}
    keys = ("step", "cpu", "collective")
    medians: dict[str, dict[str, list[float]]] = {arm: {key: [] for key in keys} for arm in ARMS}
    bare: list[float] = []
    for round_ in range(rounds):
        for arm in ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]:
            if arm != "no metrics":
                metrics[arm].reset()
            dist.barrier()
            done = run(arm, 2 + round_ * steps, steps)
            counts[arm].update((forward, backward) for _, _, forward, backward, _ in done)
            for key, column in zip(keys, (0, 1, 4), strict=True):
                medians[arm][key].append(statistics.median(row[column] for row in done))
        dist.barrier()
        started = time.perf_counter()
        for _ in range(4 * steps):
            floor[0]()
        bare.append((time.perf_counter() - started) / (4 * steps))
    return {
        "counts": {arm: sorted(found) for arm, found in counts.items()},
        "medians": medians,
        "bare": bare,
        "floor_bytes": nbytes,
        "floor_bytes_at_end": _floor.exchange_bytes(default),
    }


def measure(world_size: int, mode: str, rounds: int, steps: int) -> dict[str, Any]:
    """One world and mode: per arm the collectives seen on any rank and, per round, the slowest rank's medians."""
    ranks = _ranks.spawn_ranks(_train, world_size, (mode, rounds, steps))

    def slowest(values: list[list[float]]) -> list[float]:
        return [max(per_rank[i] for per_rank in values) for i in range(rounds)]

    floor_cpu = [r["medians"]["floor"]["cpu"] for r in ranks]
    return {
        "counts": {arm: sorted({tuple(c) for r in ranks for c in r["counts"][arm]}) for arm in ARMS},
        "times": {arm: slowest([r["medians"][arm]["step"] for r in ranks]) for arm in ARMS},
        "cpu": {arm: slowest([r["medians"][arm]["cpu"] for r in ranks]) for arm in ARMS},
        "cpu_over_floor": {
            arm: slowest(
                [
                    [c - f for c, f in zip(r["medians"][arm]["cpu"], own, strict=True)]
                    for r, own in zip(ranks, floor_cpu, strict=True)
                ]
            )
            for arm in ARMS
        },
        "floor_collective": slowest([r["medians"]["floor"]["collective"] for r in ranks]),
        "bare_collective": slowest([r["bare"] for r in ranks]),
        "floor_bytes": sorted({r["floor_bytes"] for r in ranks} | {r["floor_bytes_at_end"] for r in ranks}),
    }


def _counts_text(counts: list[tuple[int, int]]) -> str:
    def span(values: set[int]) -> str:
        return f"{min(values)}" if len(values) == 1 else f"{min(values)}-{max(values)}"

    return f"{span({f for f, _ in counts})} + {span({b for _, b in counts})}"


def _ratio_text(values: list[float]) -> str:
    found = spread(values)
    return f"{found['median']:.2f} [{found['ci95_lo']:.2f}, {found['ci95_hi']:.2f}]"


def as_text(result: dict[str, Any]) -> str:
    lines = [
        f"{result['command']}  (torch {result['torch']}, torchmetrics {result['torchmetrics']}, {result['rounds']} "
        f"rounds of {result['steps']} steps, load {result['load_at_start']} -> {result['load_at_end']})",
        "collectives: per step on the arm's metrics' group, forward + backward. step: median, slowest rank.",
        "CPU: thread CPU per step (time.thread_time(): a collective blocks the thread without using it), largest rank.",
        "CPU-floor: per round and rank, the arm's CPU less the floor's, largest rank.",
        "ratios: median of the per-round ratios [95% CI]: step / floor's; step / 'floor, synced''s; metrics' time "
        "(step less 'no metrics') / torchmetrics'.",
        f"{'ranks':>5} {'mode':6} {'arm':19} {'collectives':>11} {'step ms':>8} {'CPU ms':>7} {'CPU-floor ms':>12} "
        f"{'step / floor':>19} {'step / synced':>19} {'metrics / tm':>19}",
    ]
    notes = []
    for key, row in result["runs"].items():
        world_size, mode = key.split("/")
        base, floor, synced = row["times"]["no metrics"], row["times"]["floor"], row["times"]["floor, synced"]
        reference = [t - b for t, b in zip(row["times"]["torchmetrics"], base, strict=True)]
        for arm in ARMS:
            times = row["times"][arm]
            over_floor = _ratio_text([t / f for t, f in zip(times, floor, strict=True)])
            syncs = arm not in ("no metrics", *FLOORS)
            over_synced = _ratio_text([t / f for t, f in zip(times, synced, strict=True)]) if syncs else ""
            if arm in ("no metrics", *FLOORS):
                versus_tm = ""
            else:
                spent = [t - b for t, b in zip(times, base, strict=True)]
                versus_tm = _ratio_text([s / r for s, r in zip(spent, reference, strict=True)])
            cpu_over = (
                "" if arm in ("no metrics", "floor") else f"{1e3 * statistics.median(row['cpu_over_floor'][arm]):.2f}"
            )
            lines.append(
                f"{world_size:>5} {mode:6} {arm:19} {_counts_text(row['counts'][arm]):>11} "
                f"{1e3 * statistics.median(times):>8.2f} {1e3 * statistics.median(row['cpu'][arm]):>7.2f} "
                f"{cpu_over:>12} {over_floor:>19} {over_synced:>19} {versus_tm:>19}"
            )
        nbytes = " then ".join(str(n) for n in row["floor_bytes"])
        notes.append(
            f"{world_size} ranks, {mode}: the floor's collective, {nbytes} bytes per rank: "
            f"{1e3 * statistics.median(row['floor_collective']):.3f} ms inside the step, "
            f"{1e3 * statistics.median(row['bare_collective']):.3f} ms alone in a tight loop (bare collective)"
        )
        if len(row["floor_bytes"]) > 1:
            notes.append("  the inline capacity changed during the run: the floor's bytes are the first figure")
    return "\n".join(lines + notes) + "\n"


def plot(result: dict[str, Any], plt: Any) -> Any:
    """The step / floor ratio against the world size, one line per arm, one panel per gradient mode."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    modes = sorted({key.split("/")[1] for key in result["runs"]}, key=["local", "global"].index)
    worlds = sorted({int(key.split("/")[0]) for key in result["runs"]})
    figure, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes) + 2, 3.6), squeeze=False)
    arms = [arm for arm in ARMS if arm != "floor"]
    for axis, mode in zip(axes[0], modes, strict=True):
        plotted: list[float] = []
        for arm, style in zip(arms, ("x:", "d:", "o-", "s--", "^-", "v-."), strict=True):
            ratios = []
            for world_size in worlds:
                row = result["runs"][f"{world_size}/{mode}"]["times"]
                ratios.append(statistics.median(t / f for t, f in zip(row[arm], row["floor"], strict=True)))
            axis.plot(worlds, ratios, style, label=arm)
            plotted += ratios
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.axhline(1.3, color="grey", linestyle="--", linewidth=0.8, label="1.3x the floor")
        axis.set(xlabel="ranks", ylabel="step time / floor (median)", title=f"{mode} mode", yscale="log")
        axis.set_xticks(worlds)
        low, high = min(0.9, *plotted), max(1.4, *plotted)
        axis.set_yticks([tick for tick in TICKS if low <= tick <= high])
        axis.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure.suptitle(f"MetricCollection loss in a DDP step, gloo (torch {result['torch']})", fontsize=10)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["local", "global"], choices=["local", "global"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--plot", metavar="PATH", help="also draw the figure (needs matplotlib)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.world_sizes, args.modes, args.rounds, args.steps = [2], ["local"], 2, 2
    print(_ranks.package(), flush=True)
    result: dict[str, Any] = {
        **_report.started("bench_step.py"),
        "rounds": args.rounds,
        "steps": args.steps,
        "runs": {
            f"{n}/{mode}": measure(n, mode, args.rounds, args.steps) for n in args.world_sizes for mode in args.modes
        },
    }
    _report.finished(result, as_text, plot, args.plot)


if __name__ == "__main__":
    main()
