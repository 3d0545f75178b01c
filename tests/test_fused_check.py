"""Check mode on real gloo ranks: every fused sync and step also runs torchmetrics' own sync from the same states
and random state and compares bit for bit; a difference raises the same error on every rank, naming the rank, the
Metric, the state and the first difference; a long randomized run stays silent and returns the fused values.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torchmetrics import MeanSquaredError, MetricCollection

import torchmetrics_gradpatch as tg
from tests._rank_tools import every_rank
from tests._ranks import run_ranks
from tests.test_fused import same, worlds
from tests.test_fused_forms import GLOBAL_HOOKS, Noisy, batch, build, draw, global_hook, run
from tests.test_fused_step import Rows, alike
from torchmetrics_gradpatch._errors import FusedSyncError
from torchmetrics_gradpatch.fused import sync as fs


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
    real = fs.reduce

    def broken(metric: Any, states: Any, *args: Any, **kwargs: Any) -> None:
        real(metric, states, *args, **kwargs)
        if rank == 1:
            metric.sse = metric.sse + 1

    fs.reduce = broken  # type: ignore[assignment]
    try:
        metric = Rows()
        metric.update(*batch(rank, 2, 0))
        with tg.patched(sync="fused", check=True):
            text = _raised(metric.compute)
    finally:
        fs.reduce = real  # type: ignore[assignment]
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
    alone (and torchmetrics' own), rank 1 raises its error and the other ranks return torchmetrics' values, none
    waiting in a check that rank 1 does not run."""

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
        got = outcome("fused", True, step)
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
        assert not any("FusedSyncError" in str(entry) for entry in checked), (spec, checked[-1])
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
