"""Where a fused collection step's time goes, part by part, beside the floor's.

    python benchmarks/bench_step_parts.py [--world-sizes 2 4] [--rounds 10] [--steps 20]
    python benchmarks/bench_step_parts.py --quick     # a smoke test of the script (the figures mean nothing)

The collection and batches of ``bench_step.py`` (five regression members whose outputs make the loss, a
``SpearmanCorrCoef`` riding along, all ``dist_sync_on_step=True``; uneven batches from its ``_batch``), its loss from
the outputs of a plain ``Linear(16, 1)`` (no DDP: the parts are the metrics'), on spawned gloo ranks. Two arms, in
alternating order from round to round: ``floor`` (the collection with ``distributed_available_fn`` false, then one
collective of the steady exchange's bytes, as in ``bench_step.py``) and ``one exchange`` (``patched(sync="fused")``).

Each part is timed by a wrapper around the function that does it (``time.perf_counter`` for the wall time and
``time.thread_time`` for the rank's CPU time, which a collective's wait does not use; a wrapper costs about a
microsecond a call, a few dozen calls a step), per step, on every rank: the forward and the backward of the metric
loss; within the fused forward, the first halves (``step._Step.begin``: torchmetrics' lines before ``compute()``),
the exchange (``collection.sync_members``) and its collective (``wire.gather_rows``), the reductions of the gathered
states (``exchange.set_states``: torchmetrics' stacking, reductions); in both arms, torchmetrics' ``compute()`` of the
members (each member's ``compute``), on local states in the floor and on synced states in the fused step. Reported
per part, wall time and CPU time: the median per step over all steps of a rank, the largest rank's. The exchange's
"rest" in CPU time is the package's own CPU per step, its collectives excluded. It imports nothing from ``tests/``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

if __package__:
    from benchmarks import _floor, _ranks, workloads
    from benchmarks.bench_step import FEATURES, _batch
else:  # run as a script: its own directory is on sys.path, here and in the spawned ranks
    import _floor  # type: ignore[no-redef]
    import _ranks  # type: ignore[no-redef]
    import workloads  # type: ignore[no-redef]
    from bench_step import FEATURES, _batch  # type: ignore[no-redef]

ARMS = ("floor", "one exchange")
PARTS = (
    ("step", "the step: forward and backward of the metric loss"),
    ("forward", "  forward"),
    ("begin", "    first halves: torchmetrics' lines before compute()"),
    ("exchange", "    the exchange"),
    ("collective", "      its collective (the floor's: after the forward)"),
    ("exchange_rest", "      the rest: describe, pack, read back, plan"),
    ("reduce", "    torchmetrics' reductions of the gathered states"),
    ("compute", "    torchmetrics' compute() of the members"),
    ("forward_rest", "    the rest of the forward"),
    ("backward", "  backward"),
)


def _never() -> bool:
    return False


def _parts(rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """One rank: per arm and part, the median per step."""
    import warnings

    import torch
    import torch.distributed as dist

    import torchmetrics_gradpatch as tg
    from torchmetrics_gradpatch.fused import collection, exchange, step, wire

    warnings.filterwarnings("ignore")  # SpearmanCorrCoef's note on its buffer
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1).double()
    metrics = {
        "floor": workloads.step_collection(distributed_available_fn=_never),
        "one exchange": workloads.step_collection(),
    }
    spent: dict[str, float] = defaultdict(float)  # per part its wall time, and per "cpu " + part its CPU time

    def timed(function: Callable[..., Any], part: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent["cpu " + part] += time.thread_time() - cpu
                spent[part] += time.perf_counter() - started

        return wrapper

    for members in metrics.values():
        for member in members.values():
            member.compute = timed(member.compute, "compute")  # the instance's wrapped compute, as forward calls it
    places = [(step._Step, "begin", "begin"), (collection, "sync_members", "exchange")]
    places.append((exchange, "set_states", "reduce"))
    places.append((wire, "gather_rows", "collective"))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in places]
    for owner, name, part in places:
        setattr(owner, name, timed(getattr(owner, name), part))
    gather: list[Callable[[], None]] = []  # the floor's collective, made once the capacity has settled

    def one(arm: str, index: int) -> dict[str, float]:
        x, y = _batch(rank, index)
        spent.clear()
        started, cpu = time.perf_counter(), time.thread_time()
        values = metrics[arm](model(x).squeeze(-1), y)
        if arm == "floor":
            gather[0]()
        middle, middle_cpu = time.perf_counter(), time.thread_time()
        loss = values["MeanSquaredError"] + values["MeanAbsoluteError"] + (1 - values["R2Score"])
        loss = loss + (1 - values["ExplainedVariance"]) + (1 - values["PearsonCorrCoef"])
        loss.backward()
        ended, ended_cpu = time.perf_counter(), time.thread_time()
        found = {"step": ended - started, "forward": middle - started, "backward": ended - middle, **spent}
        found |= {"cpu step": ended_cpu - cpu, "cpu forward": middle_cpu - cpu, "cpu backward": ended_cpu - middle_cpu}
        inside = ("begin", "exchange", "reduce", "compute") if arm == "one exchange" else ("collective", "compute")
        for clock in ("", "cpu "):
            if arm == "one exchange":
                found[clock + "exchange_rest"] = found[clock + "exchange"] - found[clock + "collective"]
            found[clock + "forward_rest"] = found[clock + "forward"] - sum(found.get(clock + p, 0.0) for p in inside)
        return found

    try:
        with tg.patched(sync="fused"):
            for index in range(3):
                one("one exchange", index)
            floor = _floor.collective(_floor.exchange_bytes(dist.group.WORLD), dist.group.WORLD)
            gather.append(timed(floor, "collective"))
        seen: dict[str, dict[str, list[float]]] = {arm: defaultdict(list) for arm in ARMS}
        for round_ in range(rounds):
            for arm in ARMS if round_ % 2 else ARMS[::-1]:
                metrics[arm].reset()
                dist.barrier()
                with tg.patched(sync="fused" if arm == "one exchange" else "torchmetrics"):
                    for index in range(steps):
                        for part, seconds in one(arm, 3 + round_ * steps + index).items():
                            seen[arm][part].append(seconds)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return {arm: {part: statistics.median(values) for part, values in seen[arm].items()} for arm in ARMS}


def as_text(world_size: int, ranks: list[dict[str, dict[str, float]]]) -> str:
    lines = [f"\n{world_size} gloo ranks: ms per step (median over a rank's steps, the largest rank's), wall and CPU"]
    lines.append(f"{'part':58} {'floor':>8} {'one exchange':>13} {'floor CPU':>10} {'one exchange CPU':>17}")
    for part, label in PARTS:
        cells = []
        for key in (part, "cpu " + part):
            for arm in ARMS:
                found = [r[arm][key] for r in ranks if key in r[arm]]
                cells.append(f"{1e3 * max(found):.3f}" if found else "")
        lines.append(f"{label:58} {cells[0]:>8} {cells[1]:>13} {cells[2]:>10} {cells[3]:>17}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.world_sizes, args.rounds, args.steps = [2], 2, 2
    import torch
    import torchmetrics

    print(f"{_ranks.package()}, torch {torch.__version__}, torchmetrics {torchmetrics.__version__}", flush=True)
    for world_size in args.world_sizes:
        print(as_text(world_size, _ranks.spawn_ranks(_parts, world_size, (args.rounds, args.steps))), flush=True)


if __name__ == "__main__":
    main()
