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

from torchmetrics_gradpatch._fused_pack import ALIGN, as_bytes

__all__ = ["Entry", "Plan", "apply"]


@dataclass(frozen=True)
class Entry:
    """One differentiable entry: its owner rank, the gathered copy (a view of the receive buffer), whether the
    output must own its memory (it outlives the sync as list-state content), and its dtype and shape."""

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


def _offsets(values: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for value in values:
        offsets.append(at)
        at += -(-value.numel() * value.element_size() // ALIGN) * ALIGN
    return offsets, at


class _FusedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: Plan, leaf: torch.Tensor | None, *own: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # an entry the loss does not use sends zeros without a gradient tensor
        return tuple(entry.value.clone() if entry.copy else entry.value for entry in plan.entries)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: Plan = ctx.plan
        by_owner: list[list[tuple[Entry, torch.Tensor | None]]] = [[] for _ in range(plan.world_size)]
        for entry, grad in zip(plan.entries, grads, strict=True):
            by_owner[entry.owner].append((entry, grad))
        mine = by_owner[plan.rank]
        own_offsets, own_size = _offsets([entry.value for entry, _ in mine])
        totals: list[torch.Tensor | None] = [grad for _, grad in mine]  # this rank's own gradient first
        if plan.world_size > 1:
            send_splits, pieces = [], []
            for owner, items in enumerate(by_owner):
                offsets, size = _offsets([entry.value for entry, _ in items])
                send_splits.append(0 if owner == plan.rank else size)
                if owner != plan.rank:
                    pieces.append((items, offsets, size))
            send = torch.empty(sum(send_splits), dtype=torch.uint8, device=plan.device)
            at = 0
            for items, offsets, size in pieces:
                for (entry, grad), offset in zip(items, offsets, strict=True):
                    target = send[at + offset : at + offset + entry.value.numel() * entry.value.element_size()]
                    if grad is None:
                        target.zero_()
                    else:
                        target.copy_(as_bytes(grad.to(entry.value.dtype)))
                at += size
            receive_splits = [0 if owner == plan.rank else own_size for owner in range(plan.world_size)]
            received = torch.empty(sum(receive_splits), dtype=torch.uint8, device=plan.device)
            dist.all_to_all_single(received, send, receive_splits, send_splits, group=plan.group)
            for source in range(plan.world_size - 1):  # every other rank's gradients for this rank's tensors
                base = source * own_size
                for k, ((entry, _), offset) in enumerate(zip(mine, own_offsets, strict=True)):
                    nbytes = entry.value.numel() * entry.value.element_size()
                    piece = received[base + offset : base + offset + nbytes].view(entry.value.dtype)
                    piece = piece.view(entry.value.shape)
                    total = totals[k]
                    totals[k] = piece.clone() if total is None else total + piece
        needs = ctx.needs_input_grad[2:]
        inputs = [
            (total if total is not None else torch.zeros_like(entry.value)) if need else None
            for (entry, _), total, need in zip(mine, totals, needs, strict=True)
        ]
        return (None, None, *inputs)


def apply(plan: Plan, own: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The differentiable entries as outputs of one node whose inputs are ``own`` (this rank's tensors that
    require grad, in the order of this rank's entries in ``plan``); a zero-element leaf stands in when none."""
    leaf = None if own else torch.empty(0, device=plan.device, requires_grad=True)
    return list(_FusedGather.apply(plan, leaf, *own))  # type: ignore[no-untyped-call,unused-ignore]
