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


class _FusedGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, entries: list[Entry], rank: int, world_size: int, group: Any, device: Any, leaf: Any, *own: Any
    ) -> tuple[torch.Tensor, ...]:
        # owners, dtypes and shapes only: a graph that outlives the sync must not keep the receive buffers alive
        ctx.owners = [e.owner for e in entries]
        ctx.dtypes = [e.value.dtype for e in entries]
        ctx.shapes = [e.value.shape for e in entries]
        ctx.rank, ctx.world_size, ctx.group, ctx.device = rank, world_size, group, device
        ctx.set_materialize_grads(False)  # an entry the loss does not use sends zeros without a gradient tensor
        return tuple(entry.value.clone() if entry.copy else entry.value for entry in entries)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        totals = scatter_sum(ctx.owners, ctx.dtypes, ctx.shapes, grads, ctx.rank, ctx.world_size, ctx.group, ctx.device)
        mine = [k for k, owner in enumerate(ctx.owners) if owner == ctx.rank]
        inputs = [
            (total if total is not None else torch.zeros(ctx.shapes[k], dtype=ctx.dtypes[k], device=ctx.device))
            if need
            else None
            for k, total, need in zip(mine, totals, ctx.needs_input_grad[6:], strict=True)
        ]
        return (None, None, None, None, None, None, *inputs)


def apply(
    entries: list[Entry], own: Sequence[torch.Tensor], rank: int, world_size: int, group: Any, device: torch.device
) -> list[torch.Tensor]:
    """The differentiable ``entries`` (in owner-rank order, then state order) as outputs of one node whose inputs are
    ``own`` (in the same order); a rank with none ties the node to a zero-element leaf, so its ``backward()`` issues
    the same collective. ``group``: ``None`` for the default group (a graph alive at exit must not hold it)."""
    leaf = None if own else torch.empty(0, device=device, requires_grad=True)
    outputs = _FusedGather.apply(entries, rank, world_size, group, device, leaf, *own)  # type: ignore[no-untyped-call,unused-ignore]
    return list(outputs)
