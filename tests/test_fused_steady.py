"""A steady fused exchange costs one collective, on real gloo ranks; a change costs at most two more, never a wrong
value or a hang.

Every step builds the same Metric twice from every rank's data, syncs one with torchmetrics' own ``_sync_dist`` and
the other with the fused sync, and compares every state bit for bit. Collectives are counted with the process
group's sequence number. Between tests each rank forgets every group's inline capacity (``tests._patch_state``), so
each test's first exchange of a group costs two collectives: the counts below do not depend on test order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_sum

from tests._rank_tools import calls, destroy_subgroup
from tests._ranks import run_ranks
from tests.test_fused import Probe, same, states, torchmetrics_sync, values, worlds
from torchmetrics_gradpatch import fused as _fused
from torchmetrics_gradpatch.fused import wire
from torchmetrics_gradpatch.fused.internals import placeholder_rule


def probe(rank: int, rows: int, dtype: torch.dtype = torch.float32, empty: bool = False) -> Probe:
    """A Metric with a sum, a max and a ``cat`` list state (``rows`` rows of ``dtype`` here; none when ``empty``)."""
    metric = Probe({"total": (torch.tensor(0.0), "sum"), "peak": (torch.zeros(3), "max"), "seen": ([], "cat")})
    metric.total = values(rank, 1, (), torch.float32)
    metric.peak = values(rank, 2, (3,), torch.float32)
    # 1-d, as torchmetrics' own sync needs where a rank's list is empty (its placeholder is 1-d)
    metric.seen = [] if empty else [values(rank, 3, (rows,), dtype), values(rank, 4, (1,), dtype)]
    return metric


def one_process(world_size: int, how: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """The states one process holding every rank's data syncs ``probe`` to: torchmetrics' reductions on the stacked
    and concatenated states (the reference where torchmetrics' own sync desyncs: a rank with an empty ``cat`` list
    before its placeholder, torchmetrics 1.4 on torch 2.1)."""
    held = [probe(r, **how(r)) for r in range(world_size)]
    return {
        "total": dim_zero_sum(torch.stack([m.total for m in held])),
        "peak": dim_zero_max(torch.stack([m.peak for m in held])),
        "seen": dim_zero_cat([t for m in held for t in m.seen]),
    }


def step(rank: int, group: Any = None, reference: dict[str, Any] | None = None, **how: Any) -> int:
    """One fused sync of a fresh metric against torchmetrics' own (or ``reference``); the collectives the fused
    sync issued."""
    expected, fused = probe(rank, **how), probe(rank, **how)
    if reference is None:
        torchmetrics_sync(expected, group)
        reference = states(expected)
    before = calls(group)
    _fused.fused_sync(fused, group)
    issued = calls(group) - before
    for name, value in reference.items():
        assert same(getattr(fused, name), value), (how, name, getattr(fused, name), value)
    return issued


# (what changes, this step's states by rank, collectives: exact, or the most a change may cost)
SCENARIO: list[tuple[str, Any, int]] = [
    ("first exchange of the group", lambda r: {"rows": 4 + r}, 2),
    ("steady", lambda r: {"rows": 4 + r}, 1),
    ("steady, the metric made anew on every rank", lambda r: {"rows": 4 + r}, 1),
    ("a rank whose metric was reset (an empty cat list)", lambda r: {"rows": 4 + r, "empty": r == 1}, 1),
    ("the batch grows past the capacity", lambda r: {"rows": 600 + r}, 2),
    ("steady again at the new size", lambda r: {"rows": 600 + r}, 1),
    ("smaller batches fit the capacity", lambda r: {"rows": 2 + r}, 1),
    ("a dtype change", lambda r: {"rows": 2 + r, "dtype": torch.float64}, 2),
    ("steady in the new dtype", lambda r: {"rows": 2 + r, "dtype": torch.float64}, 1),
    ("one rank's payload over the largest capacity", lambda r: {"rows": 20000 if r == 1 else 2 + r}, 2),
    ("again: always two", lambda r: {"rows": 20000 if r == 1 else 2 + r}, 2),
    ("back to small: the capacity stayed", lambda r: {"rows": 2 + r}, 1),
]


def _scenario(rank: int, world_size: int) -> list[int]:
    counts = []
    for what, how, cost in SCENARIO:
        empty = any(how(r).get("empty") for r in range(world_size))
        reference = one_process(world_size, how) if empty and not placeholder_rule(probe(rank, 1)) else None
        issued = step(rank, None, reference, **how(rank))
        counts.append(issued)
        exact = cost == 1 or what.startswith(("first", "the batch grows", "one rank's", "again"))
        assert issued == cost if exact else 1 <= issued <= cost, (what, issued, cost)
    return counts


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_steady_exchange_costs_one_collective(world_size: int) -> None:
    counts = run_ranks(_scenario, world_size, timeout=90)
    assert all(c == counts[0] for c in counts), counts  # every rank issued the same collectives


def _subgroup_and_skips(rank: int, world_size: int) -> None:
    assert step(rank, rows=4 + rank) == 2 and step(rank, rows=4 + rank) == 1
    pair = dist.new_group([0, 1])
    if rank in (0, 1):  # rank 2 skips these exchanges: they are the pair's, and so is their record
        assert step(rank, pair, rows=1000 + rank) == 2
        assert step(rank, pair, rows=1000 + rank) == 1
        assert wire.Group.of(pair).capacity.data >= 4000
    assert step(rank, rows=4 + rank) == 1, "the pair's exchanges changed the world's capacity"
    assert wire.Group.of(None).capacity.data < 4000
    if rank in (0, 1):
        assert step(rank, pair, rows=1000 + rank) == 1
    destroy_subgroup(pair)


def test_a_rank_skipping_a_subgroup_exchange_stays_in_step() -> None:
    run_ranks(_subgroup_and_skips, 3, timeout=90)


def _global_step(rank: int, world_size: int) -> list[tuple[int, int]]:
    counts = []
    for _ in range(3):
        x = values(rank, 5, (4 + rank,), torch.float64).requires_grad_()
        metric = Probe({"total": (torch.tensor(0.0, dtype=torch.float64), "sum"), "seen": ([], "cat")})
        metric.total = (x**2).sum()
        metric.seen = [x]
        before = calls()
        _fused.fused_sync(metric, mode="global")
        forward = calls() - before
        (metric.total + metric.seen.sum()).backward()
        counts.append((forward, calls() - before - forward))
        # every rank's loss is the same sum over every rank's data: rank j's x gets world_size * (2 x + 1)
        assert x.grad is not None
        torch.testing.assert_close(x.grad, world_size * (2 * x.detach() + 1), rtol=1e-14, atol=0)
    return counts


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_global_mode_steady_step_costs_two_collectives(world_size: int) -> None:
    for counts in run_ranks(_global_step, world_size, timeout=90):
        assert counts == [(2, 1), (1, 1), (1, 1)], counts


def _forward(rank: int, world_size: int) -> list[int]:
    from torchmetrics.regression import MeanSquaredError

    import torchmetrics_gradpatch as tg

    counts = []
    fused, reference = MeanSquaredError(dist_sync_on_step=True), MeanSquaredError(dist_sync_on_step=True)
    for k in range(4):
        n = 3 + rank + (40 if k == 2 else 0)  # the batch size changes at the third step and back
        preds, target = values(rank, 10 + k, (n,), torch.float32), values(rank, 20 + k, (n,), torch.float32)
        with tg.patched(sync="torchmetrics"):
            expected = reference(preds, target)
        with tg.patched(sync="fused"):
            before = calls()
            got = fused(preds, target)
            counts.append(calls() - before)
        assert same(got, expected), (k, got, expected)
    with tg.patched(sync="torchmetrics"):
        expected = reference.compute()
    with tg.patched(sync="fused"):
        got = fused.compute()
    assert same(got, expected), (got, expected)
    return counts


def test_metric_forward_with_sync_on_step_costs_one_collective() -> None:
    """MeanSquaredError's states are sums: a changed batch size changes no size, so every step after the first
    costs one collective."""
    for counts in run_ranks(_forward, 2, timeout=90):
        assert counts == [2, 1, 1, 1], counts


def _after_an_error(rank: int, world_size: int) -> None:
    from torchmetrics import MeanMetric, MetricCollection, SumMetric

    import torchmetrics_gradpatch as tg
    from torchmetrics_gradpatch import FusedSyncError

    assert step(rank, rows=4 + rank) == 2 and step(rank, rows=4 + rank) == 1
    members = {"a": SumMetric(), "b": MeanMetric()} if rank == 1 else {"a": SumMetric()}
    collection = MetricCollection(members)  # rank 1 holds another member set
    collection.update(torch.tensor(float(rank)))
    with tg.patched(sync="fused"), pytest.raises(FusedSyncError, match="collections of different sizes"):
        collection.compute()
    assert step(rank, rows=4 + rank) == 1, "the failed exchange left the ranks' capacities apart"
    assert step(rank, rows=600 + rank) == 2 and step(rank, rows=600 + rank) == 1


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_an_exchange_that_raises_keeps_the_ranks_in_step(world_size: int) -> None:
    run_ranks(_after_an_error, world_size, timeout=90)


def test_the_capacity_rule() -> None:
    """The capacity from a group's record: the largest payload of the last WINDOW exchanges rounded up to a power of
    two, at least INLINE_MIN, none from exchanges over INLINE_MAX; the description words likewise. A key that takes
    no weak reference (a tuple here; a process group on some torch versions) is kept in a plain dictionary."""

    def row(size: int, words: int) -> list[int]:
        header = [0] * wire.HEADER_WORDS
        header[wire.WORDS], header[wire.SIZE], header[wire.SIZE_REDUCED] = words, size + 4096, size
        return header

    group = ("a group",)
    try:
        assert wire.Group.of(group).capacity == wire.Capacity(0, 0)
        wire.Group.of(group).agree([row(100, 6), row(90, 20)])  # the largest of every rank's: 100 bytes, 20 words
        assert wire.Group.of(group).capacity == wire.Capacity(wire.INLINE_MIN, 32)
        wire.Group.of(group).agree([row(1025, 6), row(wire.INLINE_MAX + 1, 6)])  # over the largest: not counted
        assert wire.Group.of(group).capacity == wire.Capacity(wire.INLINE_MIN, 32)
        wire.Group.of(group).agree([row(1025, 6)])
        assert wire.Group.of(group).capacity == wire.Capacity(2048, 32)
        assert wire.Group.of(("another group",)).capacity == wire.Capacity(0, 0)
        for _ in range(wire.WINDOW - 1):
            wire.Group.of(group).agree([row(16, 2)])
        assert wire.Group.of(group).capacity == wire.Capacity(2048, 8)  # the 1025-byte exchange is the oldest one kept
        wire.Group.of(group).agree([row(16, 2)])
        assert wire.Group.of(group).capacity == wire.Capacity(wire.INLINE_MIN, 2)
        # layouts in a cycle (alternating batch sizes), then a change: after every exchange the capacity is the rule
        # applied to the last WINDOW exchanges, computed here from the needs themselves
        needs = [(16, 2)] * wire.WINDOW
        cycle = [(300, 2), (16, 2), (700, 40)] * wire.WINDOW + [(16, 2)] * (wire.WINDOW + 1) + [(2000, 9)]
        for size, words in cycle:
            wire.Group.of(group).agree([row(size, words)])
            needs = [*needs[1:], (size, words)]
            data = max(1 << (max(n for n, _ in needs) - 1).bit_length(), wire.INLINE_MIN)
            expected = wire.Capacity(data, min(1 << (max(w for _, w in needs) - 1).bit_length(), data // 8))
            assert wire.Group.of(group).capacity == expected, (size, words)
    finally:
        _fused.reset()
