"""Large ``cat`` states: where this rank's add up to :data:`LARGE_MIN_BYTES` they cross apart from the payload, in
one ``all_reduce`` of one zeroed buffer in which every rank writes its own region (a slot that is one ``cat`` state
on every rank: the concatenation itself), straight into the tensors the sync returns. ``sync()``'s copies of the
local states are freed before the buffer is made and made again from it, so that a sync's peak holds the gathered
states about once (docs/performance.md, "Memory").
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch.fused import internals, wire

#: Where this rank's ``cat`` states' tensors add up to at least this many bytes, they cross apart from the payload.
LARGE_MIN_BYTES = 1 << 20

#: Called with every buffer this module allocates (tests count the bytes a sync allocates beyond its result).
on_buffer: Callable[[torch.Tensor], None] | None = None

_DEFERRED = torch.empty(0)  # a deferred state's stand-in tensor, until it is joined or sent apart


def defer(value: list[Any], stream_cpu: bool) -> tuple[list[torch.Tensor], wire.State] | None:
    """Step 1 for a ``cat`` list of several tensors (or one conjugate or negative view), deferred: a stand-in and the
    description of the one tensor ``dim_zero_cat`` would make (``None``: they do not join as plain bytes). Sent apart,
    each tensor is written into the buffer in turn, never joined on this rank; else the exchange joins them."""
    first = value[0]
    if not all(isinstance(t, torch.Tensor) for t in value) or not _bytes.plain(first.dtype):
        return None
    if (stream_cpu and first.device.type == "cpu") or any(
        t.requires_grad or (t.dtype, t.device, t.layout) != (first.dtype, first.device, torch.strided) for t in value
    ):
        return None
    if all(t.ndim == 0 for t in value):
        shape: tuple[int, ...] = (len(value),)
    elif all(t.ndim >= 1 and t.shape[1:] == first.shape[1:] for t in value) and first.shape != (0,):
        shape = (sum(t.shape[0] for t in value), *first.shape[1:])
    else:
        return None
    return [_DEFERRED], wire.State(wire.KIND_LIST, (wire.Piece(first.dtype, shape, False),))


def chosen(slots: Sequence[Any]) -> list[int]:
    """The slots whose tensors this rank sends apart: its ``cat`` states of one plain piece, where together they
    reach :data:`LARGE_MIN_BYTES`."""
    picked = []
    for s, slot in enumerate(slots):
        described = slot.described
        if slot.is_cat and described.kind == wire.KIND_LIST and len(described.pieces) == 1:
            piece = described.pieces[0]  # its nbytes is 0 where its dtype is unknown
            if not (described.placeholder or piece.requires_grad or piece.streamed) and piece.nbytes > 0:
                picked.append(s)
    return picked if sum(slots[s].described.pieces[0].nbytes for s in picked) >= LARGE_MIN_BYTES else []


def deferred(slot: Any) -> bool:
    """Whether ``slot``'s step 1 is deferred (:func:`defer`): its tensors are joined, or written one by one, later."""
    return bool(slot.tensors) and slot.tensors[0] is _DEFERRED


def release_cache(metric: Any, attrs: Iterable[str]) -> list[str]:
    """The ``cat`` states ``attrs`` (sent apart) whose copies ``sync()`` has just cached are freed before the buffer is
    made, this rank's own tensors in their place (:func:`recopy` copies again): returns them."""
    cache = internals.sync_cache(metric)
    if cache is None or internals.flag(metric, "is_synced"):  # not the fresh cache sync() has just made
        return []
    released = []
    for attr in attrs:
        current, cached = getattr(metric, attr), cache.get(attr)
        if not isinstance(cached, list) or cached is current:  # before 1.4 sync() caches the state itself
            continue
        if len(current) == len(cached) and all(  # current: a list of tensors (the exchange sent it apart)
            isinstance(c, torch.Tensor) and (c.shape, c.dtype, c.device) == (t.shape, t.dtype, t.device)
            for c, t in zip(cached, current, strict=True)
        ):
            cache[attr] = [t.detach() for t in current]
            released.append(attr)
    if released:
        del cached
        _return_freed_memory()
    return released


def _return_freed_memory() -> None:
    """Give the heap pages of freed memory back to the OS (glibc's ``malloc_trim(0)``, about 2 ms after 4,000 copies):
    copies of many small tensors leave their pages resident once freed, and the buffer made next would add to them."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: glibc's where it is the C library
    except (OSError, AttributeError):  # musl has none
        return None
    trim.argtypes = [ctypes.c_size_t]
    return cast(Callable[[int], int], trim)


def recopy(metric: Any, parts: Mapping[str, torch.Tensor | None]) -> None:
    """Make ``sync()``'s cached ``cat`` states ``parts`` copies again where :func:`release_cache` or :func:`uncopied`
    left this rank's own tensors there (``unsync()`` restores copies), from ``parts[attr]``: this rank's tensors as the
    buffer holds them, read once the cached tensors are dropped, so that the peak never holds the local states twice."""
    cache = internals.sync_cache(metric)
    if cache is None:
        return
    planned = []
    for attr, own in parts.items():
        cached = cache.get(attr)
        if not isinstance(cached, list) or not all(isinstance(c, torch.Tensor) for c in cached):
            continue
        flat = own.reshape(-1) if own is not None and own.is_contiguous() else None
        if flat is None or sum(c.numel() for c in cached) != flat.numel() or any(c.dtype != flat.dtype for c in cached):
            cached[:] = [c.detach().clone() for c in cached]
            continue
        planned.append((cached, torch.split(flat, [c.numel() for c in cached]), [c.device for c in cached]))
        # the cached tensors go first: in their place what clone() would give, on the meta device (no memory)
        cached[:] = [torch.empty_like(c, device="meta") for c in cached]
    if planned:
        _return_freed_memory()  # else the copies land beside the freed tensors' pages, which stay resident
    for cached, pieces, devices in planned:
        for i, (like, piece, device) in enumerate(zip(cached, pieces, devices, strict=True)):
            copy = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)
            cached[i] = copy.copy_(piece.view(like.shape))


@contextlib.contextmanager
def uncopied(metric: Any, parts: Mapping[str, torch.Tensor | None]) -> Iterator[None]:
    """While open, the cache ``metric.sync()`` makes holds the ``cat`` list states ``parts`` (joined in place) as this
    rank's own tensors, not copies that would add to the peak; on leaving, where it synced, :func:`recopy` copies."""
    lists = [attr for attr in parts if isinstance(getattr(metric, attr, None), list)]
    if not internals.copies_states() or not lists:  # before 1.4 sync() caches the states themselves
        yield
        return
    made: list[dict[str, Any]] = []

    def _copy_state_dict() -> dict[str, Any]:
        held = {attr: getattr(metric, attr) for attr in lists}
        internals.put(metric, {attr: [] for attr in lists})
        try:
            cache = internals.copy_state_dict(metric)
        finally:
            internals.put(metric, held)
        cache.update({attr: [t.detach() for t in value] for attr, value in held.items()})
        made.append(cache)
        return cache

    internals.stand_in(metric, "_copy_state_dict", _copy_state_dict)
    try:
        yield
    finally:
        internals.stand_down(metric, "_copy_state_dict")
    if made and internals.sync_cache(metric) is made[-1]:  # it synced here, and its synced states are set
        recopy(metric, {attr: parts[attr] for attr in lists})


def _concatenation(described: Sequence[wire.State | None]) -> tuple[list[int], torch.dtype, tuple[int, ...]] | None:
    """For a ``cat`` slot's descriptions on every rank: per rank the bytes it contributes to the concatenated state,
    its dtype and shape; ``None`` where it is not one ``cat`` state alike on every rank, concatenated in place."""
    lists = [d for d in described if d is not None and d.kind == wire.KIND_LIST and len(d.pieces) <= 1]
    if len(lists) < len(described):
        return None
    if any(p.requires_grad or p.streamed or p.dtype is None for d in lists for p in d.pieces):
        return None
    real = {r: d.pieces[0] for r, d in enumerate(lists) if d.pieces and not d.placeholder}
    keys = {key for key in (wire.cat_key(p.shape) for p in real.values()) if key is not None}
    dtypes = {p.dtype for p in real.values() if p.dtype is not None}  # none is unknown (checked above)
    if len(keys) != 1 or len(dtypes) != 1:
        return None
    key, dtype = keys.pop(), dtypes.pop()
    rows = sum((p.shape[0] if p.shape else 1) for p in real.values())
    return [real[r].nbytes if r in real else 0 for r in range(len(lists))], dtype, (rows, *key[1:])


def run(exchange: Any) -> tuple[list[tuple[int, int, int, torch.Tensor]], dict[int, Any], dict[int, Any]]:
    """After validation, alike on every rank: one collective for every slot of ``exchange`` (read, not changed)
    that has a separate piece on some rank. Returns what it brought: other ranks' separate pieces as ``(rank, slot,
    index, piece)``, this rank's tensors as the buffer holds them now (slot -> view), and the slots concatenated in
    place (slot -> synced value)."""
    slots, rank = exchange.slots, exchange.rank
    same_tables = all(each.table == exchange.described[0].table for each in exchange.described)
    wholes: list[tuple[int, int, int, torch.dtype, tuple[int, ...]]] = []  # slot, offset, bytes, dtype, shape
    places: list[tuple[int, int, int, int, wire.Piece]] = []  # rank, slot, position, offset, piece
    writes: list[tuple[int, int, wire.Piece]] = []  # this rank's: offset, slot, the piece its tensors make there
    end = 0
    for s in range(max((len(states) for states in exchange.every), default=0)):
        described = [states[s] if s < len(states) else None for states in exchange.every]
        if not any(p.separate for d in described if d is not None for p in d.pieces):
            continue
        whole = _concatenation(described) if same_tables and s < len(slots) and slots[s].is_cat else None
        if whole is not None:  # the slot's region is the concatenation itself
            sizes, dtype, shape = whole
            if sizes[rank]:
                writes.append((end + sum(sizes[:rank]), s, slots[s].described.pieces[0]))
            wholes.append((s, end, sum(sizes), dtype, shape))
            end += _bytes.aligned(sum(sizes))
            continue
        for r, d in enumerate(described):  # only the separate pieces, each where the payload would have put it
            for i, piece in enumerate(p for p in (d.pieces if d is not None else ()) if p.dtype is not None):
                if piece.separate:
                    if r == rank:
                        writes.append((end, s, piece))
                    places.append((r, s, i, end, piece))
                    end += _bytes.aligned(piece.nbytes)
    buffer = torch.zeros(end, dtype=torch.uint8, device=exchange.device)
    if on_buffer is not None:
        on_buffer(buffer)
    written = {}
    for at, s, piece in writes:
        written[s] = _view(buffer, at, piece)
        # this rank's tensors (a deferred list's in turn), copied as the values they read as (a conjugate view
        # resolved, as torch.cat resolves it), never through a byte view, which could fail on this rank alone
        for tensor in list(slots[s].value) if deferred(slots[s]) else [slots[s].tensors[0]]:
            n = _bytes.nbytes(tensor.shape, tensor.dtype)
            buffer[at : at + n].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            at += n
    # the ranks' bytes never overlap, so summing them as int64 words carries nothing: every bit arrives as written
    dist.all_reduce(buffer.view(torch.int64), dist.ReduceOp.SUM, exchange.group)
    pieces = [(r, s, i, _view(buffer, at, piece)) for r, s, i, at, piece in places]
    return pieces, written, {s: buffer[at : at + n].view(dtype).view(shape) for s, at, n, dtype, shape in wholes}


def _view(buffer: torch.Tensor, at: int, piece: wire.Piece) -> torch.Tensor:
    assert piece.dtype is not None  # a written piece's dtype is known; for mypy
    return buffer[at : at + piece.nbytes].view(piece.dtype).view(piece.shape)
