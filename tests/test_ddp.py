"""The patched gather and Metric paths on real gloo ranks: world sizes 1, 2 and 3, and a subgroup of 2 of 3.

Every case is a test whose body runs on each of warm pooled gloo ranks (``run_ranks`` of ``tests/_ranks.py``)
and checks that rank against references it computes itself: gathered values against torchmetrics' own unpatched
gather, gradients against analytic values and a single-process float64 reference built from every rank's
(deterministic) inputs. Facts about the other ranks come through ``all_gather_object``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchmetrics.utilities.distributed as tm_dist
from torchmetrics.utilities.distributed import gather_all_tensors as ALIAS  # noqa: N812 - imported like users do

import torchmetrics_gradpatch
from tests._rank_tools import collection_loss, destroy_subgroup, every_rank, record_collectives, synced_state_loss
from tests._ranks import run_ranks
from tests._workloads import CatSquaredError, SumSquaredError
from torchmetrics_gradpatch import _engine

pytestmark = pytest.mark.python

# Per-rank batch sizes for list ("cat") states; rank 1 of 3 differs from the others, rank sizes are uneven.
CAT_ROWS = (3, 5, 4)
SUM_ROWS = (4, 4, 4)
SUBGROUP = [0, 2]


def inputs(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic preds/target for ``rank``; any rank rebuilds every rank's for the single-process reference."""
    gen = torch.Generator().manual_seed(1000 + rank)
    preds = torch.randn(rows, generator=gen, dtype=torch.float64)
    target = torch.randn(rows, generator=gen, dtype=torch.float64)
    return preds, target


# --------------------------------------------------------------------------------------------------- rank order


def _rank_order(rank: int, world_size: int) -> None:
    assert rank == dist.get_rank() and dist.get_world_size() == world_size, (rank, world_size)
    pids = tm_dist.gather_all_tensors(torch.tensor([os.getpid(), rank]))
    gathered = [tuple(int(v) for v in p) for p in pids]
    assert gathered == every_rank((os.getpid(), rank)), gathered
    assert [r for _, r in gathered] == list(range(world_size)) and gathered[rank][0] == os.getpid(), gathered


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_process_runs_the_rank_it_joined_as(world_size: int) -> None:
    """The rank-order lesson: entry j of a gather comes from the process that is rank j, and the body ran there."""
    run_ranks(_rank_order, world_size)


def uneven_gather_and_grad(rank: int, world_size: int) -> tuple[list[list[float]], list[float]]:
    """Rank r gathers ``r + 1`` rows through torchmetrics' own (patched) gather, then backpropagates a weighted sum."""
    x = torch.arange(rank + 1, dtype=torch.float64).add(10 * rank).requires_grad_()
    entries = tm_dist.gather_all_tensors(x)
    sum((j + 1) * e.sum() for j, e in enumerate(entries)).backward()  # type: ignore[union-attr]
    assert x.grad is not None, "no gradient reached the input"
    return [e.detach().tolist() for e in entries], x.grad.tolist()


def test_the_gathers_results_come_back_in_rank_order() -> None:
    """The smoke test: each rank's gathered values and gradient, checked in the pytest process, in rank order."""
    results = run_ranks(uneven_gather_and_grad, 2)
    assert [values for values, _ in results] == [[[0.0], [10.0, 11.0]]] * 2
    assert [grad for _, grad in results] == [[1.0], [2.0, 2.0]]  # only the local entry carries the graph


# --------------------------------------------------------------------------------------------------- gather


def gather_inputs(case: str, rank: int) -> tuple[torch.Tensor, bool]:
    """The tensor rank ``rank`` contributes in gather ``case``, and whether the call runs under no_grad."""
    f64 = torch.float64
    if case == "equal":
        return ((rank + 1) * torch.arange(6, dtype=f64).reshape(2, 3)).requires_grad_(), False
    if case == "uneven_rows":  # includes a rank with zero rows
        rows = (2, 0, 3)[rank % 3]
        return (torch.arange(rows * 2, dtype=f64).reshape(rows, 2) + 10 * rank).requires_grad_(), False
    if case == "uneven_all_dims":
        return (torch.ones(rank % 3 + 1, 3 - rank % 3, dtype=f64) * (rank + 1)).requires_grad_(), False
    if case == "scalar":
        return torch.tensor(rank + 0.5, dtype=f64, requires_grad=True), False
    if case == "non_contiguous":
        base = torch.arange(12, dtype=f64).reshape(3, 4) * (rank + 1)
        return base.t().requires_grad_(), False
    if case == "integer":
        return torch.arange(rank + 2, dtype=torch.int64) * 7, False
    if case == "no_requires_grad":
        return torch.full((2, rank + 1), float(rank), dtype=torch.float32), False
    if case == "under_no_grad":
        return torch.arange(3, dtype=f64).requires_grad_(), True
    raise ValueError(case)


GATHER_CASES = (
    "equal",
    "uneven_rows",
    "uneven_all_dims",
    "scalar",
    "non_contiguous",
    "integer",
    "no_requires_grad",
    "under_no_grad",
)


def _unpatched_gather(x: torch.Tensor, group: Any) -> tuple[list[torch.Tensor], list[str]]:
    """torchmetrics' own gather, with the patch switched off for the call."""
    torchmetrics_gradpatch.unpatch()
    try:
        with warnings.catch_warnings(), record_collectives() as calls:
            warnings.simplefilter("ignore")  # torchmetrics < 1.6 on torch >= 2.8 warns on uneven shapes
            return [t.detach().clone() for t in tm_dist.gather_all_tensors(x.detach(), group)], calls
    finally:
        torchmetrics_gradpatch.patch()


def check_gather_case(case: str, group: Any = None) -> None:
    """Patched gather (through torchmetrics' own module attribute) against the unpatched one, and its gradient."""
    local = dist.get_rank(group)
    x, no_grad = gather_inputs(case, dist.get_rank())
    reference, reference_calls = _unpatched_gather(x, group)
    with warnings.catch_warnings(record=True) as caught, record_collectives() as calls:
        warnings.simplefilter("always")
        if no_grad:
            with torch.no_grad():
                patched = tm_dist.gather_all_tensors(x, group)
        else:
            patched = tm_dist.gather_all_tensors(x, group)
    # The same gather through the trampoline in global mode, values only (no graph, so no backward collective);
    # every rank runs it, so the ranks agree on the mode. On native torchmetrics this is the comparison with
    # torchmetrics' own gather that goes through this package's code (local mode installs nothing there).
    with torchmetrics_gradpatch.patched(mode="global"), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        global_values = [t.detach().clone() for t in tm_dist.gather_all_tensors(x.detach(), group)]

    assert len(patched) == len(reference), (patched, reference)
    for j, (got, want) in enumerate(zip(patched, reference, strict=True)):
        assert got.dtype == want.dtype and got.shape == want.shape, (j, got, want)
        assert torch.equal(got, want), (j, got, want)  # bit for bit (these dtypes have no NaN here)
    assert torch.equal(patched[local], x.detach().contiguous()), (patched[local], x)
    assert [str(w.message) for w in caught] == [], [str(w.message) for w in caught]
    assert calls == reference_calls, (calls, reference_calls)
    for j, (got, want) in enumerate(zip(global_values, reference, strict=True)):  # through the trampoline
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), ("global", j)
    if case != "non_contiguous":
        assert patched[local] is x, "the local entry must be the caller's own tensor"
    else:  # upstream returns result.contiguous(): a copy that is still connected to the caller's graph
        assert patched[local] is not x
    requires_grad = [t.requires_grad for t in patched]
    if case in ("integer", "no_requires_grad"):
        assert requires_grad == [False] * len(patched), requires_grad
        return
    # the caller's own entry keeps its graph (under no_grad: the leaf itself); nothing else has one
    assert requires_grad == [j == local for j in range(len(patched))], requires_grad
    if not no_grad:
        # d/dx of sum_j (j + 1) * out[j].sum() is (local + 1) everywhere: only the local entry has a graph
        loss = sum((j + 1) * entry.sum() for j, entry in enumerate(patched))
        loss.backward()  # type: ignore[union-attr]
        assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, float(local + 1))), x.grad
    else:
        assert x.grad is None, x.grad


def _gather_case(rank: int, world_size: int, case: str) -> None:
    check_gather_case(case)


@pytest.mark.parametrize("case", GATHER_CASES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gather_matches_unpatched_and_keeps_local_graph(world_size: int, case: str) -> None:
    run_ranks(_gather_case, world_size, case)


def _subgroup(rank: int, world_size: int) -> None:
    group = dist.new_group(SUBGROUP)  # every rank takes part in creating it
    if rank in SUBGROUP:
        assert dist.get_rank(group) == SUBGROUP.index(rank), dist.get_rank(group)
        for case in ("equal", "uneven_rows", "scalar"):
            check_gather_case(case, group)
    else:
        assert dist.get_rank(group) == -1, dist.get_rank(group)  # rank 1 is outside the group and gathers nothing
    dist.barrier()
    destroy_subgroup(group)


def test_subgroup_uses_the_rank_within_the_group() -> None:
    """Ranks 0 and 2 of 3 gather in their own group: the local entry sits at the rank within the group.

    One test for the three shapes, one group for every case; it is destroyed at the end, so the warm ranks stay.
    """
    run_ranks(_subgroup, 3)


def rows_for(case: str) -> tuple[int, ...]:
    """Per-rank batch sizes of a Metric case: uneven wherever a list ("cat") state is synced."""
    return SUM_ROWS if case.endswith("sum") else CAT_ROWS


def reference_grad(case: str, rank: int, world_size: int) -> torch.Tensor:
    """Single-process gradient of the global loss w.r.t. ``rank``'s preds (every rank's data, in one process)."""
    rows = rows_for(case)
    preds, targets = zip(*(inputs(r, rows[r]) for r in range(world_size)), strict=True)
    leaves = [p.clone().requires_grad_() for p in preds]
    mse = ((torch.cat(leaves) - torch.cat(targets)) ** 2).mean()
    loss = 2 * mse if case in ("collection", "compositional") else mse
    (grad,) = torch.autograd.grad(loss, leaves[rank])
    return grad


def metric_loss(case: str, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The synced loss of one Metric path on this rank."""
    if case == "forward_sum":
        return SumSquaredError(dist_sync_on_step=True)(preds, target)  # type: ignore[no-any-return]
    if case == "forward_cat":
        return CatSquaredError(dist_sync_on_step=True)(preds, target)  # type: ignore[no-any-return]
    if case == "collection":
        return collection_loss(preds, target)
    if case == "compositional":
        metric = SumSquaredError(dist_sync_on_step=True) + CatSquaredError(dist_sync_on_step=True)
        return metric(preds, target)  # type: ignore[no-any-return]
    if case in ("sync_sum", "sync_cat", "sync_dist_default_sum", "sync_dist_default_cat"):
        return synced_state_loss(case, preds, target)
    # a sync function bound before the patch: an alias, a partial, the module attribute as dist_sync_fn
    torchmetrics_gradpatch.unpatch()
    sync_fn: Callable[..., Any] = {
        "alias": ALIAS,
        "partial_before_patch": functools.partial(tm_dist.gather_all_tensors),
        "dist_sync_fn_before_patch": tm_dist.gather_all_tensors,
    }[case]
    cat = CatSquaredError(dist_sync_on_step=True, dist_sync_fn=sync_fn)
    torchmetrics_gradpatch.patch()
    return cat(preds, target)  # type: ignore[no-any-return]


METRIC_CASES = (
    "forward_sum",
    "forward_cat",
    "collection",
    "compositional",
    "sync_sum",
    "sync_cat",
    "sync_dist_default_sum",
    "sync_dist_default_cat",
    "alias",
    "partial_before_patch",
    "dist_sync_fn_before_patch",
)


def _metric_path(rank: int, world_size: int, case: str) -> None:
    preds, target = inputs(rank, rows_for(case)[rank])
    preds.requires_grad_()
    loss = metric_loss(case, preds, target)
    loss.backward()
    assert preds.grad is not None, f"no gradient reached rank {rank}'s preds"
    torch.testing.assert_close(preds.grad, reference_grad(case, rank, world_size), rtol=1e-12, atol=1e-15)
    values = every_rank(loss.detach())
    assert all(torch.equal(v, values[0]) for v in values), f"every rank must see the same synced loss: {values}"


@pytest.mark.parametrize("case", METRIC_CASES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_metric_paths_backpropagate_like_single_process(world_size: int, case: str) -> None:
    """Each rank's gradient is d(global loss)/d(its own preds): the single-process gradient, sliced."""
    run_ranks(_metric_path, world_size, case)


def _patch_difference(rank: int, world_size: int) -> None:
    reference = reference_grad("forward_cat", rank, world_size)
    native = torchmetrics_gradpatch.status().native
    assert torchmetrics_gradpatch.is_patched(), torchmetrics_gradpatch.status()
    torchmetrics_gradpatch.unpatch()
    try:
        assert not _engine.installed(), torchmetrics_gradpatch.status()
        preds, target = inputs(rank, CAT_ROWS[rank])
        preds.requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = CatSquaredError(dist_sync_on_step=True)(preds, target)
        assert loss.requires_grad == native, (loss, native)
        if native:
            loss.backward()
            torch.testing.assert_close(preds.grad, reference, rtol=1e-12, atol=1e-15)
        else:
            assert preds.grad is None, preds.grad
    finally:
        torchmetrics_gradpatch.patch()
    preds, target = inputs(rank, CAT_ROWS[rank])
    preds.requires_grad_()
    with torchmetrics_gradpatch.patched(mode="global"):
        assert _engine.installed(), torchmetrics_gradpatch.status()
        CatSquaredError(dist_sync_on_step=True)(preds, target).backward()
    torch.testing.assert_close(preds.grad, world_size * reference, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_patch_is_what_makes_the_difference(world_size: int) -> None:
    """Control. Patch off: old torchmetrics loses the graph; native torchmetrics keeps it and gives the reference
    gradient itself. Global mode (installed on every torchmetrics): every rank gets world_size x the reference,
    so on native torchmetrics too the installed code, not torchmetrics' own, produced it."""
    run_ranks(_patch_difference, world_size)


#: the collection loss's Metric classes, trusted in its rank bodies: its subject is the collection's exchange, not which
#: classes the exchange trusts (tests/test_fused_trust.py)
TRUSTED = (SumSquaredError, CatSquaredError)
