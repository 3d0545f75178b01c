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

So the ``cat`` states' part of a sync's peak is their gathered size plus at most 15 bytes of alignment per slot; the
synced states share that one buffer's storage. The cost: a ring ``all_reduce`` moves about twice the bytes of a
gather per rank; for states of megabytes it is as fast as gloo's ``all_gather`` or faster.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch.fused import wire as fp

__all__ = [
    "LARGE_MIN_BYTES",
    "defer",
    "joined_in_place",
    "mark",
    "on_buffer",
    "release_cache",
    "run",
    "sent_apart",
    "uncopied",
]

#: Where this rank's ``cat`` states' tensors add up to at least this many bytes, they cross apart from the payload.
LARGE_MIN_BYTES = 1 << 20

#: Called with every buffer this module allocates (tests count the bytes a sync allocates beyond its result).
on_buffer: Callable[[torch.Tensor], None] | None = None


def defer(value: list[Any], stream_cpu: bool) -> tuple[list[torch.Tensor], fp.State] | None:
    """Step 1 for a ``cat`` list of several tensors, deferred: the prepared state's tensors (a stand-in until
    :func:`mark`; the state's value keeps the list) and its description, as the one tensor ``dim_zero_cat`` would
    make; ``None`` where the tensors do not join as plain bytes (other dtypes or devices, a graph, other
    trailing sizes, an empty 1-d tensor among others) and step 1 runs as torchmetrics does.

    :func:`mark` joins them where the state stays in the payload; sent apart, each tensor is written into the
    buffer in turn, so the rank never holds its own states joined besides the synced ones.
    """
    if not all(isinstance(t, torch.Tensor) for t in value):
        return None
    first = value[0]
    if (
        not _bytes.plain(first.dtype)
        or (stream_cpu and first.device.type == "cpu")
        or any(t.requires_grad or t.dtype != first.dtype or t.device != first.device for t in value)
    ):
        return None
    if all(t.ndim == 0 for t in value):
        shape: tuple[int, ...] = (len(value),)
    elif all(t.ndim >= 1 and t.shape[1:] == first.shape[1:] for t in value) and first.shape != (0,):
        shape = (sum(t.shape[0] for t in value), *first.shape[1:])
    else:
        return None
    described = fp.State(fp.KIND_LIST, (fp.Piece(first.dtype, shape, False),))
    return [_DEFERRED], described


_DEFERRED = torch.empty(0)  # a deferred state's stand-in tensor, until it is joined or sent apart


def _deferred(slot: Any) -> bool:
    return bool(slot.tensors) and slot.tensors[0] is _DEFERRED


def _own(slot: Any) -> list[torch.Tensor]:
    """This rank's tensors of a state sent apart, in the order they are written: the deferred list, or the one."""
    return list(slot.value) if _deferred(slot) else [slot.tensors[0]]


def _eligible(slot: Any) -> bool:
    described = slot.described
    if not slot.is_cat or described.kind != fp.KIND_LIST or described.placeholder or len(described.pieces) != 1:
        return False
    piece = described.pieces[0]
    return piece.dtype is not None and not piece.requires_grad and not piece.streamed and piece.nbytes > 0


def mark(slots: Sequence[Any]) -> None:
    """Mark the tensors of this rank's ``cat`` states separate, in ``slots`` (the fused sync's prepared states),
    where together they reach :data:`LARGE_MIN_BYTES` (see the module docstring); join the deferred ones that are
    not (:func:`defer`)."""
    from torchmetrics.utilities.data import dim_zero_cat

    chosen = [slot for slot in slots if _eligible(slot)]
    if sum(slot.described.pieces[0].nbytes for slot in chosen) < LARGE_MIN_BYTES:
        chosen = []
    sent = {id(slot) for slot in chosen}
    for slot in slots:  # step 1 completed for the deferred states that stay in the payload (in place: the
        if _deferred(slot) and id(slot) not in sent:  # collection's member states share the list)
            slot.tensors[:] = [dim_zero_cat(slot.value).contiguous()]
    for slot in chosen:
        piece = dataclasses.replace(slot.described.pieces[0], separate=True)
        slot.described = dataclasses.replace(slot.described, pieces=(piece,))


def release_cache(metric: Any, attrs: Iterable[str]) -> None:
    """Let ``metric.sync()``'s cache of the local states hold this rank's own tensors of the ``cat`` states
    ``attrs`` (those sent apart) instead of the copies it has just made, so the copies are freed.

    torchmetrics' ``sync()`` clones every local state into ``_cache`` right before it calls ``_sync_dist`` (which
    is this sync), and ``unsync()`` sets the states back from it: the clones add this rank's share of the gathered
    size to the sync's peak. A ``cat`` list's tensors are never changed in place by torchmetrics, so the cache holds
    the same values through the tensors themselves (detached, as the clones are). Done only where the cache is
    that fresh one (set while the Metric is not synced; ``unsync()`` and ``reset()`` clear it) and matches the
    state tensor for tensor.
    """
    cache = getattr(metric, "_cache", None)
    if not isinstance(cache, dict) or getattr(metric, "_is_synced", True):
        return
    for attr in attrs:
        current, cached = getattr(metric, attr, None), cache.get(attr)
        if not (isinstance(current, list) and isinstance(cached, list) and len(current) == len(cached)):
            continue
        if cached is current:  # torchmetrics before 1.0 caches the state itself: there is no copy to free
            continue
        if all(
            isinstance(c, torch.Tensor)
            and isinstance(t, torch.Tensor)
            and (c.shape, c.dtype, c.device) == (t.shape, t.dtype, t.device)
            for c, t in zip(cached, current, strict=True)
        ):
            cache[attr] = [t.detach() for t in current]


@contextlib.contextmanager
def uncopied(metric: Any, attrs: Sequence[str]) -> Iterator[None]:
    """While open, the cache that ``metric.sync()`` makes holds the ``cat`` list states ``attrs`` (those joined in
    place) as this rank's own tensors, detached, instead of copies (as :func:`release_cache` leaves it, but without
    the copies ever being made).

    For a collection's members, whose ``sync()`` runs after the exchange: their copies would otherwise add to a
    peak that already holds the buffer. ``_copy_state_dict`` (torchmetrics 1.0 on; before, ``sync()`` caches the
    states themselves) runs with those states emptied for that one call.
    """
    copy = getattr(type(metric), "_copy_state_dict", None)
    lists = [attr for attr in attrs if isinstance(getattr(metric, attr, None), list)]
    if copy is None or not lists:
        yield
        return

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
        return cache

    metric._copy_state_dict = _copy_state_dict  # an instance attribute, over the class's, while open
    try:
        yield
    finally:
        del metric._copy_state_dict


def joined_in_place(states: Sequence[Any], values: Sequence[torch.Tensor | None]) -> list[str]:
    """The ``cat`` states of ``states`` whose synced value :func:`run` made (``values``: each state's, or ``None``)."""
    return [state.attr for state, value in zip(states, values, strict=True) if state.is_cat and value is not None]


def sent_apart(slots: Sequence[Any]) -> list[str]:
    """The states of ``slots`` this rank sends apart."""
    return [slot.attr for slot in slots if any(piece.separate for piece in slot.described.pieces)]


def _cat_key(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """What ``torch.cat`` needs equal (0-d counts as 1-d; an empty 1-d tensor is skipped by it: ``None``)."""
    if not shape:
        return (1,)
    return None if shape == (0,) else (len(shape), *shape[1:])


def _concatenation(
    described: Sequence[fp.State | None], own: Any, same_tables: bool
) -> tuple[list[int], torch.dtype, tuple[int, ...]] | None:
    """Per rank the bytes it contributes to the concatenated state, its dtype and shape; ``None`` where the slot
    is not one ``cat`` state alike on every rank that can be concatenated in place."""
    if not same_tables or own is None or not own.is_cat or own.described.kind != fp.KIND_LIST:
        return None
    if any(d is None or d.kind != fp.KIND_LIST or len(d.pieces) > 1 for d in described):
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


def run(got: Any, slots: Sequence[Any], rank: int, group: Any, device: torch.device) -> dict[int, torch.Tensor]:
    """After validation, alike on every rank: one collective for every slot that has a separate piece on some rank
    (none where no rank has one).

    ``got`` is the exchange (:class:`torchmetrics_gradpatch.fused.sync.Exchanged`), ``slots`` this rank's prepared
    slots. Returns the slots concatenated in place (slot index -> its synced value); the separate pieces of the
    others are put into ``got.gathered``.
    """
    every: list[list[fp.State]] = got.slots
    same_tables = all(table == got.tables[0] for table in got.tables)
    wholes: list[tuple[int, int, int, torch.dtype, tuple[int, ...]]] = []  # slot, offset, bytes, dtype, shape
    places: list[tuple[int, int, int, int, fp.Piece]] = []  # rank, slot, position, offset, piece
    writes: list[tuple[int, list[torch.Tensor]]] = []  # this rank's bytes: offset, its tensors one after another
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
                writes.append((end + sum(sizes[:rank]), _own(own)))
            wholes.append((s, end, sum(sizes), dtype, shape))
            end += _bytes.aligned(sum(sizes))
            continue
        for r, d in enumerate(described):  # only the separate pieces, each where the payload would have put it
            known = [p for p in (d.pieces if d is not None else ()) if p.dtype is not None]
            for i, piece in enumerate(known):
                if piece.separate:
                    if r == rank:
                        assert own is not None  # this rank holds the slot; for mypy
                        writes.append((end, _own(own)))
                    places.append((r, s, i, end, piece))
                    end += _bytes.aligned(piece.nbytes)
    if end == 0:
        return {}
    buffer = _allocate(end, device)
    for at, tensors in writes:
        for tensor in tensors:
            data = _bytes.as_bytes(tensor)
            buffer[at : at + data.numel()].copy_(data)
            at += data.numel()
    _exchange(buffer, group)
    for r, s, i, at, piece in places:
        assert piece.dtype is not None  # known pieces only; for mypy
        got.gathered[r][s][i] = buffer[at : at + piece.nbytes].view(piece.dtype).view(piece.shape)
        if r == rank and _deferred(slots[s]):  # this rank's entry: its tensors as step 1 would have joined them
            slots[s].tensors[:] = [got.gathered[r][s][i]]
    return {s: buffer[at : at + n].view(dtype).view(shape) for s, at, n, dtype, shape in wholes}
