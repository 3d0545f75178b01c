"""The fused sync takes over only the members in the form its tests prove, on real gloo ranks: every other form a
collection allows (torchmetrics' wrappers, module hooks of every kind, global module hooks, one Metric under two
keys, compute groups sharing list states) gives torchmetrics' own forward values, states, flags, ``_forward_cache``,
gradients and ``compute()`` bit for bit, or the same error; ranks whose members differ in form (a hook or a
``dist_sync_fn`` on one rank only) return torchmetrics' own values instead of waiting.

Each rank runs the same steps twice on the same data, under torchmetrics' own sync and under the fused sync, and
compares. Random draws are seeded alike before each run.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchmetrics
from torchmetrics import Metric, MetricCollection, wrappers
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, MulticlassAccuracy
from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, PearsonCorrCoef

import torchmetrics_gradpatch as tg
from tests._rank_tools import every_rank
from tests._ranks import run_ranks
from tests.test_fused import same, worlds
from tests.test_fused_step import Rows, RowsSquared, alike, own_gather


def probability(preds: torch.Tensor) -> torch.Tensor:
    return preds.sigmoid()


def label(target: torch.Tensor) -> torch.Tensor:
    return (target > 0).long()


class AUROC(BinaryAUROC):
    """Binary AUROC on regression inputs (two ``cat`` states; a compute group with :class:`AP`)."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(probability(preds), label(target))


class AP(BinaryAveragePrecision):
    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(probability(preds), label(target))


class TwoClass(MulticlassAccuracy):
    """Per-class accuracy of two classes on regression inputs (what ``ClasswiseWrapper`` names per class)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(num_classes=2, average=None, **kwargs)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        p = probability(preds)
        super().update(torch.stack([1 - p, p], dim=-1), label(target))


class Pairs(wrappers.MultioutputWrapper):
    """Two outputs of the regression inputs (a user's adapter around a torchmetrics wrapper)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(MeanSquaredError(**kwargs), num_outputs=2)

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> Any:
        return super().forward(torch.stack([preds, 2 * preds], -1), torch.stack([target, target], -1))

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(torch.stack([preds, 2 * preds], -1), torch.stack([target, target], -1))


def _line(*release: int) -> bool:
    return tuple(int(p) for p in torchmetrics.__version__.split(".")[:2]) >= release


#: name -> maker(**sync keyword arguments); the plain members, then one form a test of the pool draws
PLAIN: dict[str, Callable[..., Metric]] = {
    "mse": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "pearson": PearsonCorrCoef,
    "rows": Rows,
    "squared": RowsSquared,  # the states of Rows: a compute group with it (a differentiable cat state)
    "auroc": AUROC,
    "ap": AP,
}
WRAPPED: dict[str, Callable[..., Metric]] = {
    "minmax": lambda **kw: wrappers.MinMaxMetric(MeanSquaredError(**kw)),
    "classwise": lambda **kw: wrappers.ClasswiseWrapper(TwoClass(**kw), labels=["neg", "pos"]),
    "bootstrap": lambda **kw: wrappers.BootStrapper(MeanSquaredError(**kw), num_bootstraps=3),
    "multioutput": Pairs,
    "compositional": lambda **kw: MeanSquaredError(**kw) + MeanAbsoluteError(**kw),
}
if _line(1, 0):
    WRAPPED["running"] = lambda **kw: wrappers.Running(MeanSquaredError(**kw), window=2)
if _line(1, 5):
    WRAPPED["lambda"] = lambda **kw: wrappers.LambdaInputTransformer(MeanSquaredError(**kw), transform_pred=torch.tanh)


def batch(rank: int, seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven batches whose size changes from step to step."""
    generator = torch.Generator().manual_seed(10_000 * seed + 100 * k + rank)
    n = 4 + rank + (k * (rank + 1)) % 3
    return (
        torch.randn(n, dtype=torch.float64, generator=generator),
        torch.randn(n, dtype=torch.float64, generator=generator),
    )


def flags(metrics: MetricCollection) -> dict[str, Any]:
    """Every Metric's states, counts, caches and flags, the wrapped ones too."""
    out: dict[str, Any] = {}
    for key, member in metrics.items(keep_base=True, copy_state=False):
        for path, metric in member.named_modules(prefix=key):
            if not isinstance(metric, Metric):
                continue
            for name in metric._defaults:
                out[f"{path}.{name}"] = getattr(metric, name)
            for name in ("_update_count", "_forward_cache", "_computed", "_is_synced", "_should_unsync", "_to_sync"):
                out[f"{path}.{name}"] = getattr(metric, name, None)
    return out


def comparable(value: Any) -> Any:
    """``value`` with tensors detached and anything else kept (for :func:`alike`)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(comparable(v) for v in value)
    return value.detach() if isinstance(value, torch.Tensor) else value


def run(make: Callable[[], MetricCollection], rank: int, seed: int, sync: str, mode: str) -> list[Any]:
    """One ``update()`` (which links a compute group's states), three training steps (forward, a loss from every
    value that requires grad, backward) and two ``compute()``: the states and flags after the update; per step the
    values, the states and flags, the input's gradient; then the epoch's values and states. An error ends the run
    and is recorded (type and text)."""
    torch.manual_seed(seed)
    record: list[Any] = []
    metrics = make()
    try:
        with tg.patched(mode=mode, sync=sync):
            metrics.update(*batch(rank, seed, 99))
            record.append(comparable(flags(metrics)))
            for k in range(3):
                preds, target = batch(rank, seed, k)
                leaf = preds.clone().requires_grad_()
                result = metrics(leaf, target)
                grown = [v for v in _tensors(result) if v.requires_grad]
                if grown:
                    torch.stack([v.sum() for v in grown]).sum().backward()
                record.append((comparable(result), comparable(flags(metrics)), leaf.grad))
            for _ in range(2):
                record.append((comparable(metrics.compute()), comparable(flags(metrics))))
    except Exception as error:
        record.append(f"{type(error).__name__}: {error}")
    return record


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def check(make: Callable[[], MetricCollection], rank: int, seed: int, mode: str, what: Any) -> None:
    """The fused run of ``make`` is torchmetrics' own, bit for bit (values, states, flags, gradients, errors)."""
    expected = run(make, rank, seed, "torchmetrics", mode)
    got = run(make, rank, seed, "fused", mode)
    assert len(got) == len(expected), (what, got[-1], expected[-1])
    for k, (a, b) in enumerate(zip(got, expected, strict=True)):
        if isinstance(b, (str, dict)) or isinstance(a, (str, dict)):
            assert alike(a, b), (what, k, a, b)
            continue
        assert alike(a[0], b[0]), (what, k, "values", a[0], b[0])
        for name in b[1]:
            assert alike(a[1][name], b[1][name]), (what, k, name, a[1][name], b[1][name])
        assert a[1].keys() == b[1].keys(), (what, k)
        if len(b) > 2:
            assert (a[2] is None) == (b[2] is None) and (a[2] is None or same(a[2], b[2])), (what, k, a[2], b[2])


# --- hooks ----------------------------------------------------------------------------------------------------------


def halve_inputs(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * 0.5, *args[1:])


def shift_output(module: Any, args: tuple[Any, ...], output: Any) -> Any:
    return output + 1 if isinstance(output, torch.Tensor) else output


def triple_grad(module: Any, grad_input: Any, grad_output: Any) -> Any:
    return tuple(None if g is None else 3 * g for g in grad_input)


def halve_grad_output(module: Any, grad_output: Any) -> Any:
    return tuple(None if g is None else 0.5 * g for g in grad_output)


HOOKS: dict[str, Callable[[Metric], Any]] = {
    "forward pre-hook": lambda m: m.register_forward_pre_hook(halve_inputs),
    "forward hook": lambda m: m.register_forward_hook(shift_output),
    "full backward hook": lambda m: m.register_full_backward_hook(triple_grad),
}
if hasattr(torch.nn.Module, "register_full_backward_pre_hook"):
    HOOKS["full backward pre-hook"] = lambda m: m.register_full_backward_pre_hook(halve_grad_output)

GLOBAL_HOOKS: dict[str, Callable[[], Any]] = {
    "global forward pre-hook": lambda: torch.nn.modules.module.register_module_forward_pre_hook(halve_inputs),
    "global forward hook": lambda: torch.nn.modules.module.register_module_forward_hook(shift_output),
    "global full backward hook": lambda: torch.nn.modules.module.register_module_full_backward_hook(triple_grad),
}


@contextlib.contextmanager
def global_hook(name: str | None) -> Iterator[None]:
    handle = GLOBAL_HOOKS[name]() if name else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


# --- randomized collections -----------------------------------------------------------------------------------------


def draw(seed: int) -> tuple[list[tuple[str, str, bool]], list[tuple[str, str]], bool, str | None]:
    """A seeded collection: members (key, kind or ``"same:<key>"`` for an object held again, syncs on step), hooks
    (key, hook), whether compute groups are on, and a global hook or none."""
    rng = random.Random(seed)
    # every wrapper in turn (and every fourth draw none), at random places among plain members
    wrapped = sorted(WRAPPED)
    kinds = rng.sample(sorted(PLAIN), rng.randint(2, 4)) + ([wrapped[seed % len(wrapped)]] if seed % 4 != 3 else [])
    rng.shuffle(kinds)
    members = [(f"{kind}{i}", kind, i == 0 or rng.random() < 0.8) for i, kind in enumerate(kinds)]
    if rng.random() < 0.3:
        key, _, on_step = rng.choice(members)
        members.insert(rng.randint(0, len(members)), ("again", f"same:{key}", on_step))
    hooked = [(key, rng.choice(sorted(HOOKS))) for key, kind, _ in members if kind in PLAIN and rng.random() < 0.3]
    glob = rng.choice([None, None, None, *sorted(GLOBAL_HOOKS)])
    return members, hooked, rng.random() < 0.5, glob


def build(spec: tuple[list[tuple[str, str, bool]], list[tuple[str, str]], bool, str | None]) -> MetricCollection:
    members, hooked, groups, _ = spec
    made: dict[str, Metric] = {}
    for key, kind, on_step in members:
        if not kind.startswith("same:"):
            made[key] = {**PLAIN, **WRAPPED}[kind](dist_sync_on_step=on_step)
    for key, hook in hooked:
        HOOKS[hook](made[key])
    return MetricCollection(
        {key: made[kind.removeprefix("same:")] if kind.startswith("same:") else made[key] for key, kind, _ in members},
        compute_groups=groups,
    )


SEEDS = range(12)


def _random_collections(rank: int, world_size: int, mode: str) -> None:
    for seed in SEEDS:
        spec = draw(seed)
        with global_hook(spec[3]):
            check(lambda: build(spec), rank, seed, mode, spec)  # noqa: B023


@pytest.mark.parametrize("mode", ["local", "global"])
@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_random_collections_of_every_form_are_torchmetrics_own(world_size: int, mode: str) -> None:
    run_ranks(_random_collections, world_size, mode, timeout=300)


def test_the_draws_cover_every_form() -> None:
    drawn = [draw(seed) for seed in SEEDS]
    kinds = {kind for spec in drawn for _, kind, _ in spec[0]}
    assert {*PLAIN, *WRAPPED} <= kinds and any(kind.startswith("same:") for kind in kinds)
    assert any(not {kind for _, kind, _ in spec[0]} & set(WRAPPED) for spec in drawn)  # plain members only
    assert {hook for spec in drawn for _, hook in spec[1]} == set(HOOKS)
    assert {spec[3] for spec in drawn} >= set(GLOBAL_HOOKS)
    assert {spec[2] for spec in drawn} == {True, False}


# --- each form on its own -------------------------------------------------------------------------------------------


def _each_form(rank: int, world_size: int) -> None:
    def wrapper(kind: str) -> Callable[[], MetricCollection]:
        return lambda: MetricCollection(
            {"mse": MeanSquaredError(dist_sync_on_step=True), kind: WRAPPED[kind](dist_sync_on_step=True)},
            compute_groups=False,
        )

    for kind in WRAPPED:
        check(wrapper(kind), rank, 1, "local", kind)
    for hook in HOOKS:

        def hooked(hook: str = hook) -> MetricCollection:
            metrics = MetricCollection(
                {"mse": MeanSquaredError(dist_sync_on_step=True), "rows": Rows(dist_sync_on_step=True)},
                compute_groups=False,
            )
            HOOKS[hook](metrics["rows"])
            return metrics

        check(hooked, rank, 2, "local", hook)
    for name in GLOBAL_HOOKS:
        with global_hook(name):
            check(wrapper("minmax"), rank, 3, "local", name)

    def twice() -> MetricCollection:
        mse = MeanSquaredError(dist_sync_on_step=True)
        return MetricCollection({"a": mse, "rows": Rows(dist_sync_on_step=True), "b": mse}, compute_groups=False)

    check(twice, rank, 4, "local", "one Metric under two keys")

    def grouped() -> MetricCollection:  # AUROC and AP share their list states, and so do Rows and RowsSquared
        return MetricCollection(
            {
                "auroc": AUROC(dist_sync_on_step=True),
                "ap": AP(dist_sync_on_step=True),
                "rows": Rows(dist_sync_on_step=True),
                "mse": MeanSquaredError(dist_sync_on_step=True),
                "squared": RowsSquared(dist_sync_on_step=True),
            }
        )

    for mode in ("local", "global"):
        check(grouped, rank, 5, mode, "compute group of list states")


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_each_form_is_torchmetrics_own(world_size: int) -> None:
    run_ranks(_each_form, world_size, timeout=300)


# --- ranks whose members differ -------------------------------------------------------------------------------------


def _ranks_that_differ(rank: int, world_size: int) -> None:
    def pre_hook_on_rank_0() -> MetricCollection:
        metrics = MetricCollection(
            {"mse": MeanSquaredError(dist_sync_on_step=True), "rows": Rows(dist_sync_on_step=True)},
            compute_groups=False,
        )
        if rank == 0:
            metrics["rows"].register_forward_pre_hook(halve_inputs)
        return metrics

    def own_fn_on_rank_0() -> MetricCollection:
        fn = {"dist_sync_fn": own_gather} if rank == 0 else {}
        return MetricCollection(
            {
                "mse": MeanSquaredError(dist_sync_on_step=True),
                "rows": Rows(dist_sync_on_step=True, **fn),
                "pearson": PearsonCorrCoef(dist_sync_on_step=True),
            },
            compute_groups=False,
        )

    def every_member_own_fn_on_rank_0() -> MetricCollection:
        fn = {"dist_sync_fn": own_gather} if rank == 0 else {}
        return MetricCollection(
            {"mse": MeanSquaredError(dist_sync_on_step=True, **fn), "rows": Rows(dist_sync_on_step=True, **fn)},
            compute_groups=False,
        )

    def wrapped_own_fn_on_rank_0() -> MetricCollection:
        fn = {"dist_sync_fn": own_gather} if rank == 0 else {}
        return MetricCollection(
            {
                "mse": MeanSquaredError(dist_sync_on_step=True),
                "minmax": WRAPPED["minmax"](dist_sync_on_step=True, **fn),
            },
            compute_groups=False,
        )

    cases = {
        "a forward pre-hook on rank 0 only": pre_hook_on_rank_0,
        "a dist_sync_fn of its own on rank 0 only": own_fn_on_rank_0,
        "every member's own dist_sync_fn on rank 0 only": every_member_own_fn_on_rank_0,
        "a wrapped metric's own dist_sync_fn on rank 0 only": wrapped_own_fn_on_rank_0,
    }
    for what, make in cases.items():
        for mode in ("local", "global"):
            check(make, rank, 6, mode, what)
    with global_hook("global forward pre-hook" if rank == 0 else None):
        check(own_fn_on_rank_0, rank, 7, "local", "a global hook on rank 0 only")
    assert every_rank("done") == ["done"] * world_size


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_ranks_whose_members_differ_in_form_return_torchmetrics_values(world_size: int) -> None:
    run_ranks(_ranks_that_differ, world_size, timeout=300)


PER_RANK = ("forward pre-hook", "dist_sync_fn", "global hook", "no step sync", "no compute sync")


def _randomized_per_rank(rank: int, world_size: int, seed: int) -> None:
    """A random collection with one rank's member changed: torchmetrics' own values where torchmetrics' own sync
    completes, else the same error on every rank within seconds."""
    rng = random.Random(1000 + seed)
    spec = draw(seed)
    change, odd = PER_RANK[seed % len(PER_RANK)], rng.randrange(world_size)
    syncing = [key for key, kind, on_step in spec[0] if kind in PLAIN and on_step]
    if change == "no step sync" and len(syncing) < 2:  # its only step-syncing member: torchmetrics' own wait too
        change = "forward pre-hook"
    target = rng.choice(syncing)

    def make() -> MetricCollection:
        metrics = build(spec)
        if rank == odd:
            member = metrics[target]
            if change == "forward pre-hook":
                member.register_forward_pre_hook(halve_inputs)
            elif change == "dist_sync_fn":
                member.dist_sync_fn = own_gather
            elif change == "no step sync":
                member.dist_sync_on_step = False
            elif change == "no compute sync":
                member.sync_on_compute = False
                member._to_sync = False
        return metrics

    with global_hook(spec[3] or ("global forward hook" if change == "global hook" and rank == odd else None)):
        if change in ("no step sync", "no compute sync"):  # torchmetrics' own sync leaves the others waiting
            started = time.monotonic()
            outcome = run(make, rank, seed, "fused", "local")[-1]
            assert isinstance(outcome, str) and "FusedSyncError" in outcome, (spec, change, outcome)
            assert every_rank(outcome) == [outcome] * world_size and time.monotonic() - started < 30
        else:
            check(make, rank, seed, "local", (spec, change, odd))


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_randomized_collections_with_one_rank_changed(world_size: int) -> None:
    for seed in range(10):
        run_ranks(_randomized_per_rank, world_size, seed, timeout=120)


# --- the documented limits -----------------------------------------------------------------------------------------


class Noisy(Metric):
    """Draws random numbers in ``update`` and in ``compute``."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total = self.total + (preds * torch.rand((), dtype=torch.float64)).sum()

    def compute(self) -> torch.Tensor:
        return self.total * torch.rand((), dtype=torch.float64)


class BrokenUpdate(MeanSquaredError):  # noqa: N818 - a Metric, not an exception
    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        raise ValueError("a failing update")


def _the_documented_limits(rank: int, world_size: int) -> None:
    # 1. the order of random draws: the fused step runs every member's updates before any member's compute()
    def noisy(count: int) -> Callable[[], MetricCollection]:
        return lambda: MetricCollection(
            {**{f"n{i}": Noisy(dist_sync_on_step=True) for i in range(count)}, "mse": MeanSquaredError()},
            compute_groups=False,
        )

    check(noisy(1), rank, 8, "local", "one member draws")  # one member's draws keep their order
    expected, got = (run(noisy(2), rank, 8, sync, "local") for sync in ("torchmetrics", "fused"))
    assert not alike(got[1][0], expected[1][0])  # two members' draws interleave otherwise: other values
    # 2. an update that raises on every rank: the same error and states, but the members before it have not
    # computed their batch value, so their _forward_cache is not torchmetrics'
    results = {}
    for sync in ("torchmetrics", "fused"):
        metrics = MetricCollection(
            {"a": MeanSquaredError(dist_sync_on_step=True), "b": BrokenUpdate(dist_sync_on_step=True)},
            compute_groups=False,
        )
        metrics["a"].update(*batch(rank, 9, 0))
        with tg.patched(sync=sync), pytest.raises(ValueError, match="a failing update"):
            metrics(*batch(rank, 9, 1))
        results[sync] = flags(metrics)
    differing = [name for name in results["fused"] if not alike(results["fused"][name], results["torchmetrics"][name])]
    assert differing == ["a._forward_cache"], differing
    assert results["fused"]["a._forward_cache"] is None and results["torchmetrics"]["a._forward_cache"] is not None


@pytest.mark.parametrize("world_size", worlds(2))
def test_the_documented_limits(world_size: int) -> None:
    run_ranks(_the_documented_limits, world_size, timeout=120)


def test_the_forms_of_a_collection_outside_ranks() -> None:
    """Which form each member has, without a process group: the allowlist."""
    from torchmetrics_gradpatch.fused import collection as fc
    from torchmetrics_gradpatch.fused import forms

    assert not dist.is_initialized()
    mse = MeanSquaredError(dist_sync_on_step=True, distributed_available_fn=lambda: True)
    hooked = Rows(dist_sync_on_step=True, distributed_available_fn=lambda: True)
    hooked.register_forward_hook(shift_output)
    members = [
        ("mse", mse),
        ("hooked", hooked),
        ("minmax", WRAPPED["minmax"](dist_sync_on_step=True)),
        ("quiet", MeanSquaredError()),
        ("again", mse),
    ]
    assert fc.forms_of(members, on_step=True) == [
        forms.DUPLICATE,
        forms.MODULE_HOOKS,
        forms.HOLDS_METRICS,
        forms.NO_STEP_SYNC,
        forms.DUPLICATE,
    ]
    rows = Rows(dist_sync_on_step=True, distributed_available_fn=lambda: True)
    with global_hook("global forward hook"):
        assert fc.forms_of([members[3], ("rows", rows)], on_step=True) == [forms.NO_STEP_SYNC, forms.GLOBAL_HOOKS]
