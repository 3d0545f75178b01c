"""Functions that run inside spawned ranks (module-level, so ``spawn`` can import them).

Each rank runs a whole batch of cases and returns plain data (detached tensors, booleans, strings); the
assertions live in ``tests/test_ddp.py``, in the parent, where the single-process references are computed.
Batching keeps the suite fast: a spawn costs seconds, a case milliseconds.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torchmetrics.utilities.distributed as tm_dist
from torchmetrics import MetricCollection
from torchmetrics.utilities.distributed import gather_all_tensors as ALIAS  # noqa: N812 - imported like users do

import torchmetrics_gradpatch
from tests._rank_tools import CatSquaredError, SumSquaredError, record_collectives, synced_state_loss

# Per-rank batch sizes for list ("cat") states; rank 1 of 3 differs from the others, rank sizes are uneven.
CAT_ROWS = (3, 5, 4)
SUM_ROWS = (4, 4, 4)


def inputs(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic preds/target for ``rank``; the parent rebuilds them for the single-process reference."""
    gen = torch.Generator().manual_seed(1000 + rank)
    preds = torch.randn(rows, generator=gen, dtype=torch.float64)
    target = torch.randn(rows, generator=gen, dtype=torch.float64)
    return preds, target


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


def run_gather_case(case: str, group: Any = None) -> dict[str, Any]:
    """Patched gather (through torchmetrics' own module attribute) vs the unpatched one, and the gradient."""
    rank = dist.get_rank(group)
    x, no_grad = gather_inputs(case, dist.get_rank())
    reference, reference_calls = _unpatched_gather(x, group)
    with warnings.catch_warnings(record=True) as caught, record_collectives() as calls:
        warnings.simplefilter("always")
        if no_grad:
            with torch.no_grad():
                out = tm_dist.gather_all_tensors(x, group)
        else:
            out = tm_dist.gather_all_tensors(x, group)
    # The same gather through the trampoline in global mode, values only (no graph, so no backward collective);
    # every rank runs it here, so the ranks agree on the mode. On native torchmetrics this is the comparison
    # with torchmetrics' own gather that goes through this package's code (local mode installs nothing there).
    with torchmetrics_gradpatch.patched(mode="global"), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        global_values = [t.detach().clone() for t in tm_dist.gather_all_tensors(x.detach(), group)]
    grad = None
    if x.requires_grad and not no_grad:
        # d/dx of sum_j (j + 1) * out[j].sum() is (rank + 1) everywhere: only the local entry has a graph.
        loss = sum((j + 1) * entry.sum() for j, entry in enumerate(out))
        loss.backward()  # type: ignore[union-attr]
        grad = x.grad
    return {
        "group_rank": rank,
        "input": x.detach().clone(),
        "patched": [t.detach().clone() for t in out],
        "reference": reference,
        "global_values": global_values,
        "local_is_input": out[rank] is x,
        "requires_grad": [t.requires_grad for t in out],
        "grad": grad,
        "warnings": [str(w.message) for w in caught],
        "collectives": calls,
        "reference_collectives": reference_calls,
    }


# --------------------------------------------------------------------------------------------------- metrics


def _sum_metric(**kwargs: Any) -> SumSquaredError:
    return SumSquaredError(**kwargs).to(torch.float64)


def rows_for(case: str) -> tuple[int, ...]:
    """Per-rank batch sizes of a Metric case: uneven wherever a list ("cat") state is synced."""
    return SUM_ROWS if case.endswith("sum") else CAT_ROWS


def _metric_case(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one Metric path on this rank; return (the synced loss value, d loss / d preds)."""
    rows = rows_for(case)[rank]
    preds, target = inputs(rank, rows)
    preds.requires_grad_()
    if case == "forward_sum":
        loss = SumSquaredError(dist_sync_on_step=True)(preds, target)
    elif case == "forward_cat":
        loss = CatSquaredError(dist_sync_on_step=True)(preds, target)
    elif case == "collection":
        collection = MetricCollection(
            {"sum": SumSquaredError(dist_sync_on_step=True), "cat": CatSquaredError(dist_sync_on_step=True)}
        )
        values = collection(preds, target)
        loss = values["sum"] + values["cat"]
    elif case == "compositional":
        loss = (SumSquaredError(dist_sync_on_step=True) + CatSquaredError(dist_sync_on_step=True))(preds, target)
    elif case in ("sync_sum", "sync_cat", "sync_dist_default_sum", "sync_dist_default_cat"):
        loss = synced_state_loss(case, preds, target)
    elif case in ("alias", "partial_before_patch", "dist_sync_fn_before_patch"):
        torchmetrics_gradpatch.unpatch()
        if case == "alias":
            sync_fn: Callable[..., Any] = ALIAS
        elif case == "partial_before_patch":
            sync_fn = functools.partial(tm_dist.gather_all_tensors)
        else:
            sync_fn = tm_dist.gather_all_tensors
        metric = CatSquaredError(dist_sync_on_step=True, dist_sync_fn=sync_fn)
        torchmetrics_gradpatch.patch()
        loss = metric(preds, target)
    else:
        raise ValueError(case)
    loss.backward()
    assert preds.grad is not None
    return loss.detach(), preds.grad


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


def _control(rank: int) -> dict[str, Any]:
    """Control, the ``forward_cat`` case: with the patch off, and in global mode (which installs everywhere).

    With the patch off, old torchmetrics loses the graph and native torchmetrics keeps it (its gradient is then
    compared with the single-process reference). In global mode the trampoline is installed on every
    torchmetrics and every rank receives ``world_size`` times that gradient, so the patch visibly makes the
    difference on native torchmetrics too. Every rank runs both, in the same order.
    """
    from torchmetrics_gradpatch import _engine

    out: dict[str, Any] = {}
    torchmetrics_gradpatch.unpatch()
    try:
        preds, target = inputs(rank, CAT_ROWS[rank])
        preds.requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = CatSquaredError(dist_sync_on_step=True)(preds, target)
        out["unpatched_keeps_graph"] = bool(loss.requires_grad)
        out["unpatched_installed"] = _engine.installed()
        if loss.requires_grad:
            loss.backward()
        out["unpatched_grad"] = preds.grad
    finally:
        torchmetrics_gradpatch.patch()
    preds, target = inputs(rank, CAT_ROWS[rank])
    preds.requires_grad_()
    with torchmetrics_gradpatch.patched(mode="global"):
        out["global_installed"] = _engine.installed()
        CatSquaredError(dist_sync_on_step=True)(preds, target).backward()
    out["global_grad"] = preds.grad
    return out


def run_all(subgroup_ranks: list[int] | None = None) -> dict[str, Any]:
    """Everything one rank checks: every gather case, every Metric path, rank identity, and the control."""
    rank = dist.get_rank()
    out: dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "native": torchmetrics_gradpatch.status().native,
        "status_in_force": torchmetrics_gradpatch.is_patched(),
    }
    # Rank identity: every rank's pid, gathered; index j must hold the pid of the process that is rank j.
    pids = tm_dist.gather_all_tensors(torch.tensor([os.getpid(), rank]))
    out["gathered_pids"] = [tuple(int(v) for v in p) for p in pids]
    out["gather"] = {case: run_gather_case(case) for case in GATHER_CASES}
    out["metric"] = {}
    for case in METRIC_CASES:
        value, grad = _metric_case(case, rank)
        out["metric"][case] = {"value": value, "grad": grad}
    out["control"] = _control(rank)
    if subgroup_ranks is not None:
        group = dist.new_group(subgroup_ranks)  # every rank must take part in creating it
        if rank in subgroup_ranks:
            out["subgroup"] = {case: run_gather_case(case, group) for case in ("equal", "uneven_rows", "scalar")}
        dist.barrier()
    return out


def uneven_gather_warnings() -> dict[str, Any]:
    """The warnings of one uneven gather (rows differ per rank) by every path; every rank runs every path alike.

    torchmetrics before 1.6 slices uneven results with a list, which torch >= 2.8 deprecates with a warning at
    every call; the package's gather must not warn. The unpatched call is the control that this path is the one
    that warns. Global-mode calls use a tensor without grad, so no backward collective is left pending.
    """
    rank = dist.get_rank()
    x = torch.ones(2 + rank, 3, dtype=torch.float64, requires_grad=True)

    def unpatched() -> list[torch.Tensor]:
        torchmetrics_gradpatch.unpatch()
        try:
            return list(tm_dist.gather_all_tensors(x))
        finally:
            torchmetrics_gradpatch.patch()

    def through(mode: str) -> Callable[[], list[torch.Tensor]]:
        def call() -> list[torch.Tensor]:
            with torchmetrics_gradpatch.patched(mode=mode):
                return list(tm_dist.gather_all_tensors(x if mode == "local" else x.detach()))

        return call

    paths: dict[str, Callable[[], list[torch.Tensor]]] = {
        "direct, local": lambda: torchmetrics_gradpatch.gather_all_tensors(x),
        "direct, global": lambda: torchmetrics_gradpatch.gather_all_tensors(x.detach(), mode="global"),
        "torchmetrics' function, local": through("local"),
        "torchmetrics' function, global": through("global"),
        "unpatched": unpatched,
    }
    out: dict[str, Any] = {}
    for name, call in paths.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
        out[name] = {
            "warnings": [str(w.message) for w in caught],
            "shapes": [tuple(t.shape) for t in result],
        }
    return out
