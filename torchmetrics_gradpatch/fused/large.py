"""Large ``cat`` states: each crosses in one collective of its own, straight into the tensor the sync returns.

torchmetrics gathers a ``cat`` state into one padded buffer per rank and then concatenates them; the payload does
the same through its receive buffers. Either way a rank holds the gathered states two or three times at the sync's
peak. Here a large ``cat`` state costs one buffer of exactly the gathered size, which *is* the synced state:

* **Which pieces** (:func:`mark`, on the sending rank, from its own state): the one tensor of a ``cat`` list state
  (after torchmetrics' step 1) of at least :data:`LARGE_MIN_BYTES`, not the empty-list placeholder, of a dtype the
  format carries, without a graph and not streamed. Its description says so (``separate``), and it is left out of
  the payload. So every rank knows, from the exchanged descriptions alone, every piece that travels apart.
* **One collective per slot** with a separate piece on any rank (:func:`run`, after validation, alike on every
  rank): every rank writes its bytes at its offset into a zeroed buffer of the sum of every rank's bytes and the
  ranks ``all_reduce`` it as integers (``SUM``: each byte is one rank's, the others add zero, so the bits arrive
  exactly, whatever the dtype). No padding to the largest rank, no receive buffer per rank: gloo's ``all_gather``
  copies through a flat buffer of the whole output, its ``all_reduce`` works in place on the one buffer.
* **Concatenated in place**: where every rank's slot is the same ``cat`` state (same member table), no piece has a
  graph or is streamed and the contributions agree in dtype and trailing sizes, the buffer holds the rank-ordered
  concatenation of the holders' tensors (the same holders and placeholder rule as
  :func:`torchmetrics_gradpatch.fused.sync.reduce`), so it is viewed as torchmetrics' ``dim_zero_cat`` result, bit
  for bit, and set as the state. Otherwise only the separate pieces travel, each at an aligned offset, and are
  viewed back as the pieces the payload would have carried (the ordinary step 3 follows).

The cost: a ring ``all_reduce`` moves about twice the bytes of a gather per rank; for large states it is as fast
as gloo's ``all_gather`` or faster (no copy through a flat buffer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch.fused import wire as fp

__all__ = ["LARGE_MIN_BYTES", "mark", "on_buffer", "run"]

#: A ``cat`` state's tensor of at least this many bytes on some rank crosses in a collective of its own.
LARGE_MIN_BYTES = 1 << 20

#: Called with every buffer this module allocates (tests count the bytes a sync allocates beyond its result).
on_buffer: Callable[[torch.Tensor], None] | None = None

# the integer dtypes every backend sums (gloo has no int16)
_WIDTHS = ((8, torch.int64), (4, torch.int32), (1, torch.uint8))


def mark(described: fp.State, cat: bool) -> fp.State:
    """``described`` with its piece marked separate where it is a large ``cat`` state's tensor (see the module
    docstring); else as it is."""
    if not cat or described.kind != fp.KIND_LIST or described.placeholder or len(described.pieces) != 1:
        return described
    piece = described.pieces[0]
    if piece.dtype is None or piece.requires_grad or piece.streamed or piece.nbytes < max(1, LARGE_MIN_BYTES):
        return described
    return dataclasses.replace(described, pieces=(dataclasses.replace(piece, separate=True),))


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
    keys = {_cat_key(p.shape) for p in real.values()} - {None}
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


def _exchange(buffer: torch.Tensor, sizes: Sequence[int], group: Any) -> None:
    """Every rank's bytes into every rank's ``buffer`` (each rank wrote its own, the rest is zero): one
    ``all_reduce``, as the widest integers that every rank's bytes fill whole."""
    as_int = next(t for w, t in _WIDTHS if all(n % w == 0 for n in sizes))
    dist.all_reduce(buffer.view(as_int), dist.ReduceOp.SUM, group)


def run(got: Any, slots: Sequence[Any], rank: int, group: Any, device: torch.device) -> dict[int, torch.Tensor]:
    """After validation, alike on every rank: one collective per slot that has a separate piece on some rank.

    ``got`` is the exchange (:class:`torchmetrics_gradpatch.fused.sync.Exchanged`), ``slots`` this rank's prepared
    slots. Returns the slots concatenated in place (slot index -> its synced value); the separate pieces of the
    others are put into ``got.gathered``.
    """
    every: list[list[fp.State]] = got.slots
    same_tables = all(table == got.tables[0] for table in got.tables)
    values: dict[int, torch.Tensor] = {}
    for s in range(max((len(states) for states in every), default=0)):
        described = [states[s] if s < len(states) else None for states in every]
        if not any(p.separate for d in described if d is not None for p in d.pieces):
            continue
        own = slots[s] if s < len(slots) else None
        whole = _concatenation(described, own, same_tables)
        if whole is not None:
            sizes, dtype, shape = whole
            buffer = _allocate(sum(sizes), device)
            at = sum(sizes[:rank])
            if sizes[rank]:
                buffer[at : at + sizes[rank]].copy_(_bytes.as_bytes(own.tensors[0]))
            _exchange(buffer, sizes, group)
            values[s] = buffer.view(dtype).view(shape)
            continue
        # only the separate pieces, each at an aligned offset, viewed back where the payload would have put them
        places: list[tuple[int, int, int, fp.Piece]] = []  # rank, position among its pieces, offset, piece
        end = 0
        for r, d in enumerate(described):
            known = [p for p in (d.pieces if d is not None else ()) if p.dtype is not None]
            for i, piece in enumerate(known):
                if piece.separate:
                    places.append((r, i, end, piece))
                    end += _bytes.aligned(piece.nbytes)
        buffer = _allocate(end, device)
        for r, i, at, piece in places:
            if r == rank:
                buffer[at : at + piece.nbytes].copy_(_bytes.as_bytes(own.tensors[i]))
        _exchange(buffer, [end], group)
        for r, i, at, piece in places:
            assert piece.dtype is not None  # known pieces only; for mypy
            got.gathered[r][s][i] = buffer[at : at + piece.nbytes].view(piece.dtype).view(piece.shape)
    return values
