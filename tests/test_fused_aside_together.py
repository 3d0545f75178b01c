"""Ranks step aside together, on real gloo ranks: where one rank does not recognise a torchmetrics function that its
peers do (another tool's wrapper on that rank alone), every rank runs torchmetrics' own path, for a Metric's sync, a
collection's ``compute()`` and its training step, with torchmetrics' values, and no rank waits.

The rank that steps aside still sends the exchange's first collective, flagged: every exchange of every rank then
returns having taken nothing over, and torchmetrics' own sync runs.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torchmetrics import MeanSquaredError, Metric, MetricCollection
from torchmetrics.regression import PearsonCorrCoef

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from tests.test_fused import worlds
from tests.test_fused_step import alike
from tests.test_fused_trust import batch, outcomes
from torchmetrics_gradpatch.fused import exchange


@contextlib.contextmanager
def single_syncs() -> Iterator[list[bool]]:
    """Whether each fused sync of one Metric inside synced (``False``: some rank stepped aside)."""
    real, seen = exchange.sync_metric, []

    def spy(*args: Any, **kwargs: Any) -> bool:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    exchange.sync_metric = spy
    try:
        yield seen
    finally:
        exchange.sync_metric = real


def _run(make: Callable[[], Any], rank: int, sync: str) -> list[Any]:
    """A Metric's or a collection's two training steps and ``compute()``: the values."""
    metric, values = make(), []
    with tg.patched(sync=sync):
        for k in range(2):
            preds, target = batch(rank, k)
            values.append(metric(preds, target))
        values.append(metric.compute())
    return values


def _one_rank_steps_aside(rank: int, world_size: int) -> None:
    original = Metric.__dict__["unsync"]

    @functools.wraps(original)
    def unsync(self: Metric, should_unsync: bool = True) -> None:  # another tool's wrapper, on rank 1 alone
        original(self, should_unsync)

    cases: dict[str, tuple[Callable[[], Any], int, int]] = {  # what syncs; its collection exchanges and Metric syncs
        "a Metric": (lambda: MeanSquaredError(dist_sync_on_step=True), 0, 3),
        "a collection": (
            lambda: MetricCollection(
                [MeanSquaredError(dist_sync_on_step=True), PearsonCorrCoef(dist_sync_on_step=True)]
            ),
            3,
            6,
        ),
    }
    if rank == 1:
        tg.unpatch()  # the original in place, so the package's replacements wrap the changed one
        Metric.unsync = unsync  # type: ignore[method-assign]
    try:
        for what, (make, exchanges, syncs) in cases.items():
            expected = _run(make, rank, "torchmetrics")
            with warnings.catch_warnings(record=True) as caught, outcomes() as seen, single_syncs() as synced:
                warnings.simplefilter("always")
                got = _run(make, rank, "fused")
            assert alike(got, expected), (what, got, expected)
            # every exchange ran on every rank and took nothing over: torchmetrics' own sync ran after each
            assert len(seen) == exchanges and not any(o.synced or o.joins for o in seen), (what, seen)
            assert synced == [False] * syncs, (what, synced)
            warned = [str(w.message) for w in caught if "is not recognised" in str(w.message)]
            assert len(warned) == (rank == 1 and what == "a Metric"), (what, warned)  # once per live object
            assert ("torchmetrics.metric.Metric.unsync" in tg.status().stepped_aside) == (rank == 1), what
    finally:
        if rank == 1:
            tg.unpatch()
            Metric.unsync = original  # type: ignore[method-assign]
    assert Metric.__dict__["unsync"] is original
    torch.distributed.barrier()


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_one_rank_steps_aside_and_every_rank_follows(world_size: int) -> None:
    run_ranks(_one_rank_steps_aside, world_size, timeout=120)
