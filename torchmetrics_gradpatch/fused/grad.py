"""The fused sync's global gradient mode: one autograd node for all of a sync's states, one backward collective.

In global mode (see :mod:`torchmetrics_gradpatch._global` for the semantics) rank ``j``'s tensor ``x_j`` receives
``sum_r dL_r/dx_j``. The fused sync gathers every state in one buffer, so it builds one node for all of them: its
inputs are this rank's own tensors that require grad, its outputs every rank's gathered copies of the tensors
that required grad on their rank (the *differentiable entries*; every rank knows which from the exchanged
descriptions). Its backward packs, for each other rank, the gradients of that rank's entries into one byte buffer
(mixed dtypes, each piece aligned as in the forward payload) and issues **one** ``all_to_all_single``: each rank
receives exactly the gradients for its own tensors from every other rank, and adds its own.

As in :mod:`torchmetrics_gradpatch._global`, a rank whose own tensors have no graph ties the node to a fresh
zero-element leaf, so its loss still reaches the node and its ``backward()`` issues the same collective; every
rank must run ``backward()`` through the synced values when the node is built. The backward is not itself
differentiable (``once_differentiable``): double backward through a fused global sync raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from torchmetrics_gradpatch.fused.wire import ALIGN, as_bytes

__all__ = ["Entry", "Plan", "apply"]


@dataclass(frozen=True)
class Entry:
    """One differentiable entry: its owner rank, the gathered copy (a view of the receive buffer), whether the
    output must own its memory (it outlives the sync as list-state content)."""

    owner: int
    value: torch.Tensor
    copy: bool


@dataclass
class Plan:
    """What the node needs, fixed at the forward. ``entries`` are in owner-rank order, then in state order; each
    rank's entries in that order are exactly its own inputs' order."""

    entries: list[Entry]
    rank: int
    world_size: int
    group: Any  # None for the default group: a graph alive at exit must not hold the group object
    device: torch.device


@dataclass(frozen=True)
class _Shape:
    """What the backward needs of an entry: its owner, dtype and shape (never the gathered data: a graph that
    outlives the sync must not keep the receive buffers alive)."""

    owner: int
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()


def _offsets(items: Sequence[_Shape]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for item in items:
        offsets.append(at)
        at += -(-item.nbytes // ALIGN) * ALIGN
    return offsets, at


class _FusedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: Plan, leaf: torch.Tensor | None, *own: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.shapes = [_Shape(e.owner, e.value.dtype, e.value.shape) for e in plan.entries]
        ctx.rank, ctx.world_size, ctx.group, ctx.device = plan.rank, plan.world_size, plan.group, plan.device
        ctx.set_materialize_grads(False)  # an entry the loss does not use sends zeros without a gradient tensor
        return tuple(entry.value.clone() if entry.copy else entry.value for entry in plan.entries)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        rank, world_size = ctx.rank, ctx.world_size
        by_owner: list[list[tuple[_Shape, torch.Tensor | None]]] = [[] for _ in range(world_size)]
        for item, grad in zip(ctx.shapes, grads, strict=True):
            by_owner[item.owner].append((item, grad))
        mine = by_owner[rank]
        own_offsets, own_size = _offsets([item for item, _ in mine])
        totals: list[torch.Tensor | None] = [grad for _, grad in mine]  # this rank's own gradient first
        if world_size > 1:
            send_splits, pieces = [], []
            for owner, items in enumerate(by_owner):
                offsets, size = _offsets([item for item, _ in items])
                send_splits.append(0 if owner == rank else size)
                if owner != rank:
                    pieces.append((items, offsets, size))
            send = torch.empty(sum(send_splits), dtype=torch.uint8, device=ctx.device)
            at = 0
            for items, offsets, size in pieces:
                for (item, grad), offset in zip(items, offsets, strict=True):
                    target = send[at + offset : at + offset + item.nbytes]
                    if grad is None:
                        target.zero_()
                    else:
                        target.copy_(as_bytes(grad.to(item.dtype)))
                at += size
            receive_splits = [0 if owner == rank else own_size for owner in range(world_size)]
            received = torch.empty(sum(receive_splits), dtype=torch.uint8, device=ctx.device)
            dist.all_to_all_single(received, send, receive_splits, send_splits, group=ctx.group)
            for source in range(world_size - 1):  # every other rank's gradients for this rank's tensors
                base = source * own_size
                for k, ((item, _), offset) in enumerate(zip(mine, own_offsets, strict=True)):
                    piece = received[base + offset : base + offset + item.nbytes].view(item.dtype).view(item.shape)
                    total = totals[k]
                    totals[k] = piece.clone() if total is None else total + piece
        needs = ctx.needs_input_grad[2:]
        inputs = [
            (total if total is not None else torch.zeros(item.shape, dtype=item.dtype, device=ctx.device))
            if need
            else None
            for (item, _), total, need in zip(mine, totals, needs, strict=True)
        ]
        return (None, None, *inputs)


def apply(plan: Plan, own: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The differentiable entries as outputs of one node whose inputs are ``own`` (this rank's tensors that
    require grad, in the order of this rank's entries in ``plan``); a zero-element leaf stands in when none."""
    leaf = None if own else torch.empty(0, device=plan.device, requires_grad=True)
    return list(_FusedGather.apply(plan, leaf, *own))  # type: ignore[no-untyped-call,unused-ignore]
