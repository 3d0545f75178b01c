"""Global mode's one autograd node for all of a fused exchange's states: its inputs are this rank's own tensors that
require grad, its outputs every rank's gathered copies of the tensors that required grad on their rank, its backward
global mode's one ``all_to_all_single`` (:func:`torchmetrics_gradpatch._global.scatter_sum`). Semantics:
docs/gradient-modes.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from torchmetrics_gradpatch._global import scatter_sum


class Entry(NamedTuple):
    """One differentiable entry: its owner rank, its gathered copy, and whether the output must own its memory (it
    outlives the sync as list-state content)."""

    owner: int
    value: torch.Tensor
    copy: bool


class Node(NamedTuple):
    """What the node needs: ``entries`` in owner-rank order, then state order (a rank's own are its inputs' order)."""

    entries: list[Entry]
    rank: int
    world_size: int
    group: Any  # None for the default group: a graph alive at exit must not hold the group object
    device: torch.device


class _FusedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: Node, leaf: torch.Tensor | None, *own: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # owners, dtypes and shapes only: a graph that outlives the sync must not keep the receive buffers alive
        ctx.owners = [e.owner for e in plan.entries]
        ctx.dtypes = [e.value.dtype for e in plan.entries]
        ctx.shapes = [e.value.shape for e in plan.entries]
        ctx.rank, ctx.world_size, ctx.group, ctx.device = plan.rank, plan.world_size, plan.group, plan.device
        ctx.set_materialize_grads(False)  # an entry the loss does not use sends zeros without a gradient tensor
        return tuple(entry.value.clone() if entry.copy else entry.value for entry in plan.entries)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        totals = scatter_sum(ctx.owners, ctx.dtypes, ctx.shapes, grads, ctx.rank, ctx.world_size, ctx.group, ctx.device)
        mine = [k for k, owner in enumerate(ctx.owners) if owner == ctx.rank]
        inputs = [
            (total if total is not None else torch.zeros(ctx.shapes[k], dtype=ctx.dtypes[k], device=ctx.device))
            if need
            else None
            for k, total, need in zip(mine, totals, ctx.needs_input_grad[2:], strict=True)
        ]
        return (None, None, *inputs)


def apply(plan: Node, own: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The differentiable entries as outputs of one node whose inputs are ``own``; a rank with none ties the node to a
    zero-element leaf, so its ``backward()`` issues the same collective."""
    leaf = None if own else torch.empty(0, device=plan.device, requires_grad=True)
    return list(_FusedGather.apply(plan, leaf, *own))  # type: ignore[no-untyped-call,unused-ignore]
