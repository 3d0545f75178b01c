"""A DDP training step whose loss is a MetricCollection: torchmetrics' own sync, per-member fused, one exchange.

    python benchmarks/bench_step.py [--world-sizes 2 4 8] [--modes local global] [--rounds 5] [--steps 8]
                                    [--plot PATH]
    python benchmarks/bench_step.py --quick     # a smoke test of the script (the figures mean nothing)

The loop, on every rank (gloo on loopback, one intra-op thread, ranks started by ``benchmarks/_ranks.py``): a small
model (``Linear(16, 1)`` in float64, wrapped in ``DistributedDataParallel`` over a process group of its own, so
its gradient all-reduce is not counted with the metrics'), uneven batches (``64 + 16 * rank`` samples and a few
more every other step), and a ``MetricCollection`` of ``MeanSquaredError``, ``MeanAbsoluteError``,
``ExplainedVariance``, ``R2Score`` and ``PearsonCorrCoef``, all ``dist_sync_on_step=True``, whose outputs make the
loss; backward, an SGD step. Arms, in rotating order from round to round, each ``--steps`` steps a round:

* ``no metrics``: the same step with a plain ``mse_loss`` (what the metrics' time is measured from);
* ``torchmetrics``: torchmetrics' own sync (``patched(sync="torchmetrics")``; in global mode with this package's
  global gather);
* ``per-member fused``: the fused sync with torchmetrics' own ``MetricCollection.forward`` (each member's forward
  syncs on its own);
* ``one exchange``: ``patched(sync="fused")``: the collection's forward syncs every member in one exchange.

Reported per arm: the collectives per step on the default group (its sequence number: forward + backward), the
median step time (the slowest rank's), the metrics' time (the step time less the ``no metrics`` arm's, per round)
and its share of the step, and the median of the per-round ratios of the metrics' time to torchmetrics' arm with
a distribution-free 95% confidence interval. ``--plot`` draws the metrics' time against the world size, a panel
per mode (matplotlib). It imports nothing from ``tests/``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

if __package__:
    from benchmarks import _ranks, _report
    from benchmarks._stats import spread
else:  # run as a script: its own directory is on sys.path, here and in the spawned ranks
    import _ranks  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]
    from _stats import spread  # type: ignore[no-redef]

ARMS = ("no metrics", "torchmetrics", "per-member fused", "one exchange")
FEATURES = 16


def _batch(rank: int, step: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    n = 64 + 16 * rank + 4 * (step % 2)
    x = torch.randn(n, FEATURES, dtype=torch.float64, generator=generator)
    return x, x[:, :4].sum(-1) + 0.1 * torch.randn(n, dtype=torch.float64, generator=generator)


def _train(mode: str, rounds: int, steps: int) -> dict[str, Any]:
    """One rank's loop (see the module docstring): per arm the collectives of one step and every step's time."""
    import time
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torchmetrics import MetricCollection
    from torchmetrics.regression import (
        ExplainedVariance,
        MeanAbsoluteError,
        MeanSquaredError,
        PearsonCorrCoef,
        R2Score,
    )

    import torchmetrics_gradpatch as tg

    warnings.filterwarnings("ignore")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Linear(FEATURES, 1).double(), process_group=dist.new_group(list(range(world_size)))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    kinds = (MeanSquaredError, MeanAbsoluteError, ExplainedVariance, R2Score, PearsonCorrCoef)
    metrics = MetricCollection([kind(dist_sync_on_step=True) for kind in kinds])
    group = dist.distributed_c10d._get_default_group()

    def own_forward(preds: Any, target: Any) -> Any:  # torchmetrics' own, whatever the class attribute holds now
        forward = MetricCollection.__dict__["forward"]
        return getattr(forward, "__wrapped__", forward)(metrics, preds, target)

    def step(arm: str, index: int) -> tuple[float, int, int]:
        x, y = _batch(rank, index)
        started = time.perf_counter()
        optimizer.zero_grad()
        preds = model(x).squeeze(-1)
        before = group._get_sequence_number_for_group()
        if arm == "no metrics":
            loss = torch.nn.functional.mse_loss(preds, y)
        else:
            values = own_forward(preds, y) if arm == "per-member fused" else metrics(preds, y)
            loss = values["MeanSquaredError"] + values["MeanAbsoluteError"] + (1 - values["R2Score"])
            loss = loss + (1 - values["ExplainedVariance"]) + (1 - values["PearsonCorrCoef"])
        middle = group._get_sequence_number_for_group()
        loss.backward()
        after = group._get_sequence_number_for_group()
        optimizer.step()
        return time.perf_counter() - started, middle - before, after - middle

    def run(arm: str, first: int, count: int) -> list[tuple[float, int, int]]:
        sync = "torchmetrics" if arm in ("no metrics", "torchmetrics") else "fused"
        with tg.patched(sync=sync, mode=mode):
            return [step(arm, first + k) for k in range(count)]

    counts = {arm: run(arm, 0, 2)[-1][1:] for arm in ARMS}  # warm-up; a steady step's collectives
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_ in range(rounds):
        for arm in ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]:
            dist.barrier()
            times[arm].append(statistics.median(t for t, _, _ in run(arm, 2 + round_ * steps, steps)))
    return {"counts": counts, "times": times}


def measure(world_size: int, mode: str, rounds: int, steps: int) -> dict[str, Any]:
    """One world and mode: rank 0's counts, and per arm and round the slowest rank's median step time."""
    ranks = _ranks.spawn_ranks(_train, world_size, (mode, rounds, steps))
    times = {arm: [max(r["times"][arm][i] for r in ranks) for i in range(rounds)] for arm in ARMS}
    return {"counts": ranks[0]["counts"], "times": times}


def as_text(result: dict[str, Any]) -> str:
    lines = [
        f"{result['command']}  (torch {result['torch']}, torchmetrics {result['torchmetrics']}, {result['rounds']} "
        f"rounds of {result['steps']} steps, load {result['load_at_start']} -> {result['load_at_end']})",
        "collectives per step on the default group: forward + backward; step: median, slowest rank; metrics: step "
        "less the 'no metrics' step; ratio: median of the per-round metrics-time ratios to torchmetrics' [95% CI]",
        f"{'ranks':>5} {'mode':6} {'arm':18} {'collectives':>11} {'step ms':>8} {'metrics ms':>10} {'share':>6} "
        f"{'metrics / torchmetrics':>24}",
    ]
    for key, row in result["runs"].items():
        world_size, mode = key.split("/")
        base = row["times"]["no metrics"]
        reference = [t - b for t, b in zip(row["times"]["torchmetrics"], base, strict=True)]
        for arm in ARMS:
            forward, backward = row["counts"][arm]
            times = row["times"][arm]
            spent = [t - b for t, b in zip(times, base, strict=True)]
            step_ms, metrics_ms = 1e3 * statistics.median(times), 1e3 * statistics.median(spent)
            if arm == "no metrics":
                ratio_text, share = "", ""
            else:
                ratio = spread([s / r for s, r in zip(spent, reference, strict=True)])
                ratio_text = f"{ratio['median']:.2f} [{ratio['ci95_lo']:.2f}, {ratio['ci95_hi']:.2f}]"
                share = f"{100 * metrics_ms / step_ms:.0f}%"
            lines.append(
                f"{world_size:>5} {mode:6} {arm:18} {f'{forward} + {backward}':>11} {step_ms:>8.1f} "
                f"{metrics_ms if arm != 'no metrics' else 0.0:>10.1f} {share:>6} {ratio_text:>24}"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], plt: Any) -> Any:
    """The metrics' time per step against the world size, one line per arm, one panel per gradient mode."""
    modes = sorted({key.split("/")[1] for key in result["runs"]}, key=["local", "global"].index)
    worlds = sorted({int(key.split("/")[0]) for key in result["runs"]})
    figure, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 3.6), squeeze=False)
    for axis, mode in zip(axes[0], modes, strict=True):
        for arm, style in zip(ARMS[1:], ("o-", "s--", "^-"), strict=True):
            spent = []
            for world_size in worlds:
                row = result["runs"][f"{world_size}/{mode}"]["times"]
                spent.append(1e3 * statistics.median(t - b for t, b in zip(row[arm], row["no metrics"], strict=True)))
            axis.plot(worlds, spent, style, label=arm)
        axis.set(xlabel="ranks", ylabel="metrics' ms per step (median)", title=f"{mode} mode")
        axis.set_xticks(worlds)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0][-1].legend()
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
