"""Large ``cat`` states: they cross in one collective apart from the payload, straight into the tensors the sync
returns.

torchmetrics gathers a ``cat`` state into one padded buffer per rank and then concatenates them; the payload does
the same through its receive buffers (and gloo's ``all_gather`` copies through a flat buffer of the whole output
besides). Either way a rank holds the gathered states two or three times at the sync's peak. Here the ``cat``
states cost one buffer of their gathered size, and that buffer *is* the synced states:

* **Which** (:func:`mark`, on the sending rank, from its own states): the one tensor of each ``cat`` list state
  (after torchmetrics' step 1) that is not the empty-list placeholder, is not empty, has a dtype the format carries,
  has no graph and is not streamed, when those tensors add up to :data:`LARGE_MIN_BYTES` or more on this rank.
  Their descriptions say so (``separate``) and the payload leaves them out, so every rank knows from the exchanged
  descriptions alone every piece that travels apart.
* **One collective** (:func:`run`, after validation, alike on every rank; none where no rank marked a piece): a
  zeroed buffer with a region per slot that some rank marked; every rank writes its own bytes there and the ranks
  ``all_reduce`` it as int64 words. The ranks' bytes never overlap, so the sum carries nothing and every bit
  arrives as its rank wrote it, whatever the dtype. No padding to the largest rank and no receive buffer per rank:
  gloo's ``all_reduce`` works in place (its ``all_gather`` copies the whole output through a flat buffer).
* **Concatenated in place**: where a slot is the same ``cat`` state on every rank (the same member table), no piece
  of it has a graph or is streamed, and the ranks' tensors agree in dtype and trailing sizes, its region holds
  every holder's tensor in rank order (the holders and placeholder rule of
  :func:`torchmetrics_gradpatch.fused.sync.reduce`; a rank's unmarked tensor is written there too), so the region,
  viewed as the dtype and shape, is torchmetrics' ``dim_zero_cat`` result bit for bit and is set as the state.
  Otherwise only the marked pieces travel, each in an aligned region, viewed back as the pieces the payload would
  have carried, and the ordinary step 3 follows.
* **Written as values**: a rank's tensors are copied in as the values they read as (conjugate and negative views
  resolved, as ``torch.cat`` resolves them), never through a byte view; what cannot be written so is left to step
  1, before the header, so no rank fails after the others began the exchange.
* **sync()'s cache**: the copies ``Metric.sync()`` makes of the local states (for ``unsync()``) are freed before
  the buffer is made (:func:`release_cache`; a collection's members make none: :func:`uncopied`), and made again
  from the buffer once the synced states are set (:func:`recopy`): ``unsync()`` restores copies, as torchmetrics'.

So the ``cat`` states' part of a sync's peak is their gathered size plus at most 15 bytes of alignment per slot; the
synced states share that one buffer's storage. The cost: a ring ``all_reduce`` moves about twice the bytes of a
gather per rank; for states of megabytes it is as fast as gloo's ``all_gather`` or faster.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch.fused import wire

__all__ = [
    "LARGE_MIN_BYTES",
    "defer",
    "joined_in_place",
    "mark",
    "on_buffer",
    "recopy",
    "release_cache",
    "run",
    "sent_apart",
    "uncopied",
    "written",
]

#: Where this rank's ``cat`` states' tensors add up to at least this many bytes, they cross apart from the payload.
LARGE_MIN_BYTES = 1 << 20

#: Called with every buffer this module allocates (tests count the bytes a sync allocates beyond its result).
on_buffer: Callable[[torch.Tensor], None] | None = None


def defer(value: list[Any], stream_cpu: bool) -> tuple[list[torch.Tensor], wire.State] | None:
    """Step 1 for a ``cat`` list of several tensors, or of one conjugate or negative view, deferred: the prepared
    state's tensors (a stand-in until :func:`mark`; the state's value keeps the list) and its description, as the
    one tensor ``dim_zero_cat`` would make; ``None`` where the tensors do not join as plain bytes (other dtypes,
    devices or layouts, a graph, other trailing sizes, an empty 1-d tensor among others) and step 1 runs as
    torchmetrics does.

    :func:`mark` joins them where the state stays in the payload (``torch.cat`` resolves views); sent apart, each
    tensor is copied into the buffer as the values it reads as, in turn, so the rank never holds its own states
    joined, or resolved, besides the synced ones.
    """
    if not all(isinstance(t, torch.Tensor) for t in value):
        return None
    first = value[0]
    if (
        not _bytes.plain(first.dtype)
        or (stream_cpu and first.device.type == "cpu")
        or any(
            t.requires_grad or t.dtype != first.dtype or t.device != first.device or t.layout != torch.strided
            for t in value
        )
    ):
        return None
    if all(t.ndim == 0 for t in value):
        shape: tuple[int, ...] = (len(value),)
    elif all(t.ndim >= 1 and t.shape[1:] == first.shape[1:] for t in value) and first.shape != (0,):
        shape = (sum(t.shape[0] for t in value), *first.shape[1:])
    else:
        return None
    described = wire.State(wire.KIND_LIST, (wire.Piece(first.dtype, shape, False),))
    return [_DEFERRED], described


_DEFERRED = torch.empty(0)  # a deferred state's stand-in tensor, until it is joined or sent apart


def _deferred(slot: Any) -> bool:
    return bool(slot.tensors) and slot.tensors[0] is _DEFERRED


def _own(slot: Any) -> list[torch.Tensor]:
    """This rank's tensors of a state sent apart, in the order they are written: the deferred list, or the one."""
    return list(slot.value) if _deferred(slot) else [slot.tensors[0]]


def _eligible(slot: Any) -> bool:
    described = slot.described
    if not slot.is_cat or described.kind != wire.KIND_LIST or described.placeholder or len(described.pieces) != 1:
        return False
    piece = described.pieces[0]
    return piece.dtype is not None and not piece.requires_grad and not piece.streamed and piece.nbytes > 0


def mark(slots: Sequence[Any]) -> None:
    """Mark the tensors of this rank's ``cat`` states separate, in ``slots`` (the fused sync's prepared states),
    where together they reach :data:`LARGE_MIN_BYTES` (see the module docstring); join the deferred ones that are
    not (:func:`defer`)."""
    from torchmetrics.utilities.data import dim_zero_cat

    cats = [slot for slot in slots if slot.is_cat]  # a steady sync's many small states are none of these
    chosen = [slot for slot in cats if _eligible(slot)]
    if sum(slot.described.pieces[0].nbytes for slot in chosen) < LARGE_MIN_BYTES:
        chosen = []
    sent = {id(slot) for slot in chosen}
    for slot in cats:  # step 1 completed for the deferred states that stay in the payload (in place: the
        if _deferred(slot) and id(slot) not in sent:  # collection's member states share the list)
            slot.tensors[:] = [dim_zero_cat(slot.value).contiguous()]
    for slot in chosen:
        piece = dataclasses.replace(slot.described.pieces[0], separate=True)
        slot.described = dataclasses.replace(slot.described, pieces=(piece,))


def release_cache(metric: Any, attrs: Iterable[str]) -> list[str]:
    """Let ``metric.sync()``'s cache of the local states hold this rank's own tensors of the ``cat`` states
    ``attrs`` (those sent apart) instead of the copies it has just made, so the copies are freed before the buffer
    is made; :func:`recopy` makes them again once the synced states are set. Returns the states so released.

    torchmetrics' ``sync()`` clones every local state into ``_cache`` right before it calls ``_sync_dist`` (which
    is this sync), and ``unsync()`` sets the states back from it: the clones add this rank's share of the gathered
    size to the sync's peak. Done only where the cache is that fresh one (set while the Metric is not synced;
    ``unsync()`` and ``reset()`` clear it) and matches the state tensor for tensor.
    """
    cache = getattr(metric, "_cache", None)
    if not isinstance(cache, dict) or getattr(metric, "_is_synced", True):
        return []
    released = []
    for attr in attrs:
        current, cached = getattr(metric, attr, None), cache.get(attr)
        if not (isinstance(current, list) and isinstance(cached, list) and len(current) == len(cached)):
            continue
        if cached is current:  # torchmetrics before 1.4 caches the state itself: there is no copy to free
            continue
        if all(
            isinstance(c, torch.Tensor)
            and isinstance(t, torch.Tensor)
            and (c.shape, c.dtype, c.device) == (t.shape, t.dtype, t.device)
            for c, t in zip(cached, current, strict=True)
        ):
            cache[attr] = [t.detach() for t in current]
            released.append(attr)
    if released:
        del cached
        _return_freed_memory()
    return released


def _return_freed_memory() -> None:
    """Give the heap pages that free memory holds back to the OS (glibc's ``malloc_trim(0)``; nothing elsewhere).

    States built by many ``update()`` calls are many small tensors, and so are the copies ``sync()`` makes of them:
    glibc serves those from its heap, and freeing them leaves their pages resident, so the buffer made next would
    add to them (measured: 1.3x to 1.64x the gathered states by peak resident memory with 200 or 2,000 batches per
    rank, 1.01x with one). Large tensors are mapped apart and unmapped when freed, so this matters for small ones
    only. Not making those copies would mean replacing ``Metric.sync()``, which makes them before this sync runs;
    giving the pages back costs one walk of the heap's free chunks (about 2 ms after 4,000 copies of 20 to 40 KB).
    """
    trim = _malloc_trim()
    if trim is not None:
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
    trim.restype = ctypes.c_int
    return cast(Callable[[int], int], trim)


def recopy(metric: Any, parts: Mapping[str, torch.Tensor | None]) -> None:
    """Make ``metric._cache``'s entries of the ``cat`` states in ``parts`` copies again, as ``sync()`` made them,
    where :func:`release_cache` or :func:`uncopied` left this rank's own tensors there; called once the synced
    states are set, so that ``unsync()`` restores copies, as torchmetrics' own sync does, never the caller's tensors.

    ``parts[attr]`` is this rank's tensors of the state as :func:`run` wrote them into the buffer (contiguous, one
    after another), and the copies are made from those bytes, after every cached tensor is dropped and the freed
    memory is given back (:func:`_return_freed_memory`): where the cache held the last reference, the copies take
    the place of the local tensors, and the peak never holds the local states twice while the buffer exists. Each
    copy has the strides ``clone()`` gives (torchmetrics' copies). Where the bytes do not match the cache (not
    expected), the cached tensors themselves are cloned.
    """
    cache = getattr(metric, "_cache", None)
    if not isinstance(cache, dict):
        return
    planned: list[tuple[list[Any], torch.Tensor, list[tuple[torch.Tensor, torch.device]]]] = []
    for attr, own in parts.items():
        cached = cache.get(attr)
        if not isinstance(cached, list) or not all(isinstance(c, torch.Tensor) for c in cached):
            continue
        flat = own.reshape(-1) if own is not None and own.is_contiguous() else None
        if flat is None or sum(c.numel() for c in cached) != flat.numel() or any(c.dtype != flat.dtype for c in cached):
            cached[:] = [c.detach().clone() for c in cached]
            continue
        likes = [(torch.empty_like(c, device="meta"), c.device) for c in cached]  # what clone() gives, no memory
        cached[:] = [like for like, _ in likes]  # this rank's tensors go first
        planned.append((cached, flat, likes))
    if not planned:
        return
    _return_freed_memory()  # else the copies land beside the freed tensors' pages, which stay resident
    for cached, flat, likes in planned:
        at = 0
        for i, (like, device) in enumerate(likes):
            copy = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)
            cached[i] = copy.copy_(flat[at : at + like.numel()].view(like.shape))
            at += like.numel()


@contextlib.contextmanager
def uncopied(metric: Any, parts: Mapping[str, torch.Tensor | None]) -> Iterator[None]:
    """While open, the cache that ``metric.sync()`` makes holds the ``cat`` list states ``parts`` (those joined in
    place; :func:`joined_in_place`) as this rank's own tensors, detached, instead of copies; on leaving, once the
    synced states are set, :func:`recopy` makes the copies.

    For a collection's members, whose ``sync()`` runs after the exchange: copies made there would add to a peak
    that already holds the buffer, while the local states are still held. ``_copy_state_dict`` (torchmetrics 1.4
    on; before, ``sync()`` caches the states themselves, and nothing is done here) runs with those states emptied
    for that one call.
    """
    copy = getattr(type(metric), "_copy_state_dict", None)
    lists = [attr for attr in parts if isinstance(getattr(metric, attr, None), list)]
    if copy is None or not lists:
        yield
        return
    made: list[dict[str, Any]] = []

    def _copy_state_dict() -> dict[str, Any]:
        held = {attr: getattr(metric, attr) for attr in lists}
        for attr in lists:
            setattr(metric, attr, [])
        try:
            cache: dict[str, Any] = copy(metric)
        finally:
            for attr, value in held.items():
                setattr(metric, attr, value)
        cache.update({attr: [t.detach() for t in value] for attr, value in held.items()})
        made.append(cache)
        return cache

    metric._copy_state_dict = _copy_state_dict  # an instance attribute, over the class's, while open
    try:
        yield
    finally:
        del metric._copy_state_dict
    if made and getattr(metric, "_cache", None) is made[-1]:  # it synced here, and its synced states are set
        recopy(metric, {attr: parts[attr] for attr in lists})


def written(states: Sequence[Any], attrs: Iterable[str]) -> dict[str, torch.Tensor | None]:
    """Per state of ``attrs``: this rank's tensors as :func:`run` wrote them (what :func:`recopy` copies from)."""
    wanted = set(attrs)
    return {state.attr: state.tensors[0] if state.tensors else None for state in states if state.attr in wanted}


def joined_in_place(states: Sequence[Any], values: Sequence[torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The ``cat`` states of ``states`` whose synced value :func:`run` made (``values``: each state's, or ``None``),
    each with this rank's tensors as written (:func:`written`)."""
    attrs = [state.attr for state, value in zip(states, values, strict=True) if state.is_cat and value is not None]
    return written(states, attrs)


def sent_apart(slots: Sequence[Any]) -> list[str]:
    """The states of ``slots`` this rank sends apart."""
    return [slot.attr for slot in slots if any(piece.separate for piece in slot.described.pieces)]


def _cat_key(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """What ``torch.cat`` needs equal (0-d counts as 1-d; an empty 1-d tensor is skipped by it: ``None``)."""
    if not shape:
        return (1,)
    return None if shape == (0,) else (len(shape), *shape[1:])


def _concatenation(
    described: Sequence[wire.State | None], own: Any, same_tables: bool
) -> tuple[list[int], torch.dtype, tuple[int, ...]] | None:
    """Per rank the bytes it contributes to the concatenated state, its dtype and shape; ``None`` where the slot
    is not one ``cat`` state alike on every rank that can be concatenated in place."""
    if not same_tables or own is None or not own.is_cat or own.described.kind != wire.KIND_LIST:
        return None
    if any(d is None or d.kind != wire.KIND_LIST or len(d.pieces) > 1 for d in described):
        return None
    pieces = [p for d in described if d is not None for p in d.pieces]
    if any(p.requires_grad or p.streamed or p.dtype is None for p in pieces):
        return None
    real = {r: d.pieces[0] for r, d in enumerate(described) if d is not None and d.pieces and not d.placeholder}
    keys = {key for key in (_cat_key(p.shape) for p in real.values()) if key is not None}
    dtypes = {p.dtype for p in real.values()}
    if len(keys) != 1 or len(dtypes) != 1:
        return None
    key, dtype = keys.pop(), dtypes.pop()
    assert dtype is not None  # checked above; for mypy
    rows = sum((p.shape[0] if p.shape else 1) for p in real.values())
    sizes = [real[r].nbytes if r in real else 0 for r in range(len(described))]
    return sizes, dtype, (rows, *key[1:])


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if on_buffer is not None:
        on_buffer(buffer)
    return buffer


def _exchange(buffer: torch.Tensor, group: Any) -> None:
    """Every rank's bytes into every rank's ``buffer`` (each rank wrote its own, zeros elsewhere): one
    ``all_reduce`` of the bytes as int64 words. The ranks' bytes never overlap, so no addition carries: each word
    sums to the bits its writers put in, whatever the dtype and wherever a rank's bytes begin."""
    dist.all_reduce(buffer.view(torch.int64), dist.ReduceOp.SUM, group)


def _write(buffer: torch.Tensor, at: int, tensors: Sequence[torch.Tensor]) -> None:
    """``tensors``' values into ``buffer`` from byte ``at`` on, one after another, each contiguous.

    Copied as the values they read as (a conjugate or negative view is resolved by the copy, as ``torch.cat``
    resolves it), never through a byte view of their memory, which a view refuses: nothing here can fail on one
    rank after the other ranks have begun the exchange (what cannot be written as plain bytes, :func:`defer` and
    :func:`mark` leave to step 1, before the header).
    """
    for tensor in tensors:
        n = _bytes.nbytes(tensor.shape, tensor.dtype)
        buffer[at : at + n].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        at += n


def run(got: Any, slots: Sequence[Any], rank: int, group: Any, device: torch.device) -> dict[int, torch.Tensor]:
    """After validation, alike on every rank: one collective for every slot that has a separate piece on some rank
    (none where no rank has one).

    ``got`` is the exchange (:class:`torchmetrics_gradpatch.fused.sync.Exchanged`), ``slots`` this rank's prepared
    slots. Returns the slots concatenated in place (slot index -> its synced value); the separate pieces of the
    others are put into ``got.gathered``. Each slot whose tensors this rank wrote holds them, once written, as the
    buffer's view of them (``tensors``; what :func:`recopy` copies from) and no longer the local ones (``value``,
    this sync's own list, is emptied), so that ``sync()``'s cache can be the last to hold those.
    """
    every: list[Sequence[wire.State]] = got.slots
    same_tables = all(table == got.tables[0] for table in got.tables)
    wholes: list[tuple[int, int, int, torch.dtype, tuple[int, ...]]] = []  # slot, offset, bytes, dtype, shape
    places: list[tuple[int, int, int, int, wire.Piece]] = []  # rank, slot, position, offset, piece
    writes: list[tuple[int, Any, wire.Piece]] = []  # this rank's: offset, slot, the piece its tensors make there
    end = 0
    for s in range(max((len(states) for states in every), default=0)):
        described = [states[s] if s < len(states) else None for states in every]
        if not any(p.separate for d in described if d is not None for p in d.pieces):
            continue
        own = slots[s] if s < len(slots) else None
        whole = _concatenation(described, own, same_tables)
        if whole is not None:  # the slot's region is the concatenation itself
            sizes, dtype, shape = whole
            if sizes[rank]:
                assert own is not None  # this rank holds the slot; for mypy
                writes.append((end + sum(sizes[:rank]), own, own.described.pieces[0]))
            wholes.append((s, end, sum(sizes), dtype, shape))
            end += _bytes.aligned(sum(sizes))
            continue
        for r, d in enumerate(described):  # only the separate pieces, each where the payload would have put it
            known = [p for p in (d.pieces if d is not None else ()) if p.dtype is not None]
            for i, piece in enumerate(known):
                if piece.separate:
                    if r == rank:
                        assert own is not None  # this rank holds the slot; for mypy
                        writes.append((end, own, piece))
                    places.append((r, s, i, end, piece))
                    end += _bytes.aligned(piece.nbytes)
    if end == 0:
        return {}
    buffer = _allocate(end, device)
    for at, slot, piece in writes:
        _write(buffer, at, _own(slot))
        assert piece.dtype is not None  # a written piece's dtype is known; for mypy
        # in place: a collection's member states share these lists with the slot
        slot.tensors[:] = [buffer[at : at + piece.nbytes].view(piece.dtype).view(piece.shape)]
        if isinstance(slot.value, list):
            slot.value.clear()
    _exchange(buffer, group)
    for r, s, i, at, piece in places:
        assert piece.dtype is not None  # known pieces only; for mypy
        got.gathered[r][s][i] = buffer[at : at + piece.nbytes].view(piece.dtype).view(piece.shape)
    return {s: buffer[at : at + n].view(dtype).view(shape) for s, at, n, dtype, shape in wholes}
