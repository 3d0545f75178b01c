"""One exchange per MetricCollection step under the fused sync, on real gloo ranks: forward values, the states after
every step, gradients (local and global mode) and the epoch-end compute() bit for bit as torchmetrics' own sync
gives them, for seeded random member mixes; one exchange per step; opt-out members as today; and every kind of
change between ranks ending in the same error on every rank, never a hang.

Each rank runs the same steps twice on the same data, under torchmetrics' own sync and under the fused sync (in
global mode, torchmetrics' own collectives with this package's global gather). Collectives are counted with the
process group's sequence number; the spawned cases of one world size run in one call.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics import Metric, MetricCollection
from torchmetrics.aggregation import CatMetric
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC
from torchmetrics.regression import (
    CosineSimilarity,
    ExplainedVariance,
    MeanAbsoluteError,
    MeanSquaredError,
    PearsonCorrCoef,
    R2Score,
)
from torchmetrics.utilities.distributed import gather_all_tensors

import torchmetrics_gradpatch as tg
from tests._rank_tools import calls, destroy_subgroup, dynamo_refusal, every_rank
from tests._ranks import run_ranks
from tests.test_fused import same, worlds
from tests.test_fused_collection import Loss, outcome_of
from torchmetrics_gradpatch.fused import collection

#: What one exchange of the fused sync costs: one collective while the group's agreed capacity holds the payload
#: (steady), two where it does not (a group's first exchange, a payload that grew). The step's own assertion is that
#: the collection runs ONE exchange (counted at ``sync_members``) costing this, whatever the number of members.
EXCHANGE_COLLECTIVES = (1, 2)
STEADY = 1


class Accuracy(BinaryAccuracy):
    """Binary accuracy on the regression inputs: the target read as labels (stat-score tensor states)."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(preds.sigmoid(), (target > 0).long())


class AUROC(BinaryAUROC):
    """Binary AUROC on the regression inputs (two ``cat`` states)."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(preds.sigmoid(), (target > 0).long())


class Rows(Loss):
    """:class:`tests.test_fused_collection.Loss` (a sum, a max and the order of a ``cat`` state), with
    ``full_state_update`` as asked."""

    def __init__(self, full: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._full = full

    @property
    def full_state_update(self) -> bool:  # type: ignore[override]
        return self._full


class Failing(Metric):
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total = self.total + preds.sum()

    def compute(self) -> torch.Tensor:
        raise ValueError("a failing compute")


def own_gather(result: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    return gather_all_tensors(result, group)


#: ``compute_with_cache=False`` where torchmetrics has it (1.0 on)
NO_CACHE = {"compute_with_cache": False} if hasattr(MeanAbsoluteError(), "compute_with_cache") else {}

#: name -> (maker, whether its value is differentiable: it goes into the loss)
POOL: dict[str, tuple[Callable[..., Metric], bool]] = {
    "mse": (MeanSquaredError, True),
    "mae": (lambda **kw: MeanAbsoluteError(**NO_CACHE, **kw), True),
    "ev": (ExplainedVariance, True),
    "r2": (R2Score, True),
    "pearson": (PearsonCorrCoef, True),  # full_state_update=True
    "acc": (Accuracy, False),
    "auroc": (AUROC, False),
    "rows": (Rows, True),
    "rows_full": (lambda **kw: Rows(full=True, **kw), True),
    "rows_cpu": (lambda **kw: Rows(compute_on_cpu=True, **kw), True),
}


def mix(seed: int) -> dict[str, dict[str, Any]]:
    """A seeded member mix: names and their keyword arguments (the first syncs on step, most others too)."""
    rng = random.Random(seed)
    names = rng.sample(sorted(POOL), rng.randint(3, 6))
    return {name: {"dist_sync_on_step": i == 0 or rng.random() < 0.8} for i, name in enumerate(names)}


#: seeds whose mixes, together, have every member of the pool join and members of both forward paths opt out
SEEDS = (0, 1, 3, 5)


def build(members: dict[str, dict[str, Any]]) -> MetricCollection:
    return MetricCollection({name: POOL[name][0](**kwargs) for name, kwargs in members.items()}, compute_groups=False)


def batch(rank: int, seed: int, step_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven batches whose size changes from step to step."""
    generator = torch.Generator().manual_seed(10_000 * seed + 100 * step_index + rank)
    n = 3 + rank + (step_index * (rank + 1)) % 4
    return torch.randn(n, dtype=torch.float64, generator=generator), torch.randn(
        n, dtype=torch.float64, generator=generator
    )


def states(metrics: MetricCollection) -> dict[str, Any]:
    """Every member's states, ``_update_count`` and ``_forward_cache``."""
    out: dict[str, Any] = {}
    for key, metric in metrics.items(keep_base=True, copy_state=False):
        for name in metric._defaults:
            out[f"{key}.{name}"] = getattr(metric, name)
        out[f"{key}._update_count"] = metric._update_count
        out[f"{key}._forward_cache"] = metric._forward_cache
    return out


def alike(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(alike(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(alike, a, b))
    if isinstance(a, torch.Tensor) or (isinstance(a, list) and all(isinstance(x, torch.Tensor) for x in a)):
        return same(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(alike, a, b))
    return bool(a == b) and type(a) is type(b)


@contextmanager
def exchanges() -> Iterator[list[int]]:
    """Count the collection exchanges run inside (calls of ``sync_members``), calling through to the real one."""
    real = collection.sync_members
    seen: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return real(*args, **kwargs)

    collection.sync_members = counting  # type: ignore[assignment]
    try:
        yield seen
    finally:
        collection.sync_members = real  # type: ignore[assignment]


def run_steps(
    metrics: MetricCollection, rank: int, seed: int, sync: str, mode: str, steps: int = 3
) -> tuple[list[Any], list[Any], list[Any], Any, list[int], list[int]]:
    """``steps`` training steps (forward, a loss from the differentiable members, backward), then ``compute()``:
    per step the forward values, the states and the preds' gradient, the epoch value, collectives and exchanges
    per step."""
    values, after, grads, counts, exchanged = [], [], [], [], []
    with tg.patched(mode=mode, sync=sync):
        for k in range(steps):
            preds, target = batch(rank, seed, k)
            leaf = preds.clone().requires_grad_()
            with exchanges() as seen:
                before = calls()
                result = metrics(leaf, target)
                counts.append(calls() - before)
            exchanged.append(len(seen))
            loss = sum(
                (v for key, v in result.items() if POOL.get(key, (None, True))[1] and v.requires_grad),
                torch.zeros((), dtype=torch.float64),
            )
            if loss.requires_grad:
                loss.backward()
            values.append(result)
            after.append(states(metrics))
            grads.append(leaf.grad)
        epoch = metrics.compute()
    return values, after, grads, epoch, counts, exchanged


def _random_mixes_bit_identical(rank: int, world_size: int, mode: str, seed: int) -> None:
    members = mix(seed)
    expected = run_steps(build(members), rank, seed, "torchmetrics", mode)
    got = run_steps(build(members), rank, seed, "fused", mode)
    for k in range(len(expected[0])):
        assert alike(got[0][k], expected[0][k]), (members, k, got[0][k], expected[0][k])
        assert alike(got[1][k], expected[1][k]), (members, k)
        assert (got[2][k] is None) == (expected[2][k] is None) and (
            got[2][k] is None or same(got[2][k], expected[2][k])
        ), (members, k, got[2][k], expected[2][k])
    assert alike(got[3], expected[3]), members
    # one exchange per step for every step-syncing member; the others sync nothing on step
    assert got[5] == [1] * len(got[5]), got[5]
    assert all(c in EXCHANGE_COLLECTIVES for c in got[4]), (members, got[4], expected[4])


def _five_member_loss(rank: int, world_size: int, mode: str) -> None:
    """The regression collection of the benchmark: every member syncs on step, one exchange a step, and in global
    mode one backward collective."""
    members = {name: {"dist_sync_on_step": True} for name in ("mse", "mae", "ev", "r2", "pearson")}
    expected = run_steps(build(members), rank, 7, "torchmetrics", mode)
    metrics = build(members)
    got = run_steps(metrics, rank, 7, "fused", mode)
    assert alike(got[0], expected[0]) and alike(got[1], expected[1]) and alike(got[3], expected[3])
    assert all(same(a, b) for a, b in zip(got[2], expected[2], strict=True))
    # the states' sizes do not change from step to step: after the group's first exchange, one collective a step
    assert got[4][0] in EXCHANGE_COLLECTIVES and got[4][1:] == [STEADY] * 2, got[4]
    assert min(expected[4]) > 10 * max(got[4]), (got[4], expected[4])
    with tg.patched(mode=mode, sync="fused"):
        preds, target = batch(rank, 7, 5)
        leaf = preds.clone().requires_grad_()
        loss = sum(metrics(leaf, target).values(), torch.zeros((), dtype=torch.float64))
        before = calls()
        loss.backward()
        assert calls() - before == (1 if mode == "global" else 0)  # one backward node for the whole exchange


class Sum(Metric):
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total = self.total + preds.sum() - target.sum()

    def compute(self) -> torch.Tensor:
        return self.total * 1.0


def _opt_outs_sync_as_today(rank: int, world_size: int) -> None:
    subgroup = dist.new_group(list(range(world_size)))

    def make() -> MetricCollection:
        return MetricCollection(
            {
                "joins": Sum(dist_sync_on_step=True),
                "also": Rows(dist_sync_on_step=True),
                "no_step": Sum(),
                "own_fn": Sum(dist_sync_on_step=True, dist_sync_fn=own_gather),
                "own_group": Sum(dist_sync_on_step=True, process_group=subgroup),
            },
            compute_groups=False,
        )

    alone = Sum(dist_sync_on_step=True, dist_sync_fn=own_gather)
    alone.update(*batch(rank, 3, 0))
    own_fn_calls = calls()
    with tg.patched(sync="torchmetrics"):
        alone.sync(dist_sync_fn=own_gather)  # what the member with its own dist_sync_fn costs alone
    own_fn_calls = calls() - own_fn_calls
    expected, fused = make(), make()
    with tg.patched(sync="torchmetrics"):
        reference = expected(*batch(rank, 3, 1))
    with tg.patched(sync="fused"), exchanges() as seen:
        before, before_group = calls(), calls(subgroup)
        result = fused(*batch(rank, 3, 1))
        count, group_count = calls() - before, calls(subgroup) - before_group
    # the member tables first, the members that opt out at their places (the one with its own dist_sync_fn as
    # today), then one exchange for the members that join
    assert len(seen) == 2 and count - own_fn_calls in (2, 3, 4), (seen, count, own_fn_calls)
    assert group_count in EXCHANGE_COLLECTIVES  # its own group's member: the fused sync of one Metric
    assert alike(result, reference) and alike(states(fused), states(expected))
    destroy_subgroup(subgroup)


def _changes_between_ranks(rank: int, world_size: int) -> None:
    """A member opting out or added on one rank, a dtype that differs: the same error on every rank, quickly, every
    joining member as after its update; a dtype changed on every rank, a batch size that changes: torchmetrics'
    values."""

    def pair() -> dict[str, Metric]:
        return {"a": Sum(dist_sync_on_step=True), "b": Rows(dist_sync_on_step=True)}

    cases: dict[str, tuple[Callable[[], MetricCollection], torch.dtype]] = {
        "opts out on one rank": (
            lambda: MetricCollection(
                {"a": Sum(dist_sync_on_step=True), "b": Sum(dist_sync_on_step=rank != 1)}, compute_groups=False
            ),
            torch.float64,
        ),
        "added on one rank": (
            lambda: MetricCollection(dict(list(pair().items())[: 1 + (rank == 1)]), compute_groups=False),
            torch.float64,
        ),
        "dtype on one rank": (  # rank 1's batch in float32: its 'cat' state too
            lambda: MetricCollection(pair(), compute_groups=False),
            torch.float32 if rank == 1 else torch.float64,
        ),
    }
    expected_text = {
        "opts out on one rank": "rank 1: does not sync on step (dist_sync_on_step=False)",
        "added on one rank": "collections of different sizes",
        "dtype on one rank": "must agree in dtype",
    }
    for case, (make, dtype) in cases.items():
        metrics = make()
        preds, target = (t.to(dtype) for t in batch(rank, 5, 0))
        plain = make()
        plain.update(preds, target)  # what each member holds after its update of this batch
        with tg.patched(sync="fused"):
            outcome, took = outcome_of(lambda: metrics(preds, target))  # noqa: B023
        outcomes = every_rank(outcome)
        assert len(set(outcomes)) == 1 and expected_text[case] in outcome and took < 10, (case, outcomes)
        for key, metric in metrics.items(keep_base=True, copy_state=False):
            if metric.dist_sync_on_step:
                other = plain[key]
                assert alike(
                    {n: getattr(metric, n) for n in metric._defaults}, {n: getattr(other, n) for n in other._defaults}
                ), (case, key)
                assert not metric._is_synced and metric._update_count == 1
    # a member whose compute() fails after the exchange: every member as after its update of this batch
    metrics, plain = (
        MetricCollection(
            {"a": Sum(dist_sync_on_step=True), "f": Failing(dist_sync_on_step=True), "b": Rows(dist_sync_on_step=True)},
            compute_groups=False,
        )
        for _ in "ab"
    )
    plain.update(*batch(rank, 6, 0))
    with tg.patched(sync="fused"), pytest.raises(ValueError, match="a failing compute"):
        metrics(*batch(rank, 6, 0))
    assert alike(
        {k: {n: getattr(m, n) for n in m._defaults} for k, m in metrics.items(keep_base=True, copy_state=False)},
        {k: {n: getattr(m, n) for n in m._defaults} for k, m in plain.items(keep_base=True, copy_state=False)},
    )
    assert not any(m._is_synced for m in metrics.values(copy_state=False))
    # every rank changes dtype between steps; sizes change every step: torchmetrics' values
    expected, fused = (MetricCollection({"r": Rows(dist_sync_on_step=True), "m": MeanSquaredError()}) for _ in "ab")
    for metrics, sync in ((expected, "torchmetrics"), (fused, "fused")):
        with tg.patched(sync=sync):
            metrics(*batch(rank, 9, 0))
            metrics.set_dtype(torch.float32)
            metrics(*(t.float() for t in batch(rank, 9, 1)))
    assert alike(states(fused), states(expected))


class RowsSquared(Rows):
    """The same states as :class:`Rows` (a compute group with it), another value."""

    def compute(self) -> torch.Tensor:
        return super().compute() ** 2 / 7


def _compute_group(rank: int, world_size: int) -> None:
    """Members of a named compute group: each sends its own batch states, the values are torchmetrics'."""
    results = {}
    for sync in ("torchmetrics", "fused"):
        metrics = MetricCollection(
            {"rows": Rows(dist_sync_on_step=True), "squared": RowsSquared(dist_sync_on_step=True)},
            compute_groups=[["rows", "squared"]],
        )
        with tg.patched(sync=sync), exchanges() as seen:
            values = [metrics(*batch(rank, 11, k)) for k in range(2)]
            metrics.update(*batch(rank, 11, 2))  # the first update() links the group's states
            values.append(metrics(*batch(rank, 11, 3)))
            results[sync] = (values, states(metrics), metrics.compute(), len(seen))
    # three steps and the epoch's compute(), one exchange each
    assert alike(results["fused"][:3], results["torchmetrics"][:3]) and results["fused"][3] == 4


def _kept_inputs(rank: int, world_size: int) -> None:
    """Members that keep the input itself as a state (``CatMetric``, ``CosineSimilarity``'s ``cat`` states) beside
    members that compute from it in their update: the input's gradient is summed from every member's part in the
    order torchmetrics' own forward makes their nodes, bit for bit (float32, where that order shows in the last
    bits)."""
    cases: dict[str, tuple[Callable[[], dict[str, Metric]], Callable[[torch.Tensor], dict[str, torch.Tensor]]]] = {
        "cat": (
            lambda: {"cat": CatMetric(dist_sync_on_step=True), "pearson": PearsonCorrCoef(dist_sync_on_step=True)},
            lambda leaf: {"value": leaf, "preds": leaf},
        ),
        "cosine": (
            lambda: {
                "cosine": CosineSimilarity(reduction="sum", dist_sync_on_step=True),
                "pearson": PearsonCorrCoef(num_outputs=5, dist_sync_on_step=True),
            },
            lambda leaf: {"preds": leaf * 2},
        ),
    }
    for name, (members, inputs) in cases.items():
        for mode in ("local", "global"):
            results = {}
            for sync in ("torchmetrics", "fused"):
                metrics = MetricCollection(members(), compute_groups=False)
                values, grads = [], []
                with tg.patched(mode=mode, sync=sync):
                    for k in range(3):
                        generator = torch.Generator().manual_seed(100 * k + rank)
                        shape = (4 + rank + k,) if name == "cat" else (4 + rank + k, 5)
                        leaf = torch.randn(shape, generator=generator).requires_grad_()
                        target = torch.randn(shape, generator=generator)
                        result = metrics(target=target, **inputs(leaf))
                        sum((value.sum() for value in result.values()), torch.zeros(())).backward()
                        values.append(result)
                        grads.append(leaf.grad)
                results[sync] = (values, grads)
            assert alike(results["fused"][0], results["torchmetrics"][0]), (name, mode)
            assert all(same(a, b) for a, b in zip(*(results[s][1] for s in ("fused", "torchmetrics")), strict=True)), (
                name,
                mode,
                results["fused"][1],
                results["torchmetrics"][1],
            )


def _under_torch_compile(rank: int, world_size: int) -> None:
    refusal = dynamo_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    members = {name: {"dist_sync_on_step": True} for name in ("mse", "rows")}
    expected, fused = build(members), build(members)
    with tg.patched(sync="torchmetrics"):
        reference = expected(*batch(rank, 4, 0))
    compiled = torch.compile(lambda p, t: fused(p, t), backend="eager")
    with tg.patched(sync="fused"), exchanges() as seen:
        before = calls()
        result = compiled(*batch(rank, 4, 0))
        assert calls() - before in EXCHANGE_COLLECTIVES and seen == [1]
    assert alike(result, reference)


def _step_cases(rank: int, world_size: int) -> None:
    for mode in ("local", "global"):
        _five_member_loss(rank, world_size, mode)
        for seed in SEEDS:
            _random_mixes_bit_identical(rank, world_size, mode, seed)
    _compute_group(rank, world_size)
    _kept_inputs(rank, world_size)
    _opt_outs_sync_as_today(rank, world_size)
    _changes_between_ranks(rank, world_size)


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_collection_steps_in_one_exchange_bit_identical(world_size: int) -> None:
    run_ranks(_step_cases, world_size, timeout=240)


@pytest.mark.compile
def test_forward_under_torch_compile_runs_one_exchange_behind_a_graph_break() -> None:
    run_ranks(_under_torch_compile, 2, timeout=120)


def test_the_seeded_mixes_cover_the_pool() -> None:
    joined = {name for seed in SEEDS for name, kwargs in mix(seed).items() if kwargs["dist_sync_on_step"]}
    left_out = {name for seed in SEEDS for name, kwargs in mix(seed).items() if not kwargs["dist_sync_on_step"]}
    assert joined == set(POOL) and {"mse", "pearson", "rows"} <= left_out  # both forward paths opt out


def test_without_a_process_group_forward_is_torchmetrics_own() -> None:
    assert not dist.is_initialized()
    members = {name: {"dist_sync_on_step": True} for name in ("mse", "rows", "pearson")}
    expected, fused = build(members), build(members)
    reference = expected(*batch(0, 1, 0))
    with tg.patched(sync="fused"):
        assert alike(fused(*batch(0, 1, 0)), reference)
    assert alike(states(fused), states(expected))


#: this module's own Metric classes, trusted in its rank bodies: its subject is the collection's exchange, not which
#: classes the exchange trusts (tests/test_fused_trust.py)
TRUSTED = (Accuracy, AUROC, Rows, Failing, Sum, RowsSquared, Loss)
