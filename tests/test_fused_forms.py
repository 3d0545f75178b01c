"""The fused sync takes over only the members in the form its tests prove, on real gloo ranks: every other form a
collection allows (torchmetrics' wrappers, module hooks of every kind, global module hooks, one Metric under two
keys, compute groups sharing list states) gives torchmetrics' own forward values, states, flags, ``_forward_cache``,
gradients and ``compute()`` bit for bit, or the same error; ranks whose members differ in form (a hook or a
``dist_sync_fn`` on one rank only) return torchmetrics' own values instead of waiting.

Each rank runs the same steps twice on the same data, under torchmetrics' own sync and under the fused sync, and
compares. Random draws are seeded alike before each run. Each case (:class:`Case`) states which members the
collection's exchange takes over in each step and ``compute()`` (:class:`Exchange`: checked against what
``tg.explain()`` says, by counting the collectives and the per-Metric syncs of the fused run) and which error, if
any, both runs raise; any other error fails the case with its traceback. The module's own Metric classes are
trusted (:data:`TRUSTED`): its subject is how the exchange handles each form; one case holds a class that is not.
"""

from __future__ import annotations

import contextlib
import random
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchmetrics
from torchmetrics import Metric, MetricCollection, wrappers
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, MulticlassAccuracy
from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, PearsonCorrCoef

import torchmetrics_gradpatch as tg
from tests._rank_tools import calls, every_rank
from tests._ranks import run_ranks
from tests.test_fused import same, worlds
from tests.test_fused_step import Rows, RowsSquared, alike, own_gather
from torchmetrics_gradpatch import _syncs
from torchmetrics_gradpatch.fused import forms, membership


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


# --- what each case expects -----------------------------------------------------------------------------------------

JOINS = "joins the collection's exchange"  # what tg.explain() says of a member the exchange takes over


@dataclass(frozen=True)
class Exchange:
    """The members (keys) the collection's exchange takes over on this rank: in each step's ``forward`` and in the
    first ``compute()`` (the second finds every one of them cached). ``explained``: the members ``tg.explain()``
    says join, where this rank's own reading differs (ranks whose forms differ: each rank reads only its own);
    default: the members taken over."""

    step: frozenset[str] = frozenset()
    compute: frozenset[str] = frozenset()
    explained_step: frozenset[str] | None = None
    explained_compute: frozenset[str] | None = None

    def explained(self, step: bool) -> frozenset[str]:
        if step:
            return self.step if self.explained_step is None else self.explained_step
        return self.compute if self.explained_compute is None else self.explained_compute


#: no member taken over anywhere: every member runs torchmetrics' own path (the member table still crosses)
NO_EXCHANGE = Exchange()


def exchange(step: Iterable[str] = (), compute: Iterable[str] | None = None, **explained: Iterable[str]) -> Exchange:
    """:class:`Exchange` of these keys (``compute`` default: the same as ``step``)."""
    return Exchange(
        frozenset(step),
        frozenset(step if compute is None else compute),
        **{name: frozenset(keys) for name, keys in explained.items()},
    )


@dataclass(frozen=True)
class Case:
    """One comparison with torchmetrics' own: what to run and what the fused run must show.

    ``expect_exchange``: which members the collection's exchange takes over (:class:`Exchange`); checked on the
    fused run by counting collectives and per-Metric syncs in each step and ``compute()``. ``expect_error``:
    ``None``, or the error type and a fragment of its message that both runs raise at the same point (any other
    error, or one on one path only, fails the case with its traceback)."""

    what: Any
    make: Callable[[], MetricCollection]
    expect_exchange: Exchange
    expect_error: tuple[type[BaseException], str] | None = None
    seed: int = 0
    mode: str = "local"


@dataclass
class Phase:
    """One step's ``forward`` or one ``compute()`` of a run: the collectives issued (``total``), the members whose
    Metrics synced themselves (``own``: their keys, once per Metric sync) and the collectives those syncs issued
    (``own_calls``); what ``tg.explain()`` said just before. The rest of ``total`` is the collection's exchange."""

    name: str
    total: int = 0
    own: list[str] = field(default_factory=list)
    own_calls: int = 0
    explained: frozenset[str] = frozenset()

    @property
    def exchange(self) -> int:
        return self.total - self.own_calls


@dataclass
class Run:
    """What one run recorded (see :func:`run`), the collectives of each phase, and the error that ended it."""

    record: list[Any] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    error: BaseException | None = None
    trace: str = ""


@contextlib.contextmanager
def phase(out: Run, name: str, metrics: MetricCollection, step: bool) -> Iterator[None]:
    """Record ``name``'s collectives and every Metric sync in it (the core's ``_sync_dist`` replacement, which
    every Metric that syncs itself passes through under the patch; a member the exchange takes over does not)."""
    keys = {id(each): key for key, member in metrics._modules.items() for each in (member, *forms.inside(member))}
    explained = tg.explain(metrics, step=step)
    record = Phase(name, explained=frozenset(key for key, why in explained.items() if why == JOINS))
    out.phases.append(record)
    real = _syncs._run
    depth = [0]

    def counted(original: Any, metric: Any, *args: Any) -> Any:
        if depth[0]:
            return real(original, metric, *args)
        depth[0] += 1
        before = calls()
        try:
            return real(original, metric, *args)
        finally:
            depth[0] -= 1
            record.own.append(keys.get(id(metric), "?"))
            record.own_calls += calls() - before

    before = calls()
    _syncs._run = counted
    try:
        yield
    finally:
        _syncs._run = real
        record.total = calls() - before


def run_case(case: Case, rank: int, sync: str) -> Run:
    """One ``update()`` (which links a compute group's states), three training steps (forward, a loss from every
    value that requires grad, backward) and two ``compute()``: the states and flags after the update; per step the
    values, the states and flags, the input's gradient; then the epoch's values and states. An error ends the run
    and is kept with its traceback."""
    torch.manual_seed(case.seed)
    out = Run()
    metrics = case.make()
    try:
        with tg.patched(mode=case.mode, sync=sync):
            # the fused sync is in force (torchmetrics' own may run without the replacement, on a native line)
            assert sync != "fused" or _syncs.installed() == sync, (case.what, "the sync in force", _syncs.installed())
            metrics.update(*batch(rank, case.seed, 99))
            out.record.append(comparable(flags(metrics)))
            for k in range(3):
                preds, target = batch(rank, case.seed, k)
                leaf = preds.clone().requires_grad_()
                with phase(out, f"step {k}", metrics, step=True):
                    result = metrics(leaf, target)
                grown = [v for v in _tensors(result) if v.requires_grad]
                if grown:
                    torch.stack([v.sum() for v in grown]).sum().backward()
                out.record.append((comparable(result), comparable(flags(metrics)), leaf.grad))
            for c in range(2):
                with phase(out, f"compute {c}", metrics, step=False):
                    result = metrics.compute()
                out.record.append((comparable(result), comparable(flags(metrics))))
    except Exception as error:
        out.error, out.trace = error, traceback.format_exc()
    return out


def run(make: Callable[[], MetricCollection], rank: int, seed: int, sync: str, mode: str) -> list[Any]:
    """:func:`run_case` as tests/test_fused_check.py reads it: the record, and where the run raised, the error's
    type and text last (that module judges the error itself)."""
    got = run_case(Case("a run", make, NO_EXCHANGE, seed=seed, mode=mode), rank, sync)
    error = [] if got.error is None else [f"{type(got.error).__name__}: {got.error}"]
    return [*got.record, *error]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def raised_as_expected(case: Case, got: Run, sync: str) -> None:
    """The run raised what ``case`` expects, or nothing where it expects nothing (else: its traceback)."""
    if case.expect_error is None:
        assert got.error is None, f"{case.what}: the {sync} run raised where no error is expected:\n{got.trace}"
        return
    kind, fragment = case.expect_error
    assert isinstance(got.error, kind) and fragment in str(got.error), (
        f"{case.what}: the {sync} run should raise {kind.__name__} ({fragment!r}); it "
        + (f"raised:\n{got.trace}" if got.error is not None else "returned")
    )


def check(case: Case, rank: int) -> Run:
    """The fused run of ``case`` is torchmetrics' own, bit for bit (values, states, flags, gradients, the expected
    error at the same point), and its collection's exchange took over the members ``case`` expects."""
    expected = run_case(case, rank, "torchmetrics")
    got = run_case(case, rank, "fused")
    raised_as_expected(case, expected, "torchmetrics")
    raised_as_expected(case, got, "fused")
    what = case.what
    assert len(got.record) == len(expected.record), (what, "records", len(got.record), len(expected.record))
    assert [p.name for p in got.phases] == [p.name for p in expected.phases], (what, "phases")
    if got.error is not None:
        assert type(got.error) is type(expected.error) and str(got.error) == str(expected.error), (
            what,
            "errors",
            got.trace,
            expected.trace,
        )
    for k, (a, b) in enumerate(zip(got.record, expected.record, strict=True)):
        if isinstance(b, dict):
            assert alike(a, b), (what, k, a, b)
            continue
        assert alike(a[0], b[0]), (what, k, "values", a[0], b[0])
        for name in b[1]:
            assert alike(a[1][name], b[1][name]), (what, k, name, a[1][name], b[1][name])
        assert a[1].keys() == b[1].keys(), (what, k)
        if len(b) > 2:
            assert (a[2] is None) == (b[2] is None) and (a[2] is None or same(a[2], b[2])), (what, k, a[2], b[2])
    took_over(case, got, expected)
    return got


def took_over(case: Case, got: Run, expected: Run) -> None:
    """The fused run's exchange took over, in each step and the first ``compute()``, the members ``case`` expects
    (``tg.explain()`` said so just before), and only them: none of them synced itself, and the collectives not
    issued by a Metric syncing itself are the exchange's: one, or two where the group's agreed sizes grow, for each
    exchange (a step whose other members may sync first sends its member table alone, then a second exchange);
    where it took no member over, at most the member table's."""
    expect = case.expect_exchange
    for fused, own in zip(got.phases, expected.phases, strict=False):
        step = fused.name.startswith("step")
        taken = expect.step if step else expect.compute if fused.name == "compute 0" else frozenset()
        facts = (case.what, fused, "torchmetrics' own", own.total)
        assert fused.explained == expect.explained(step), (*facts, "explain():", expect.explained(step))
        assert not taken & set(fused.own), (*facts, "taken over, yet synced by itself:", taken & set(fused.own))
        assert fused.exchange <= (4 if step and taken else 2), (*facts, "more collectives than its exchanges")
        if taken:
            assert fused.exchange >= 1, (*facts, "members taken over without an exchange")
            assert fused.total <= own.total, (*facts, "the exchange costs no more collectives than torchmetrics' own")


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


def joining(spec: tuple[list[tuple[str, str, bool]], list[tuple[str, str]], bool, str | None]) -> Exchange:
    """The members of a drawn collection the exchange takes over, read from the draw: a plain member (its class
    torchmetrics' own or trusted) held once, with no hooks of its own, under no global hook; in a step, one that
    syncs on step."""
    members, hooked, _, glob = spec
    if glob is not None:
        return NO_EXCHANGE
    aside = {kind.removeprefix("same:") for _, kind, _ in members if kind.startswith("same:")} | {k for k, _ in hooked}
    plain = [(key, on_step) for key, kind, on_step in members if kind in PLAIN and key not in aside]
    return exchange([key for key, on_step in plain if on_step], [key for key, _ in plain])


def _random_collections(rank: int, world_size: int, mode: str) -> None:
    for seed in SEEDS:
        spec = draw(seed)
        with global_hook(spec[3]):
            check(Case(spec, lambda: build(spec), joining(spec), seed=seed, mode=mode), rank)  # noqa: B023


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
    # the exchange takes members over in some draws (one to three of them), none in others (a global hook)
    taken = [joining(spec) for spec in drawn]
    assert {len(e.step) for e in taken} == {0, 1, 2, 3} and any(e.compute - e.step for e in taken)


# --- each form on its own -------------------------------------------------------------------------------------------


class Untrusted(MeanAbsoluteError):  # noqa: N818 - a Metric, not an exception
    """A class of the user's not named with ``tg.trust()`` (not in :data:`TRUSTED`)."""


def _each_form(rank: int, world_size: int) -> None:
    def wrapper(kind: str) -> Callable[[], MetricCollection]:
        return lambda: MetricCollection(
            {"mse": MeanSquaredError(dist_sync_on_step=True), kind: WRAPPED[kind](dist_sync_on_step=True)},
            compute_groups=False,
        )

    def plain(cls: type[Metric] = MeanAbsoluteError) -> Callable[[], MetricCollection]:
        return lambda: MetricCollection(
            {"mse": MeanSquaredError(dist_sync_on_step=True), "rows": Rows(dist_sync_on_step=True), "mae": cls()},
            compute_groups=False,
        )

    # every member joins: one collective a steady step, where torchmetrics' own issues several per state
    got = check(Case("plain members", plain(), exchange(["mse", "rows"], ["mse", "rows", "mae"]), seed=1), rank)
    steps = [p.total for p in got.phases if p.name.startswith("step")]
    assert steps[1:] == [1, 1] and steps[0] <= 2 and not any(p.own for p in got.phases), ("plain", got.phases)
    # one class of the user's not trusted: the whole collection runs torchmetrics' own path, each Metric syncing
    # itself (the fused sync of one Metric) after the member table crossed in one collective
    untrusted = Case("a class it does not trust", plain(Untrusted), NO_EXCHANGE, seed=1)
    got = check(untrusted, rank)
    assert [(p.name, sorted(p.own), p.exchange) for p in got.phases] == [
        *((f"step {k}", ["mse", "rows"], 1) for k in range(3)),
        ("compute 0", ["mae", "mse", "rows"], 1),
        ("compute 1", [], 0),
    ], ("untrusted", got.phases)
    # each Metric's own fused sync: one collective, or two where its sizes grew
    assert all(len(p.own) <= p.own_calls <= 2 * len(p.own) for p in got.phases), ("untrusted", got.phases)
    reasons = set(tg.explain(untrusted.make()).values()) | set(tg.explain(untrusted.make(), step=True).values())
    assert reasons == {"runs torchmetrics' own path: member 'mae' is a class it does not trust (Untrusted)"}, reasons

    for kind in WRAPPED:
        check(Case(kind, wrapper(kind), exchange(["mse"]), seed=1), rank)
    for hook in HOOKS:

        def hooked(hook: str = hook) -> MetricCollection:
            metrics = MetricCollection(
                {"mse": MeanSquaredError(dist_sync_on_step=True), "rows": Rows(dist_sync_on_step=True)},
                compute_groups=False,
            )
            HOOKS[hook](metrics["rows"])
            return metrics

        check(Case(hook, hooked, exchange(["mse"]), seed=2), rank)
    for name in GLOBAL_HOOKS:
        with global_hook(name):
            check(Case(name, wrapper("minmax"), NO_EXCHANGE, seed=3), rank)

    def twice() -> MetricCollection:
        mse = MeanSquaredError(dist_sync_on_step=True)
        return MetricCollection({"a": mse, "rows": Rows(dist_sync_on_step=True), "b": mse}, compute_groups=False)

    check(Case("one Metric under two keys", twice, exchange(["rows"]), seed=4), rank)

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

    every = exchange(["auroc", "ap", "rows", "mse", "squared"])
    for mode in ("local", "global"):
        check(Case("compute group of list states", grouped, every, seed=5, mode=mode), rank)


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

    def differing(taken: list[str], here: list[str], elsewhere: list[str]) -> Exchange:
        """``taken`` on every rank; ``tg.explain()`` reads ``here`` on rank 0, ``elsewhere`` on the others (the
        member whose form differs is synced by every rank with torchmetrics' own ``_sync_dist``)."""
        explained = here if rank == 0 else elsewhere
        return exchange(taken, explained_step=explained, explained_compute=explained)

    cases = {
        "a forward pre-hook on rank 0 only": (pre_hook_on_rank_0, differing(["mse"], ["mse"], ["mse", "rows"])),
        "a dist_sync_fn of its own on rank 0 only": (
            own_fn_on_rank_0,
            differing(["mse", "pearson"], ["mse", "pearson"], ["mse", "rows", "pearson"]),
        ),
        "every member's own dist_sync_fn on rank 0 only": (
            every_member_own_fn_on_rank_0,
            differing([], [], ["mse", "rows"]),
        ),
        "a wrapped metric's own dist_sync_fn on rank 0 only": (wrapped_own_fn_on_rank_0, exchange(["mse"])),
    }
    for what, (make, taken) in cases.items():
        for mode in ("local", "global"):
            check(Case(what, make, taken, seed=6, mode=mode), rank)
    with global_hook("global forward pre-hook" if rank == 0 else None):
        hooked = differing([], [], ["mse", "rows", "pearson"])
        check(Case("a global hook on rank 0 only", own_fn_on_rank_0, hooked, seed=7), rank)
    assert every_rank("done") == ["done"] * world_size, "a rank did not finish its cases"


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

    # what the exchange takes over: the draw's members less the one changed (every rank syncs it with torchmetrics'
    # own _sync_dist); a global hook on one rank puts every member there on its own path, so on every rank
    base = joining(spec)
    if change == "global hook" and spec[3] is None:
        taken, here = NO_EXCHANGE, NO_EXCHANGE if rank == odd else base
    else:
        taken = exchange(base.step - {target}, base.compute - {target})
        here = taken if rank == odd else base
    what = (spec, change, odd)
    expect = Exchange(taken.step, taken.compute, here.step, here.compute)
    with global_hook(spec[3] or ("global forward hook" if change == "global hook" and rank == odd else None)):
        if change in ("no step sync", "no compute sync"):  # torchmetrics' own sync leaves the others waiting
            case = Case(what, make, expect, (tg.FusedSyncError, "the ranks disagree on whether it syncs"), seed)
            started = time.monotonic()
            got = run_case(case, rank, "fused")
            raised_as_expected(case, got, "fused")
            outcome = f"{type(got.error).__name__}: {got.error}"
            assert every_rank(outcome) == [outcome] * world_size, (what, "the same error on every rank", outcome)
            assert time.monotonic() - started < 30, (what, "raised within seconds")
        else:
            check(Case(what, make, expect, seed=seed), rank)


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
    def noisy(count: int) -> Case:
        keys = [f"n{i}" for i in range(count)]
        return Case(
            f"{count} members draw",
            lambda: MetricCollection(
                {**{key: Noisy(dist_sync_on_step=True) for key in keys}, "mse": MeanSquaredError()},
                compute_groups=False,
            ),
            exchange(keys, [*keys, "mse"]),
            seed=8,
        )

    check(noisy(1), rank)  # one member's draws keep their order
    expected, got = (run_case(noisy(2), rank, sync) for sync in ("torchmetrics", "fused"))
    raised_as_expected(noisy(2), expected, "torchmetrics")
    raised_as_expected(noisy(2), got, "fused")
    took_over(noisy(2), got, expected)  # trusted, both members join the exchange: then their draws interleave
    assert not alike(got.record[1][0], expected.record[1][0]), "two members' draws in another order: other values"
    # 2. an update that raises on every rank: the same error and states, but the members before it have not
    # computed their batch value, so their _forward_cache is not torchmetrics'
    results, counts = {}, {}
    for sync in ("torchmetrics", "fused"):
        metrics = MetricCollection(
            {"a": MeanSquaredError(dist_sync_on_step=True), "b": BrokenUpdate(dist_sync_on_step=True)},
            compute_groups=False,
        )
        assert tg.explain(metrics, step=True) == {"a": JOINS, "b": JOINS}, "both members join the exchange"
        metrics["a"].update(*batch(rank, 9, 0))
        before = calls()
        with tg.patched(sync=sync), pytest.raises(ValueError, match="a failing update"):
            metrics(*batch(rank, 9, 1))
        results[sync], counts[sync] = flags(metrics), calls() - before
    # torchmetrics' own synced a's batch before b's update raised; the fused step raised before its exchange
    assert counts["fused"] == 0 < counts["torchmetrics"], counts
    differing = [name for name in results["fused"] if not alike(results["fused"][name], results["torchmetrics"][name])]
    assert differing == ["a._forward_cache"], differing
    assert results["fused"]["a._forward_cache"] is None and results["torchmetrics"]["a._forward_cache"] is not None, (
        "torchmetrics' own computed a's batch value before b's update raised; the fused step had not"
    )


@pytest.mark.parametrize("world_size", worlds(2))
def test_the_documented_limits(world_size: int) -> None:
    run_ranks(_the_documented_limits, world_size, timeout=120)


def test_the_forms_of_a_collection_outside_ranks() -> None:
    """Which form each member has, without a process group: the allowlist, and what ``tg.explain()`` says."""
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
    codes = [forms.DUPLICATE, forms.MODULE_HOOKS, forms.HOLDS_METRICS, forms.NO_STEP_SYNC, forms.DUPLICATE]
    assert forms.forms_of(members, on_step=True) == codes
    rows = Rows(dist_sync_on_step=True, distributed_available_fn=lambda: True)
    with global_hook("global forward hook"):
        assert forms.forms_of([members[3], ("rows", rows)], on_step=True) == [forms.NO_STEP_SYNC, forms.GLOBAL_HOOKS]
    # tg.explain() reads the same forms, where every class is trusted; else the whole collection's own path
    tg.trust(Rows)
    try:
        explained = tg.explain(MetricCollection(dict(members), compute_groups=False), step=True)
        assert explained == {key: forms.describe(code) for (key, _), code in zip(members, codes, strict=True)}
    finally:
        membership._named.discard(Rows)
    explained = tg.explain(MetricCollection({"mse": mse, "rows": rows}, compute_groups=False), step=True)
    assert explained == dict.fromkeys(
        ("mse", "rows"), "runs torchmetrics' own path: member 'rows' is a class it does not trust (Rows)"
    )


#: this module's own Metric classes, trusted in its rank bodies: its subject is how the collection's exchange handles
#: each form, not which classes it trusts; Untrusted stays out on purpose (the one case of a class not trusted)
TRUSTED = (AUROC, AP, TwoClass, Pairs, Noisy, BrokenUpdate, Rows, RowsSquared)
