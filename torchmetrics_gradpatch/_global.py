"""Global mode's gather: local mode's values, and a backward that gives each rank every rank's gradient for its
tensor, in one ``all_to_all_single``.

Contract: every rank decides from the same fixed-size headers, so every rank takes the same branch: the data step,
or the same error on every rank after the same exchange, none left waiting. Rules for users:
docs/gradient-modes.md; the header, the collectives and why: docs/design.md ("Global mode's exchange").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch._errors import GradModeMismatchError
from torchmetrics_gradpatch._gather import RAISED_ALIKE, exchange, gather_entries, gather_local, size_and_rank

_REQUIRES_GRAD = 1  # flag bits each rank sends in its header
_GRAD_MODE = 2
_NOT_INLINE = 4  # this rank's scalar could not be read as bytes: every rank gathers the scalars as data instead

# The header: int64 words, the same number on every rank whatever its tensor, so no exchange can mismatch.
_STATUS, _FLAGS, _DTYPE, _NDIM, _BODY = range(5)
_INLINE_DIMS = 6  # the body holds a shape of up to this many dims, or a scalar's bytes (up to 48)
_HEADER_WORDS = _BODY + _INLINE_DIMS
_OK, _CONJUGATE = 0, 1  # status codes
_CAUSES = {_CONJUGATE: "the tensor has the conjugate bit set; call .resolve_conj() on it before gathering"}


def _fresh(entry: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``entry`` as an output that autograd lets the caller modify in place (see docs/design.md, global mode).

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


def scatter_sum(
    owners: Sequence[int],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[torch.Size],
    grads: Sequence[torch.Tensor | None],
    rank: int,
    world_size: int,
    group: Any,
    device: torch.device,
) -> list[torch.Tensor | None]:
    """Global mode's backward data step: for each entry this rank owns, every rank's gradient for it, summed here.

    Entry ``k`` is owned by rank ``owners[k]`` and has ``dtypes[k]`` and ``shapes[k]``; ``grads[k]`` is this rank's
    gradient for it (``None``: zeros). One ``all_to_all_single`` of bytes: rank ``r`` sends rank ``j`` its
    gradients for ``j``'s entries, packed as :mod:`torchmetrics_gradpatch._bytes` aligns them; its gradients for its
    own entries stay home and are added locally. Returns the sums for this rank's entries, in their order (``None``
    only in a world of one, where nothing is exchanged and no gradient arrived).
    """
    mine = [k for k, owner in enumerate(owners) if owner == rank]
    if world_size == 1:  # nothing to exchange, so no collective (and no gloo work to free)
        return [grads[k] for k in mine]
    sizes = [_bytes.nbytes(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]

    def block(keys: list[int]) -> tuple[list[int], int]:
        # one entry: its own bytes, so a block of them repeats at multiples of its item size; more: aligned
        found, end = _bytes.offsets(sizes[k] for k in keys)
        return found, end if len(keys) <= 1 else _bytes.aligned(end)

    own_offsets, own_size = block(mine)
    send_splits, placed, at = [], [], 0
    for owner in range(world_size):
        keys = [k for k in range(len(owners)) if owners[k] == owner] if owner != rank else []
        found, size = block(keys)
        send_splits.append(size)
        placed += [(k, at + offset) for k, offset in zip(keys, found, strict=True)]
        at += size
    first = grads[placed[0][0]] if len(placed) == 1 else None
    if first is not None and sizes[placed[0][0]] == at:  # one entry to send (two ranks): its own bytes, no copy
        send = _bytes.as_bytes(first.to(dtypes[placed[0][0]]))
    else:
        send = (torch.zeros if at > sum(sizes[k] for k, _ in placed) else torch.empty)(
            at, dtype=torch.uint8, device=device
        )  # padding is zeros, not this process's memory
        for k, offset in placed:
            target = send[offset : offset + sizes[k]]
            grad = grads[k]
            if grad is None:
                target.zero_()
            else:
                target.copy_(_bytes.as_bytes(grad.to(dtypes[k])))
    sources = world_size - 1
    received = torch.empty(sources * own_size, dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        received, send, [0 if j == rank else own_size for j in range(world_size)], send_splits, group
    )
    totals: list[torch.Tensor | None] = []
    for k, offset in zip(mine, own_offsets, strict=True):
        if not sizes[k]:  # nothing arrived (and an empty view cannot be reinterpreted as a dtype)
            total = torch.zeros(shapes[k], dtype=dtypes[k], device=device)
        elif sources == 1:
            total = received[offset : offset + sizes[k]].view(dtypes[k]).view(shapes[k])
        else:  # one row per other rank, summed
            rows = received.view(sources, own_size)[:, offset : offset + sizes[k]].view(dtypes[k])
            total = rows.sum(dim=0).view(shapes[k])
        # ``received`` and the sum are this function's own buffers: add the own gradient into them in place
        own = grads[k]
        if own is not None:
            total.add_(own)
        totals.append(total)
    return totals


def _scatter_sum(meta: dict[str, Any], grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """:func:`scatter_sum` for one gather, whose entry ``j`` is rank ``j``'s (``None``: no input gradient)."""
    shapes: list[torch.Size] = meta["shapes"]
    world_size = len(shapes)
    (total,) = scatter_sum(
        range(world_size),
        [meta["dtype"]] * world_size,
        shapes,
        grads,
        meta["rank"],
        world_size,
        meta["group"],
        meta["device"],
    )
    if not meta["needs_grad"]:  # this rank's tensor had no graph: it only had to take part
        return None
    return torch.zeros(shapes[meta["rank"]], dtype=meta["dtype"], device=meta["device"]) if total is None else total


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


def _own_header(result: torch.Tensor, flags: int) -> torch.Tensor:
    """This rank's header. Nothing here raises on a tensor: what stops this rank is sent as its status."""
    shape = result.shape
    words = [_OK, flags, _bytes.code(result.dtype), len(shape), *shape[:_INLINE_DIMS]]
    words += [0] * (_HEADER_WORDS - len(words))
    header = torch.tensor(words, dtype=torch.int64, device=result.device)
    if result.is_conj():  # gloo's all_gather refuses it (view_as_real), and it has no bytes of its own to send
        header[_STATUS] = _CONJUGATE
    elif not shape:
        try:  # a scalar travels in the header as its own bytes; the negative bit is applied first
            data = (result.resolve_neg() if result.is_neg() else result).reshape(1).view(torch.uint8)
            header.view(torch.uint8)[_BODY * 8 : _BODY * 8 + data.numel()].copy_(data)
        except Exception:  # a tensor subclass, say: it travels as data, as in the unpatched gather
            header[_FLAGS] |= _NOT_INLINE
    return header


def _refusal(rows: list[list[int]]) -> RuntimeError | None:
    """The error every rank raises when the headers say the data step cannot run (``None``: it can)."""
    first = rows[0]
    if all(row[_STATUS] == _OK and row[_DTYPE] == first[_DTYPE] and row[_NDIM] == first[_NDIM] for row in rows):
        return None
    stopped = [r for r, row in enumerate(rows) if row[_STATUS] != _OK]
    if stopped:
        causes = "; ".join(
            f"rank(s) {ranks}: {why}"
            for status, why in _CAUSES.items()
            if (ranks := [r for r in stopped if rows[r][_STATUS] == status])
        )
        return RuntimeError(
            f"torchmetrics_gradpatch: global-mode gather: rank(s) {stopped} cannot take part ({causes}). {RAISED_ALIKE}"
        )
    dtypes = [row[_DTYPE] for row in rows]
    if dtypes.count(dtypes[0]) != len(dtypes):
        each = ", ".join(f"rank {r}: {_bytes.dtype_name(code)}" for r, code in enumerate(dtypes))
        return RuntimeError(
            f"torchmetrics_gradpatch: global-mode gather: the ranks disagree on the dtype of the gathered tensor "
            f"({each}, ranks within the gather's group). Every rank must gather a tensor of the same dtype. "
            f"{RAISED_ALIKE}"
        )
    ndims = [row[_NDIM] for row in rows]
    if ndims.count(ndims[0]) != len(ndims):
        each = ", ".join(
            f"rank {r}: {n}" + (f" (shape {row[_BODY : _BODY + n]})" if n <= _INLINE_DIMS else "")
            for r, (n, row) in enumerate(zip(ndims, rows, strict=True))
        )
        return RuntimeError(
            f"torchmetrics_gradpatch: global-mode gather: the ranks disagree on the number of dimensions of the "
            f"gathered tensor ({each}, ranks within the gather's group). Every rank must gather a tensor with the "
            f"same number of dimensions; each dimension's size may differ. {RAISED_ALIKE}"
        )
    return None


def grad_mode_error(what: str, verb: str, grad: Sequence[bool], requiring: Sequence[int]) -> GradModeMismatchError:
    """The error every rank raises when, in global mode, the ranks' grad modes (``grad``, by group rank) differ while
    the ranks ``requiring`` hold a tensor that requires grad. ``what`` names the operation ("global-mode gather"),
    ``verb`` is its past tense ("gathered")."""
    off = [r for r, g in enumerate(grad) if not g]
    on = [r for r, g in enumerate(grad) if g]
    return GradModeMismatchError(
        f"torchmetrics_gradpatch: {what}: the ranks disagree on grad mode. Rank(s) {off} {verb} with grad mode off "
        f"(torch.no_grad() or inference mode), rank(s) {on} with it on (ranks within the group), and rank(s) "
        f"{list(requiring)} hold a tensor that requires grad. The backward of global mode is a collective, so either "
        "every rank or no rank must build it: run the metric's forward, compute or sync with the same grad mode on "
        f"every rank, e.g. the same torch.no_grad() block everywhere. {RAISED_ALIKE}"
    )


def gather_global(result: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
    """The global-mode gather: local-mode values, and a backward that sums every rank's gradient per entry.

    Raises the same ``RuntimeError`` on every rank when a rank cannot take part or the ranks disagree on dtype or
    number of dimensions, and :class:`GradModeMismatchError` on every rank when they disagree on grad mode while
    some tensor requires grad; each right after the header exchange, before any data moves.
    """
    # Same first steps as the local gather, so errors (an uninitialised group, a non-tensor) are the same.
    result = result.contiguous()
    resolved = dist.group.WORLD if group is None else group
    world_size, rank = size_and_rank(resolved)
    if rank < 0:  # not a member of ``group``: no exchange takes place, so nothing global to build
        return gather_local(result, group)
    flags = (_REQUIRES_GRAD if result.requires_grad else 0) | (_GRAD_MODE if torch.is_grad_enabled() else 0)
    with torch.no_grad():
        received = exchange(_own_header(result, flags), resolved, world_size)
    rows: list[list[int]] = received.tolist()
    refusal = _refusal(rows)  # every rank reads the same rows, so every rank takes the same branch from here
    if refusal is not None:
        raise refusal
    all_flags = [row[_FLAGS] for row in rows]
    requiring = [r for r, f in enumerate(all_flags) if f & _REQUIRES_GRAD]
    grad = [bool(f & _GRAD_MODE) for f in all_flags]
    if requiring and len(set(grad)) > 1:
        raise grad_mode_error("global-mode gather", "gathered", grad, requiring)
    ndim = result.ndim
    if ndim == 0 and not any(f & _NOT_INLINE for f in all_flags):
        body = received.view(torch.uint8)[:, _BODY * 8 : _BODY * 8 + result.element_size()]
        entries = list(body.view(result.dtype)[:, 0].unbind())  # each rank's value, 0-d
        entries[rank] = result
    else:
        if ndim <= _INLINE_DIMS:  # a scalar's shape, [], included
            shapes = [row[_BODY : _BODY + ndim] for row in rows]
        else:  # every rank has this many dims (the headers agree), so every rank takes this exchange too
            with torch.no_grad():
                shape = torch.tensor(result.shape, dtype=torch.int64, device=result.device)
                shapes = exchange(shape, resolved, world_size).tolist()
        # every rank knows every shape and the dtypes agree: the data all_gather writes every element of every buffer
        entries = gather_entries(result, shapes, resolved, rank, torch.empty_like)
    if not (requiring and all(grad)):
        return entries
    leaf = (
        None if result.requires_grad else torch.empty(0, dtype=result.dtype, device=result.device, requires_grad=True)
    )
    return list(_GlobalGather.apply(result, leaf, entries, group, rank))  # type: ignore[no-untyped-call,unused-ignore]
