"""Check mode on real gloo ranks: every fused sync and step also runs torchmetrics' own sync from the same states
and random state and compares bit for bit; a difference raises the same error on every rank, naming the rank, the
Metric, the state and the first difference; a long randomized run stays silent and returns the fused values.

No false alarm where the fused run is right (a Python float NaN, a child module's buffers, a dict attribute and a
state added in the first ``update()``, all changed by the fused run before the reference starts); no miss (a
dataclass result, a fused run that raises where torchmetrics' own returns); what cannot be compared is reported as
not checked; list states of different lengths per rank (where torchmetrics' own sync would wait) and ranks whose
check settings differ end on every rank alike, without a hang. Each case asserts the collectives it expects.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
import torch
from torchmetrics import MeanSquaredError, Metric, MetricCollection

import torchmetrics_gradpatch as tg
from tests._rank_tools import calls, every_rank, record_collectives
from tests._ranks import run_ranks
from tests.test_fused import same, worlds
from tests.test_fused_forms import AP, AUROC, GLOBAL_HOOKS, Noisy, Pairs, TwoClass, batch, build, draw, global_hook, run
from tests.test_fused_step import Rows, RowsSquared, alike, exchanges
from torchmetrics_gradpatch._errors import FusedSyncError
from torchmetrics_gradpatch.fused import compare, exchange


def _raised(action: Any) -> str:
    try:
        action()
    except FusedSyncError as error:
        return str(error)
    return "returned"


def _catches_a_real_difference(rank: int, world_size: int) -> None:
    # the documented limit: two members that draw random numbers in update and compute
    metrics = MetricCollection(
        {"a": Noisy(dist_sync_on_step=True), "b": Noisy(dist_sync_on_step=True)}, compute_groups=False
    )
    torch.manual_seed(0)
    with tg.patched(sync="fused", check=True):
        text = _raised(lambda: metrics(*batch(rank, 1, 0)))
    assert every_rank(text) == [text] * world_size, text
    assert "check mode: the fused sync of a MetricCollection's forward differs" in text, text
    assert f"on rank(s) {list(range(world_size))}" in text and "['a']" in text and "where torchmetrics' is" in text


def _catches_one_ranks_difference(rank: int, world_size: int) -> None:
    """A fused sync whose result is wrong on rank 1 only (a reduction broken there): every rank raises."""
    real = exchange.set_states

    def broken(metric: Any, states: Any, *args: Any, **kwargs: Any) -> None:
        real(metric, states, *args, **kwargs)
        if rank == 1:
            metric.sse = metric.sse + 1

    exchange.set_states = broken
    try:
        metric = Rows()
        metric.update(*batch(rank, 2, 0))
        with tg.patched(sync="fused", check=True):
            text = _raised(metric.compute)
    finally:
        exchange.set_states = real
    assert every_rank(text) == [text] * world_size, text
    assert "the fused sync of Rows differs from torchmetrics' own sync on rank(s) [1]" in text, text
    assert "'Rows', state 'sse'" in text, text


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_check_mode_catches_a_real_difference_on_every_rank(world_size: int) -> None:
    run_ranks(_catches_a_real_difference, world_size, timeout=120)
    run_ranks(_catches_one_ranks_difference, world_size, timeout=120)


class FailsOnRankOne(MeanSquaredError):  # noqa: N818 (a Metric, named after its base)
    """A member whose ``compute()`` raises on rank 1 alone, after its sync."""

    def compute(self) -> torch.Tensor:
        if torch.distributed.get_rank() == 1:
            raise ValueError("a compute that fails on rank 1")
        return super().compute()


def _one_rank_raises(rank: int, world_size: int) -> None:
    """The last member's ``compute()`` raises on rank 1 alone, in ``compute()`` and in a step: as with the fused sync
    alone (and torchmetrics' own), rank 1 raises its error and the other ranks return torchmetrics' values. No rank
    runs torchmetrics' path (raising on one rank between its collectives, it could leave the others waiting): one
    warning says the sync was not checked, on every rank."""

    def make() -> MetricCollection:
        return MetricCollection(
            {"a": MeanSquaredError(dist_sync_on_step=True), "b": FailsOnRankOne(dist_sync_on_step=True)},
            compute_groups=False,
        )

    def outcome(sync: str, check: bool, step: bool) -> Any:
        metrics = make()
        metrics.update(*batch(rank, 3, 0))
        try:
            with tg.patched(sync=sync, check=check):
                return metrics(*batch(rank, 3, 1)) if step else metrics.compute()
        except ValueError as error:
            return str(error)

    for step in (False, True):
        expected = outcome("torchmetrics", False, step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = outcome("fused", True, step)
        texts = [str(w.message) for w in caught if "was not checked" in str(w.message)]
        assert len(texts) == 1 and "raised on rank(s) [1] only" in texts[0], (step, texts)
        if rank == 1:
            assert got == expected == "a compute that fails on rank 1", (step, got, expected)
        else:
            assert alike(got, expected), (step, got, expected)


def test_check_mode_where_the_fused_run_raises_on_one_rank() -> None:
    run_ranks(_one_rank_raises, 2, timeout=120)


def _silent_through_a_long_run(rank: int, world_size: int, seeds: list[int]) -> None:
    for seed in seeds:
        spec = draw(seed)
        with global_hook(spec[3]):
            unchecked = run(lambda: build(spec), rank, seed, "fused", "local")  # noqa: B023
            with tg.patched(check=True):
                checked = run(lambda: build(spec), rank, seed, "fused", "local")  # noqa: B023
        # a draw raises nowhere (run() records an error's text last): an error on both runs would compare alike
        errors = [entry for entry in (*checked, *unchecked) if isinstance(entry, str)]
        assert not errors, (spec, errors)
        for a, b in zip(checked, unchecked, strict=True):
            if isinstance(a, tuple) and len(a) > 2:
                assert alike(a[0], b[0]) and (a[2] is None) == (b[2] is None)
                assert a[2] is None or same(a[2], b[2])
            else:
                assert alike(a, b)


def test_check_mode_is_silent_through_a_long_randomized_run() -> None:
    seeds = random.Random(0).sample(range(100, 400), 24)
    assert any(draw(seed)[3] in GLOBAL_HOOKS for seed in seeds)
    run_ranks(_silent_through_a_long_run, 2, seeds, timeout=600)


def test_check_mode_outside_ranks_changes_nothing() -> None:
    metric = MeanSquaredError()
    metric.update(torch.ones(3), torch.zeros(3))
    with tg.patched(sync="fused", check=True):
        assert metric.compute() == 1.0  # no process group: nothing syncs, nothing is checked


# --- the comparison, in this process --------------------------------------------------------------------------------


@dataclasses.dataclass
class Summary:
    values: torch.Tensor
    label: str = "rows"


class Opaque:
    """A value with no attributes whose ``==`` is identity: nothing can say whether two of them are alike."""

    __slots__ = ()


class Pair:
    __slots__ = ("left", "right")

    def __init__(self, left: Any, right: Any) -> None:
        self.left, self.right = left, right


def test_difference_compares_every_kind_of_value_bit_for_bit() -> None:
    nan = float("nan")
    assert compare.difference(nan, float("nan")) is None
    assert compare.difference({"a": [nan, (1, "x")]}, {"a": [float("nan"), (1, "x")]}) is None
    assert compare.difference(collections.deque([nan]), collections.deque([float("nan")])) is None
    assert compare.difference(0.0, -0.0) == "0.0 where torchmetrics' is -0.0"
    assert compare.difference(torch.tensor([nan]), torch.tensor([nan])) is None
    found = compare.difference(Summary(torch.tensor([1.0, 2.0])), Summary(torch.tensor([1.0, 3.0])))
    assert found == ".values at index [1]: 2.0 where torchmetrics' is 3.0", found
    found = compare.difference(Summary(torch.ones(2)), Summary(torch.ones(2), "other"))
    assert found == ".label 'rows' where torchmetrics' is 'other'", found
    assert compare.difference(Pair(1, [2.0]), Pair(1, [2.5])) == ".right[0] 2.0 where torchmetrics' is 2.5"
    unchecked: list[str] = []
    assert compare.difference({"x": Opaque()}, {"x": Opaque()}, unchecked) is None
    assert unchecked == ["['x'] (a Opaque: == compares identity only)"], unchecked
    assert compare.difference(Opaque(), Opaque()) is not None  # without the list it is never passed as alike


# --- no false alarm -------------------------------------------------------------------------------------------------


class Sum(Metric):
    full_state_update = False
    total: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total = self.total + preds.sum()


class NanMean(Sum):
    """A Python float NaN as the result: the mean of no values (the totals above a bound), by ``.item()``."""

    def compute(self) -> float:
        return float(self.total[self.total > 1e9].mean().item())


class Normed(Sum):
    """A plain child module whose running statistics ``update()`` changes in place."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm = torch.nn.BatchNorm1d(1, dtype=torch.float64)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(self.norm(preds[:, None]).detach(), target)

    def compute(self) -> torch.Tensor:
        return self.total + cast(torch.Tensor, self.norm.running_mean).sum()


class Counted(Sum):
    """A dict attribute (not a state) that ``update()`` changes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows = {"seen": 0}

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(preds, target)
        self.rows["seen"] += preds.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.rows["seen"]


class Lazy(Metric):
    """A state added in the first ``update()``; a full state update, as torchmetrics' own forward needs for it."""

    full_state_update = True
    total: torch.Tensor

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if "total" not in self._defaults:
            self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.total = self.total + preds.sum()

    def compute(self) -> torch.Tensor:
        return self.total


@contextmanager
def _watched(check_on: bool) -> Iterator[tuple[list[int], list[str], list[str]]]:
    """The fused sync with the check on or off; inside: the collection exchanges, the collectives, this package's
    warnings."""
    with (
        tg.patched(sync="fused", check=check_on),
        exchanges() as seen,
        record_collectives() as issued,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        warned: list[str] = []
        yield seen, issued, warned
    warned += [str(w.message) for w in caught if "torchmetrics_gradpatch" in str(w.message)]


def _no_false_alarm(rank: int, world_size: int) -> None:
    """Two steps and ``compute()`` with each member that the fused run changes beyond its states: silent, and the
    values those of the fused sync alone."""

    def steps(check_on: bool) -> tuple[list[Any], int, list[str], list[str]]:
        torch.manual_seed(0)
        metrics = MetricCollection(
            {
                "nan": NanMean(dist_sync_on_step=True),
                "normed": Normed(dist_sync_on_step=True),
                "counted": Counted(dist_sync_on_step=True),
                "lazy": Lazy(dist_sync_on_step=True),
            },
            compute_groups=False,
        )
        with _watched(check_on) as (seen, issued, warned):
            values = [metrics(*batch(rank, 7, k)) for k in range(2)]
            values.append(metrics.compute())
        return values, len(seen), issued, warned

    alone, exchanged_alone, issued_alone, _ = steps(False)
    checked, exchanged, issued, warned = steps(True)
    assert (exchanged, exchanged_alone) == (3, 3), (exchanged, exchanged_alone)  # the fused exchange, each time
    assert "barrier" in issued and "barrier" not in issued_alone, issued  # torchmetrics' own path ran beside it
    assert warned == [], warned
    assert compare.difference(checked, alone) is None, compare.difference(checked, alone)
    assert isinstance(checked[0]["nan"], float) and checked[0]["nan"] != checked[0]["nan"], checked[0]


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_check_mode_raises_no_false_alarm_where_the_fused_run_changes_more_than_states(world_size: int) -> None:
    run_ranks(_no_false_alarm, world_size, timeout=120)


# --- no miss --------------------------------------------------------------------------------------------------------


class Summarised(Noisy):
    """:class:`Noisy` (random draws in ``update`` and ``compute``) whose result is a dataclass holding a tensor."""

    def compute(self) -> Summary:  # type: ignore[override]
        value = super().compute()
        return Summary(torch.stack([value, value * 2]))


class Unjudged(MeanSquaredError):  # noqa: N818 (a Metric, named after what it returns)
    """Returns, beside its value, an object that no comparison can judge."""

    def compute(self) -> tuple[torch.Tensor, Opaque]:  # type: ignore[override]
        return super().compute(), Opaque()


_COMPUTES = itertools.count()


class Counting(MeanSquaredError):  # noqa: N818 (a Metric, named after what it does)
    """A ``compute()`` that raises naming how many times it was called in this process: each path's error differs."""

    def compute(self) -> torch.Tensor:
        raise ValueError(f"compute call {next(_COMPUTES)}")


def _misses_none(rank: int, world_size: int) -> None:
    """A dataclass result that differs; the fused run raising where torchmetrics' own returns (a reduction broken
    on rank 1); both raising, other errors: the same error on every rank. A result that cannot be compared: one
    warning, the fused result."""
    metrics = MetricCollection(
        {"a": Summarised(dist_sync_on_step=True), "b": Noisy(dist_sync_on_step=True)}, compute_groups=False
    )
    torch.manual_seed(0)
    with _watched(True) as (seen, _, _):
        text = _raised(lambda: metrics(*batch(rank, 1, 0)))
    assert len(seen) == 1 and every_rank(text) == [text] * world_size, text
    assert "a MetricCollection's forward's result: ['a'].values at index [0]: " in text, text

    real = exchange.set_states

    def broken(*args: Any, **kwargs: Any) -> None:
        if rank == 1:
            raise RuntimeError("a reduction that fails on rank 1")
        real(*args, **kwargs)

    metric = Rows()
    metric.update(*batch(rank, 2, 0))
    exchange.set_states = broken
    try:
        with _watched(True) as (_, issued, _):
            text = _raised(metric.compute)
    finally:
        exchange.set_states = real
    assert every_rank(text) == [text] * world_size, text
    # both paths ran on every rank: the fused exchange first (its collective depends on torch), then torchmetrics'
    # own, which starts each state with a barrier
    assert issued and issued[0] != "barrier" and "barrier" in issued, issued
    assert (
        "the fused sync of Rows differs from torchmetrics' own sync on rank(s) [1]; on rank 1, Rows raised "
        "RuntimeError: a reduction that fails on rank 1 where torchmetrics' own path returned"
    ) in text, text

    metrics = MetricCollection({"n": Counting()})
    metrics.update(*batch(rank, 4, 0))
    with _watched(True) as (seen, issued, _):
        text = _raised(metrics.compute)
    assert len(seen) == 1 and "barrier" in issued and every_rank(text) == [text] * world_size, (seen, issued, text)
    assert re.search(
        r"on rank 0, a MetricCollection's compute\(\) raised ValueError: compute call (\d+) where torchmetrics' own "
        r"path raised ValueError: compute call (\d+)\.",
        text,
    ), text

    def judged(check_on: bool) -> tuple[Any, list[str], list[str]]:
        metrics = MetricCollection({"u": Unjudged()})
        metrics.update(*batch(rank, 4, 0))
        with _watched(check_on) as (seen, issued, warned):
            value = metrics.compute()
        assert len(seen) == 1, seen
        return value, issued, warned

    alone, _, _ = judged(False)
    value, issued, warned = judged(True)
    assert "barrier" in issued and same(value["u"][0], alone["u"][0]), (issued, value)
    assert len(warned) == 1, warned
    assert (
        "check mode: the fused sync of a MetricCollection's compute() was not checked: ['u'][1] (a Opaque: == "
        "compares identity only) and 1 more value(s) cannot be compared. The fused result is returned."
    ) in warned[0], warned


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_check_mode_misses_no_difference_and_names_what_it_cannot_compare(world_size: int) -> None:
    run_ranks(_misses_none, world_size, timeout=120)


# --- where torchmetrics' own would wait, and ranks that check differently --------------------------------------------


class Items(Metric):
    """Each row an element of a list state reduced with ``None``: as many elements as this rank's rows."""

    full_state_update = False
    items: list[torch.Tensor]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("items", [], dist_reduce_fx=None)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.items.extend(preds.unbind())

    def compute(self) -> torch.Tensor:
        return torch.stack(self.items)


def _never_waits(rank: int, world_size: int) -> None:
    """List states of other lengths per rank: the fused result and one warning naming the state, no reference run.
    Ranks whose check settings differ (a Metric's sync, a collection's step): the same error on every rank after the
    exchange's first collective, and no collective more."""

    def items(check_on: bool) -> tuple[torch.Tensor, list[str], list[str]]:
        metric = Items()
        metric.update(*batch(rank, 3, 0))  # 4 + rank rows
        with _watched(check_on) as (_, issued, warned):
            value = metric.compute()
        return value, issued, warned

    items(False)  # the exchange's layout settles: one collective from here on
    alone, issued_alone, _ = items(False)
    value, issued, warned = items(True)
    assert same(value, alone), (value, alone)
    assert issued == [*issued_alone, f"all_gather{[(2,)] * world_size}"], issued  # the check's facts, nothing more
    assert len(warned) == 1, warned
    assert (
        "the fused sync of Items was not checked: the ranks hold list state(s) ['Items.items'] with different numbers "
        "of elements, which torchmetrics' own sync gathers one by one and would wait on forever"
    ) in warned[0], warned

    # in a collection: its step (the batch states, after reset() and update(), are what syncs) and its compute()
    collection = MetricCollection({"rows": Items(dist_sync_on_step=True)})
    with _watched(True) as (seen, issued, warned):
        stepped = collection(*batch(rank, 3, 1))
        collection.compute()
    assert len(seen) == 2 and "barrier" not in issued and stepped["rows"].shape == (sum(batch_sizes(3, 1)),), issued
    assert [w[: w.index(" was not")] for w in warned] == [
        "torchmetrics_gradpatch: check mode: the fused sync of a MetricCollection's forward",
        "torchmetrics_gradpatch: check mode: the fused sync of a MetricCollection's compute()",
    ], warned
    assert all("list state(s) ['rows.items'] with different numbers" in w for w in warned), warned

    made: list[Callable[[], Any]] = [Rows, lambda: MetricCollection({"mse": MeanSquaredError(dist_sync_on_step=True)})]
    for make in made:
        metrics = make()
        metrics.update(*batch(rank, 5, 0))
        before = calls()
        with tg.patched(sync="fused", check=rank == 0):
            text = _raised(metrics.compute if isinstance(metrics, Rows) else lambda: metrics(*batch(rank, 5, 1)))  # noqa: B023
        issued_here = calls() - before
        assert every_rank((text, issued_here)) == [(text, 1)] * world_size, (text, issued_here)
        assert text.startswith("torchmetrics_gradpatch: fused sync: the ranks' check settings differ (check mode on")
        assert isinstance(_error(metrics, rank), exchange.CheckSettingError)


def batch_sizes(seed: int, k: int) -> list[int]:
    """Every rank's number of rows in ``batch(rank, seed, k)``."""
    return [len(batch(r, seed, k)[0]) for r in range(torch.distributed.get_world_size())]


def _error(metrics: Any, rank: int) -> BaseException | None:
    """The error a second, identical call raises (the group is still aligned: every rank issues the same)."""
    try:
        with tg.patched(sync="fused", check=rank == 0):
            metrics.compute()
    except Exception as error:
        return error
    return None


def test_check_mode_never_waits() -> None:
    run_ranks(_never_waits, 2, timeout=120)


#: the Metric classes of this module and the ones it borrows, trusted in its rank bodies: the subject is the check,
#: not which classes the collection's exchange trusts
TRUSTED = (
    Noisy,
    FailsOnRankOne,
    Rows,
    RowsSquared,
    AUROC,
    AP,
    TwoClass,
    Pairs,
    NanMean,
    Normed,
    Counted,
    Lazy,
    Summarised,
    Unjudged,
)
