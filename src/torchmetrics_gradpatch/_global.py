"""The "global" gradient mode: a gather whose backward gives each rank every rank's gradient for its tensor.

Semantics
---------
In local mode (upstream 1.6) rank ``j``'s tensor ``x_j`` receives only ``dL_j/dx_j``, the gradient of its own
loss. In global mode it receives ``sum_r dL_r/dx_j``: the gradient of *every* rank's loss with respect to
``x_j``, summed. When every rank computes the same synced loss ``L`` (a Metric used as a loss), that is
``W * dL/dx_j``, and once DDP averages parameter gradients over the ``W`` ranks the model receives exactly the
single-process gradient of ``L`` (local mode gives ``1/W`` of it). When ranks compute different losses from
the gathered values (contrastive losses), the model receives the gradient of the mean of the ranks' losses,
cross-rank terms included (local mode drops them).

Forward: the exchange that also decides
---------------------------------------
The forward does not call the local-mode gather (it shares only its data step): every rank of the group must be
in global mode anyway (the backward is a collective), so the unpatched gather's ``barrier`` buys nothing here and
is dropped. Each rank contributes, besides its tensor, two flags: *its tensor requires grad* and *grad mode is on*.

* Non-scalar: one ``all_gather`` of ``[*shape, flags]`` (int64, ``ndim + 1`` entries per rank), then one
  ``all_gather`` of the data, padded to the largest shape when the shapes differ: the local gather's own data step
  (:func:`~torchmetrics_gradpatch._gather.gather_entries`). Two collectives.
* Scalar: one ``all_gather`` of the scalar's bytes with the flags byte appended (``uint8``). One collective.

Every rank then holds every rank's flags and reaches the same decision, with no further collective:

* no rank's tensor requires grad, or every rank gathers with grad mode off: plain values, no node, nothing to
  wait for in backward;
* some rank's tensor requires grad and every rank has grad mode on: **every** rank builds the node, also a rank
  whose own tensor does not require grad (torchmetrics' empty ``cat`` state is a grad-less
  ``torch.tensor([])``). Such a rank ties the node to a fresh zero-element leaf, so its outputs, and the loss
  built from them, have a graph and its ``backward()`` issues the same collective as everyone else's;
* grad mode differs across ranks while some tensor requires grad: every rank raises the same ``RuntimeError``
  naming the ranks on each side, right after the exchange, before any rank could wait for another.

Values are bit-identical to local mode: the data travel in the same dtype (or as their own bytes), the padding is
trimmed the same way, and the caller's own tensor is its own entry.

Backward: one ``all_to_all_single``
-----------------------------------
Rank ``r`` holds ``dL_r/d(entry j)`` for every ``j``; rank ``j`` needs their sum: a reduce-scatter with uneven
(possibly empty) pieces. Candidates, each a single collective:

* ``reduce_scatter``: gloo has none on torch 2.0.1 ("ProcessGroupGloo does not support reduce_scatter");
  torch 2.13's gloo has one, but it was the slowest option measured there, and it wants equal pieces.
* ``all_to_all`` (the list form used by ``torch.distributed.nn.functional.all_gather``): gloo on torch 2.0.1
  refuses it ("Backend gloo does not support alltoall"), so it is out.
* ``all_reduce`` of the gradients padded to the largest shape and stacked (``W * max`` elements), each rank
  keeping its own row: works everywhere, but moves every row to every rank.
* ``all_to_all_single`` with per-rank split sizes (gloo's ``alltoallv``): works on torch 2.0.1 and 2.13 with
  uneven and zero-sized splits; every rank sends each piece only to its owner, no padding, then sums the
  ``W`` pieces it received.

Measured on this project's machine (2 cores, gloo on loopback, medians of 15 interleaved runs, the collective
alone, float32; ms for all_to_all_single / all_reduce of the stacked gradients / reduce_scatter_tensor):

====================  ===================  ===================  ====================
elements per rank     torch 2.13, 2 ranks  torch 2.13, 3 ranks  torch 2.0.1, 3 ranks
====================  ===================  ===================  ====================
1                     0.39 / 0.35 / 0.41   0.57 / 2.1 / 2.3     0.52 / 0.84 / --
1,000                 0.42 / 0.40 / 0.55   0.75 / 1.0 / 2.8     0.52 / 1.4 / --
65,536                0.71 / 1.2 / 2.9     1.7 / 4.0 / 3.3      1.3 / 3.3 / --
1,000,000             8.8 / 9.7 / 13.6     17.7 / 22.9 / 24.7   23.3 / 25.8 / --
====================  ===================  ===================  ====================

``all_to_all_single`` is the fastest or within noise of it everywhere and available on every supported torch,
so the backward uses it: one collective per gather, whatever the shapes. Each rank's gradient for its own
entry stays home (split size 0) and is added locally; on two ranks the single outgoing gradient is sent as
is, without first being copied into a send buffer.

Entries, in place, and double backward
--------------------------------------
Like ``torch.distributed.nn.functional.all_gather``'s, the entries may be changed in place on every rank
(``g[j].mul_(2)`` for any ``j``, equal or uneven shapes) and the gradients stay exact: every entry is an output of
the node that owns its memory, never a view (autograd refuses in-place changes to a custom Function's views, which
once made ``g[rank].mul_(2)`` fail on one rank only). The caller's own entry is therefore a copy of its tensor (not
the tensor itself, as in local mode); trimmed entries of uneven shapes are their receive buffers shrunk in place
when only the first dimension differs, else copies.

The backward is differentiable: under ``create_graph=True`` it is a node of its own (:class:`_ScatterSum`) whose
backward is a gather of the incoming gradients, so second-order gradients are exact (the same as torch's
equal-shape ``all_gather``). That double backward is a collective too: every rank must run it, and every rank's
tensor must require grad (a rank whose tensor has no graph takes part in the first backward only).

Rules
-----
* Every rank of the group must gather in global mode: the forward issues other collectives than local mode
  (and than the unpatched gather), so a rank in local mode and one in global mode mismatch their collectives
  (gloo then fails or waits until its timeout, as with any mismatched collectives).
* When the node is built, every rank must run ``backward()`` through the gathered values, as with any
  collective: a rank that does not reach this node leaves the others waiting in the ``all_to_all_single``.
  Call ``loss.backward()``, not ``torch.autograd.grad(loss, params)``: on a rank whose own tensor had no graph
  the node is reached only through its leaf, which ``autograd.grad`` of other inputs skips. Several gathers
  (several metric states) are safe: autograd runs their backward nodes in reverse creation order, the same on
  every rank because the forward gathers were issued in the same order.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from torchmetrics_gradpatch._gather import gather_entries, size_and_rank
from torchmetrics_gradpatch._modes import GradModeMismatchError  # defined where importing it needs no torch

__all__ = ["GradModeMismatchError", "gather_global"]

_REQUIRES_GRAD = 1  # flag bits each rank sends with its shape
_GRAD_MODE = 2


def _fresh(entry: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``entry`` as an output that autograd lets the caller modify in place (see "Entries" in the docstring).

    The caller's own tensor is copied. A trimmed entry that is the leading part of its receive buffer (the shapes
    differ in the first dimension only, the usual ``cat`` state) becomes that buffer, shrunk in place: no copy.
    """
    if entry is result:
        return entry.clone()
    base = entry._base
    if base is None:
        return entry
    if (
        base.dtype == entry.dtype
        and base.is_contiguous()
        and entry.is_contiguous()
        and entry.storage_offset() == base.storage_offset() == 0
    ):
        return base.resize_(entry.shape)
    return entry.clone()


def _scatter_sum(meta: dict[str, Any], grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """The backward's data step: every rank's gradient for entry ``j`` summed on rank ``j`` (``None``: no input grad).

    One ``all_to_all_single``: rank ``r`` sends its gradient for entry ``j`` to rank ``j`` only; its own piece
    stays home (split size 0) and is added locally.
    """
    shapes: list[torch.Size] = meta["shapes"]
    rank: int = meta["rank"]
    dtype, device = meta["dtype"], meta["device"]
    own = grads[rank]
    if len(shapes) == 1:  # a world of one: nothing to exchange, so no collective (and no gloo work to free)
        if not meta["needs_grad"]:
            return None
        return torch.zeros(shapes[rank], dtype=dtype, device=device) if own is None else own
    numels = [math.prod(shape) for shape in shapes]
    mine = numels[rank]
    send_splits = [0 if j == rank else n for j, n in enumerate(numels)]
    receive_splits = [0 if j == rank else mine for j in range(len(shapes))]
    pieces = [
        (grad, shape, n)
        for j, (grad, shape, n) in enumerate(zip(grads, shapes, numels, strict=True))
        if j != rank and n
    ]
    if len(pieces) == 1 and pieces[0][0] is not None:  # two ranks: send the gradient itself, no copy
        send = pieces[0][0].reshape(-1).to(dtype)
    else:
        send = torch.empty(sum(send_splits), dtype=dtype, device=device)
        offset = 0
        for grad, shape, numel in pieces:
            piece = send[offset : offset + numel]
            if grad is None:
                piece.zero_()
            else:
                piece.view(shape).copy_(grad)
            offset += numel
    received = torch.empty(sum(receive_splits), dtype=dtype, device=device)
    dist.all_to_all_single(received, send.contiguous(), receive_splits, send_splits, group=meta["group"])
    if not meta["needs_grad"]:  # this rank's tensor had no graph: it only had to take part
        return None
    # ``received`` and the sum are this function's own buffers: add the own gradient into them in place
    others = received if len(shapes) == 2 else received.view(len(shapes) - 1, mine).sum(dim=0)
    total = others.view(shapes[rank])
    if own is not None:
        total.add_(own)
    return total


class _GlobalGather(torch.autograd.Function):
    """Outputs: the gathered entries. Backward: ``all_to_all_single`` of the gradients, summed per owner."""

    @staticmethod
    def forward(
        ctx: Any,
        result: torch.Tensor,
        leaf: torch.Tensor | None,
        entries: list[torch.Tensor],
        group: Any,
        rank: int,
    ) -> tuple[torch.Tensor, ...]:
        # ``None`` (the default group) is kept as ``None``, not resolved to the group object: a graph still alive
        # when the program ends must not hold the default process group past destroy_process_group(), or torch
        # may abort at exit ("terminate called without an active exception"; seen on torch 2.13-2.15).
        ctx.group = group
        ctx.meta = {
            "rank": rank,
            "shapes": [entry.shape for entry in entries],
            "dtype": result.dtype,
            "device": result.device,
        }
        ctx.set_materialize_grads(False)  # an entry the loss does not use sends zeros without allocating twice
        return tuple(_fresh(entry, result) for entry in entries)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None, None]:
        meta = {**ctx.meta, "group": ctx.group, "needs_grad": ctx.needs_input_grad[0]}
        if meta["needs_grad"] and torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
            # create_graph=True: the sum is itself differentiable (its backward is a gather), for double backward
            return _ScatterSum.apply(meta, *grads), None, None, None, None  # type: ignore[no-untyped-call,unused-ignore]
        return _scatter_sum(meta, grads), None, None, None, None


class _ScatterSum(torch.autograd.Function):
    """The global gather's backward as a node of its own, built under ``create_graph=True``.

    It is linear in the incoming gradients: rank ``j``'s output is ``sum_r g_r[j]``. Its backward, given ``h_j``
    on every rank ``j``, gives every rank ``r`` the gradient ``h_j`` for its ``g_r[j]``: a gather of ``h``.
    """

    @staticmethod
    def forward(ctx: Any, meta: dict[str, Any], *grads: torch.Tensor | None) -> torch.Tensor | None:
        ctx.meta = meta
        ctx.set_materialize_grads(False)
        return _scatter_sum(meta, grads)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        meta = ctx.meta
        rank: int = meta["rank"]
        shapes: list[torch.Size] = meta["shapes"]
        if grad is None:
            grad = torch.zeros(shapes[rank], dtype=meta["dtype"], device=meta["device"])
        group = dist.group.WORLD if meta["group"] is None else meta["group"]
        entries = (
            [grad]
            if len(shapes) == 1
            else gather_entries(grad.contiguous(), [list(s) for s in shapes], group, rank, torch.empty_like)
        )
        return (None, *entries)


def _exchange_scalar(
    result: torch.Tensor, flags: int, group: Any, world_size: int
) -> tuple[list[torch.Tensor], list[int]]:
    """One ``all_gather`` of the scalar's bytes plus a flags byte: every rank's value (bit for bit) and flags."""
    data = result.reshape(1).view(torch.uint8)
    packed = torch.empty(data.numel() + 1, dtype=torch.uint8, device=result.device)
    packed[:-1] = data
    packed[-1] = flags
    received = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(received, packed, group)
    values = [buffer[:-1].view(result.dtype).view(()) for buffer in received]
    return values, torch.stack(received)[:, -1].tolist()


def _exchange_shapes(
    result: torch.Tensor, flags: int, group: Any, world_size: int
) -> tuple[list[list[int]], list[int]]:
    """One ``all_gather`` of ``[*shape, flags]``: every rank's shape and flags."""
    header = torch.tensor([*result.shape, flags], dtype=torch.int64, device=result.device)
    received = [torch.empty_like(header) for _ in range(world_size)]
    dist.all_gather(received, header, group)
    rows: list[list[int]] = torch.stack(received).tolist()
    return [row[:-1] for row in rows], [row[-1] for row in rows]


def _mismatch(flags: list[int]) -> GradModeMismatchError:
    off = [r for r, f in enumerate(flags) if not f & _GRAD_MODE]
    on = [r for r, f in enumerate(flags) if f & _GRAD_MODE]
    requiring = [r for r, f in enumerate(flags) if f & _REQUIRES_GRAD]
    return GradModeMismatchError(
        "torchmetrics_gradpatch: global-mode gather: the ranks disagree on grad mode. "
        f"Rank(s) {off} gathered with grad mode off (torch.no_grad() or inference mode), rank(s) {on} with it on "
        f"(ranks within the gather's group), and the tensor of rank(s) {requiring} requires grad. The backward of "
        "a global-mode gather is a collective, so either every rank or no rank must build it: gather (run the "
        "metric's forward/compute) with the same grad mode on every rank, e.g. the same torch.no_grad() block "
        "everywhere. Every rank of the group raised this error after the same exchange; none is left waiting."
    )


def gather_global(result: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
    """The global-mode gather: local-mode values, and a backward that sums every rank's gradient per entry.

    See the module docstring for the exchange, the agreement rule and the rule that every rank must run backward.
    """
    # Same first steps as the local gather, so errors (an uninitialised group, a non-tensor) are the same.
    result = result.contiguous()
    resolved = dist.group.WORLD if group is None else group
    world_size, rank = size_and_rank(resolved)
    grad_mode = torch.is_grad_enabled()
    flags = (_REQUIRES_GRAD if result.requires_grad else 0) | (_GRAD_MODE if grad_mode else 0)
    with torch.no_grad():
        if result.ndim == 0:
            entries, all_flags = _exchange_scalar(result, flags, resolved, world_size)
            entries[rank] = result
            shapes = None
        else:
            shapes, all_flags = _exchange_shapes(result, flags, resolved, world_size)
    # Every rank decides from the same flags, so every rank takes the same branch (and raises, or not, together).
    any_requires_grad = any(f & _REQUIRES_GRAD for f in all_flags)
    grad_modes = {bool(f & _GRAD_MODE) for f in all_flags}
    if any_requires_grad and len(grad_modes) > 1:
        raise _mismatch(all_flags)
    if shapes is not None:
        # the local gather's data step (same padding and trimming), into uninitialised buffers
        entries = gather_entries(result, shapes, resolved, rank, torch.empty_like)
    if not (any_requires_grad and grad_modes == {True}):
        return entries
    leaf = (
        None if result.requires_grad else torch.empty(0, dtype=result.dtype, device=result.device, requires_grad=True)
    )
    return list(_GlobalGather.apply(result, leaf, entries, group, rank))  # type: ignore[no-untyped-call,unused-ignore]
