"""The fused exchange's wire format and each process group's agreed inline capacity.

A rank sends a header row of :data:`HEADER_WORDS` int64 words (its fields are named below), then a payload: its
description (int64 words: :func:`encode`) and each piece's bytes at an offset aligned to :data:`ALIGN`, so a piece is
viewed back as its dtype in place. Collective 1 (:func:`gather_first`) carries every header and, where it fits the
group's inline capacity, every payload; collective 2 (:func:`gather_payloads`) the payloads padded to the largest.
:class:`Group` holds what must evolve alike on every rank of a group. Format, capacity rule and why it agrees:
docs/design.md ("The wire").
"""

from __future__ import annotations

import array
import functools
import itertools
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch._bytes import ALIGN, as_bytes
from torchmetrics_gradpatch.fused import internals

TAG = 0x7467_6673_0006  # "tgfs", format 6: a rank running another format of this header size is told so
HEADER_WORDS = 10  # 80 bytes: a multiple of ALIGN, so an inline payload's pieces can be viewed in place
# a header row's fields: the format tag, the description's length in words, the payload's size in bytes, flags, the
# sender's fingerprint, the payload's size without what it proposes to reduce, that proposal's digest (0: none),
# its chunk size for CPU-held states, and the inline capacity it used
FORMAT, WORDS, SIZE, FLAGS, FINGERPRINT, SIZE_REDUCED, PROPOSAL, CHUNK, CAPACITY = range(9)
FLAG_GRAD_MODE = 1
FLAG_REQUIRES_GRAD = 2
FLAG_FAILED = 8  # this rank could not prepare its states: every rank raises after the header
FLAG_INLINE = 16  # this rank's payload (its proposal's layout) is in collective 1
FLAG_UNSTAGED = 32  # a collection step's rank that sends its member table alone (it ran no member yet)
FLAG_ASIDE = 64  # this rank runs torchmetrics' own path here: every rank does (docs/fused-sync.md, stepping aside)
FLAG_CHECK = 128  # this rank runs in check mode: every rank must

#: The largest inline capacity: a payload over it always takes the second collective.
INLINE_MAX = 64 * 1024
#: The smallest non-zero inline capacity (a few states' description and data).
INLINE_MIN = 256
#: How many of a group's recent exchanges the capacity follows.
WINDOW = 32
_HEAD_BYTES = 8 * HEADER_WORDS

KIND_TENSOR = 0
KIND_LIST = 1
KIND_OTHER = 2  # neither a tensor nor a list of tensors: refused on every rank (Exchange.validate)

UNKNOWN_DTYPE = -1  # a dtype a packed buffer cannot carry (no code is negative)


@dataclass(frozen=True)
class Piece:
    """One tensor as the description gives it: dtype (``None``: unknown to the format), shape, requires_grad, and
    whether it is streamed (held on the CPU while the exchange runs on a device) or separate (sent apart from the
    payload, :mod:`torchmetrics_gradpatch.fused.large`)."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]
    requires_grad: bool
    streamed: bool = False
    separate: bool = False  # left out of the payload: it crosses in a collective of its own (fused.large)

    @functools.cached_property
    def nbytes(self) -> int:
        return _bytes.nbytes(self.shape, self.dtype) if self.dtype is not None else 0


@dataclass(frozen=True)
class State:
    """One state as the description gives it: its kind, its pieces, and whether its one piece is the placeholder
    torchmetrics puts in for an empty ``cat`` list (so it is no data of this rank's)."""

    kind: int
    pieces: tuple[Piece, ...]
    placeholder: bool = False

    @functools.cached_property
    def words(self) -> tuple[int, ...]:
        """This state's words in a description (:func:`encode`); a steady exchange describes the same objects."""
        words = [self.kind, int(self.placeholder), len(self.pieces)]
        for piece in self.pieces:
            code = UNKNOWN_DTYPE if piece.dtype is None else _bytes.code(piece.dtype)
            flags = int(piece.requires_grad) | 2 * int(piece.streamed) | 4 * int(piece.separate)
            words += [code, flags, len(piece.shape), *piece.shape]
        return tuple(words)


def sendable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or an empty stand-in when its dtype is unknown to the format (described, refused, never sent)."""
    return tensor if _bytes.plain(tensor.dtype) else torch.empty(0, dtype=torch.uint8)


def piece_of(tensor: torch.Tensor, streamed: bool = False) -> Piece:
    """The description of ``tensor``."""
    return _piece(tensor.dtype, tuple(tensor.shape), tensor.requires_grad, streamed)


def tensor_state(tensor: torch.Tensor, streamed: bool = False) -> State:
    """The description of a tensor state holding ``tensor``."""
    return _tensor_state(tensor.dtype, tuple(tensor.shape), tensor.requires_grad, streamed)


@functools.lru_cache(maxsize=1024)
def _tensor_state(dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, streamed: bool) -> State:
    # one object per description, as _piece: its words (State.words) are made once
    return State(KIND_TENSOR, (_piece(dtype, shape, requires_grad, streamed),))


@functools.lru_cache(maxsize=1024)
def _piece(dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, streamed: bool) -> Piece:
    # a steady exchange describes the same tensors step after step: one object each (its nbytes computed once)
    return Piece(dtype if _bytes.plain(dtype) else None, shape, requires_grad, streamed)


def encode(states: Sequence[State], table: Sequence[int] = ()) -> list[int]:
    """The description as int64 words (see the module docstring), padded to an even count (``ALIGN`` bytes).

    ``table``: words the caller adds in front (the collection sync's member table), given back by :func:`decode`.
    """
    words = [len(table), *table, len(states)]
    for state in states:
        words += state.words
    if len(words) % 2:
        words.append(0)
    return words


def decode(words: Sequence[int]) -> tuple[list[int], list[State]]:
    """The inverse of :func:`encode`: the table and the states (trailing padding ignored)."""
    table = list(words[1 : 1 + words[0]])
    at = 1 + words[0]
    states: list[State] = []
    count = words[at]
    at += 1
    for _ in range(count):
        kind, placeholder, n_pieces = words[at : at + 3]
        at += 3
        pieces = []
        for _ in range(n_pieces):
            code, flags, ndim = words[at : at + 3]
            shape = tuple(words[at + 3 : at + 3 + ndim])
            at += 3 + ndim
            dtype = _bytes.dtype_of(code)
            plain = dtype if dtype is not None and _bytes.plain(dtype) else None
            pieces.append(Piece(plain, shape, bool(flags & 1), bool(flags & 2), bool(flags & 4)))
        states.append(State(kind, tuple(pieces), bool(placeholder)))
    return table, states


#: how to view one rank's pieces in its buffer: per state, ``None`` where it is left out (reduced), else per piece
#: of a known dtype its dtype, shape, strides and offset in elements (``-1``: not in this buffer)
Views = tuple[tuple[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int], ...] | None, ...]


class Described(NamedTuple):
    """A rank's description read back: its table, its states, its payload's offsets and size with the reduced
    states left out, whether it streams or sends apart some piece, and how to view its pieces (:func:`unpack`)."""

    table: tuple[int, ...]
    states: tuple[State, ...]
    offsets: list[list[int]]
    size: int
    streams: bool
    separates: bool
    views: Views


@functools.lru_cache(maxsize=128)
def read(words: tuple[int, ...], skip: tuple[int, ...] = ()) -> Described:
    """The description ``words`` read back with the states ``skip`` left out of its payload: a steady exchange reads
    each description once (the result is shared; callers do not change it)."""
    table, states = decode(words)
    pieces = [piece for state in states for piece in state.pieces]
    offsets, size = layout(states, 8 * len(words), skip)
    streams, separates = any(p.streamed for p in pieces), any(p.separate for p in pieces)
    return Described(tuple(table), tuple(states), offsets, size, streams, separates, views(states, offsets, skip))


def views(states: Sequence[State], offsets: Sequence[Sequence[int]], skip: Sequence[int]) -> Views:
    """How to view each piece of a buffer laid out by ``offsets`` (:func:`layout`)."""
    left_out = set(skip)
    return tuple(
        None
        if s in left_out
        else tuple(
            (p.dtype, p.shape, _strides(p.shape), o // _bytes.itemsize(p.dtype) if o >= 0 else -1)
            for p, o in zip(state.pieces, state_offsets, strict=True)
            if p.dtype is not None
        )
        for s, (state, state_offsets) in enumerate(zip(states, offsets, strict=True))
    )


def cat_key(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """What ``torch.cat`` needs equal (0-d counts as 1-d; an empty 1-d tensor is skipped by it: ``None``)."""
    if not shape:
        return (1,)
    return None if shape == (0,) else (len(shape), *shape[1:])


def layout(
    states: Sequence[State], start: int, skip: Sequence[int] = (), streamed: bool = False
) -> tuple[list[list[int]], int]:
    """Each piece's byte offset in the payload (pieces from ``start`` on, each aligned), and the payload's size.

    With ``streamed``, the same for the stream of streamed pieces instead. A piece that is not in that buffer (a
    state in ``skip``, which is reduced, a separate piece, or a piece of the other buffer) has offset ``-1``.
    """
    left_out = set(skip)
    wanted = [
        [s not in left_out and not piece.separate and piece.streamed == streamed for piece in state.pieces]
        for s, state in enumerate(states)
    ]
    sizes = (
        piece.nbytes
        for state, keep in zip(states, wanted, strict=True)
        for piece, k in zip(state.pieces, keep, strict=True)
        if k
    )
    found, end = _bytes.offsets(sizes, start)
    at = iter(found)
    offsets = [[next(at) if k else -1 for k in keep] for keep in wanted]
    return offsets, _bytes.aligned(end)


def pack(
    words: Sequence[int],
    tensors: Sequence[Sequence[torch.Tensor]],
    offsets: Sequence[Sequence[int]],
    size: int,
    device: torch.device,
    base: int = 0,
) -> torch.Tensor:
    """This rank's payload in a buffer of ``size`` bytes: its description, then each tensor's bytes at its offset
    (plus ``base``: where the payload starts after words of another kind, a header).

    The one copy of the local states' bytes that the fused sync makes (one ``torch.cat``); padding bytes are zeros,
    not left uninitialised, so nothing of this process's memory travels.
    """
    head = torch.frombuffer(array.array("q", words), dtype=torch.uint8)
    if device.type != "cpu":  # pinned, so the copy neither waits for the device nor counts as a sync
        head = head.pin_memory().to(device, non_blocking=True)
    parts = [head]
    end = head.numel()
    for state_tensors, state_offsets in zip(tensors, offsets, strict=True):
        for tensor, offset in zip(state_tensors, state_offsets, strict=True):
            if offset < 0:
                continue  # reduced, or streamed
            offset += base
            if offset > end:
                parts.append(_zeros(offset - end, device))
            data = as_bytes(tensor)
            parts.append(data)
            end = offset + data.numel()
    if size > end:
        parts.append(_zeros(size - end, device))
    return torch.cat(parts)


_ZEROS: dict[torch.device, tuple[torch.Tensor, list[torch.Tensor]]] = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    """``n`` zero bytes on ``device`` (a view of one kept buffer; read only)."""
    kept = _ZEROS.get(device)
    if kept is None or kept[0].numel() < n:
        zeros = torch.zeros(max(n, 2 * _HEAD_BYTES + INLINE_MAX), dtype=torch.uint8, device=device)
        kept = _ZEROS[device] = (zeros, [zeros[:k] for k in range(ALIGN)])  # the pads between pieces, made once
    return kept[1][n] if n < ALIGN else kept[0][:n]


def unpack(buffer: torch.Tensor, views: Views) -> list[list[torch.Tensor]]:
    """Every piece of one rank's ``buffer`` (its payload, or its stream) viewed back as its dtype and shape (no copy):
    one view of the buffer per dtype, one strided view of that per piece. A piece not in it is :data:`ABSENT`, for
    another buffer to fill; a state left out (reduced) has no pieces."""
    typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
    out: list[list[torch.Tensor]] = []
    for pieces in views:
        if pieces is None:
            out.append([])
            continue
        held = []
        for dtype, shape, strides, at in pieces:
            if at < 0:
                held.append(ABSENT)
                continue
            found = typed.get(dtype)
            if found is None:
                view = buffer.view(dtype)
                found = typed[dtype] = (view, int(view.storage_offset()))
            held.append(found[0].as_strided(shape, strides, found[1] + at))
        out.append(held)
    return out


def absent(views: Views) -> list[list[torch.Tensor]]:
    """What :func:`unpack` gives for a buffer holding none of its pieces."""
    return [[] if pieces is None else [ABSENT] * len(pieces) for pieces in views]


@functools.lru_cache(maxsize=1024)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


#: the stand-in for a piece a buffer does not hold (see :func:`unpack`)
ABSENT = torch.empty(0)


@dataclass(frozen=True)
class Capacity:
    """A group's inline capacity: payload bytes a rank may put in collective 1 (``0``: none), and description words
    every rank reads back from it (at most ``data // 8``)."""

    data: int = 0
    words: int = 0


class Group:
    """What a process group's fused exchanges keep: the needs (largest inline payload and description; ``None`` over
    :data:`INLINE_MAX`) of its last :data:`WINDOW` exchanges, the inline capacity they give, and the kept send buffers.

    Lifecycle: made at the group's first exchange (:meth:`of`, capacity 0, so that exchange costs two collectives);
    agreed at every exchange (:meth:`agree`, on every rank from the same gathered rows, right after collective 1 and
    before anything can raise, so the capacity is the same on every rank of the group); forgotten with the group
    object (weakly keyed: a group made anew starts afresh on every rank) or by ``fused.reset()``, which every rank
    calls at the same point. Nothing else changes it; why that keeps it alike: docs/design.md ("The wire")."""

    _all: ClassVar[weakref.WeakKeyDictionary[Any, Group]] = weakref.WeakKeyDictionary()
    _strong: ClassVar[dict[Any, Group]] = {}  # groups that take no weak reference (kept alive, as the group itself is)

    def __init__(self) -> None:
        self.needs: deque[tuple[int, int] | None] = deque(maxlen=WINDOW)
        self.capacity = Capacity()
        #: collective 1's send buffers by layout (the newest :data:`KEPT`), each with the views its pieces are
        #: copied into and which of the layout's tensors it holds: nothing reads one after its collective returned
        self.sends: dict[tuple[Any, ...], tuple[torch.Tensor, list[torch.Tensor], list[int]]] = {}

    @classmethod
    def of(cls, group: Any) -> Group:
        key = dist.group.WORLD if group is None else group
        try:
            found = cls._all.get(key)
            if found is None:
                found = cls._all[key] = cls()
        except TypeError:
            found = cls._strong.setdefault(key, cls())
        return found

    @classmethod
    def forget(cls) -> None:
        cls._all.clear()
        cls._strong.clear()

    def agree(self, rows: Sequence[Sequence[int]]) -> None:
        """Record one exchange from its gathered header ``rows``."""
        size = max(row[SIZE_REDUCED] for row in rows)
        need = (size, max(row[WORDS] for row in rows)) if size <= INLINE_MAX else None
        # the capacity is a function of the window: where the need a full window drops is the one added (a steady
        # group's, or one whose layouts repeat in a cycle, as alternating batch sizes make), it is unchanged
        unchanged = len(self.needs) == WINDOW and self.needs[0] == need
        self.needs.append(need)
        if unchanged:
            return
        needs = [need for need in self.needs if need is not None]
        if not needs:
            self.capacity = Capacity()
            return
        data = min(max(_power_of_two(max(n for n, _ in needs)), INLINE_MIN), INLINE_MAX)
        self.capacity = Capacity(data, min(_power_of_two(max(w for _, w in needs)), data // 8))


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class First:
    """What collective 1 brought: every rank's header row, its description words where it inlined its payload
    (else ``None``), and its inline region (a view of the receive buffer, the payload's offsets apply to it)."""

    rows: list[list[int]]
    words: list[list[int] | None]
    regions: list[torch.Tensor] = field(default_factory=list)


def gather_first(
    header: Sequence[int],
    words: Sequence[int],
    tensors: Sequence[Sequence[torch.Tensor]],
    offsets: Sequence[Sequence[int]],
    size: int,
    group: Any,
    world_size: int,
    device: torch.device,
) -> First:
    """Collective 1: every rank's header and, where it fits the group's capacity, its payload (``words``, then
    ``tensors`` at ``offsets``, ``size`` bytes in all); one device-to-host read of the headers and descriptions.

    ``header`` is the row without the format tag and the capacity; :data:`FLAG_INLINE` is added to its flags here.
    """
    kept = Group.of(group)
    agreed = kept.capacity
    inline = 0 < size <= agreed.data and len(words) <= agreed.words
    row = [TAG, *header, agreed.data]
    row[FLAGS] |= FLAG_INLINE if inline else 0
    row += [0] * (HEADER_WORDS - len(row))
    total = _HEAD_BYTES + agreed.data
    if inline:
        mine = _pack_kept(kept, [*row, *words], tensors, offsets, total, device)
    else:
        mine = _pack_kept(kept, row, [], [], total, device)
    flat = torch.empty((world_size, total), dtype=torch.uint8, device=mine.device)
    _gather_rows(flat, mine, group)
    del mine
    read = _HEAD_BYTES + 8 * agreed.words
    # the exchange's one device-to-host read: every header and every inline description at once
    table = flat[:, :read].view(torch.int64).tolist()
    rows = [list(t[:HEADER_WORDS]) for t in table]
    described = [
        list(t[HEADER_WORDS : HEADER_WORDS + r[1]]) if r[FLAGS] & FLAG_INLINE else None
        for t, r in zip(table, rows, strict=True)
    ]
    return First(rows, described, list(flat[:, _HEAD_BYTES:].unbind(0)))


KEPT = 8  # send buffers a group keeps


def _pack_kept(
    kept: Group,
    words: Sequence[int],
    tensors: Sequence[Sequence[torch.Tensor]],
    offsets: Sequence[Sequence[int]],
    size: int,
    device: torch.device,
) -> torch.Tensor:
    """:func:`pack` (the pieces after the header) into the send buffer ``kept`` holds for this layout, each piece
    copied into a view made once. The buffer is zeros when made and a layout writes the same bytes of it, so its
    padding stays zeros; the description (``words`` after the header) gives every piece's dtype and shape, so it
    and the offsets are the layout. On CUDA the key holds the current stream too (the collective that read a buffer
    is ordered before the stream's next write by its ``wait()``, not before another stream's); devices other than
    CUDA and the CPU take :func:`pack`."""
    if device.type == "cuda":
        stream: int | None = torch.cuda.current_stream(device).cuda_stream
    elif device.type == "cpu":
        stream = None
    else:
        return pack(words, tensors, offsets, size, device, _HEAD_BYTES)
    at = tuple(itertools.chain.from_iterable(offsets))
    every = list(itertools.chain.from_iterable(tensors))
    key = (device, stream, size, tuple(words[HEADER_WORDS:]), at)
    found = kept.sends.get(key)
    if found is None:
        held = [i for i, (offset, tensor) in enumerate(zip(at, every, strict=True)) if offset >= 0 and tensor.numel()]
        buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        found = kept.sends[key] = (buffer, [_view(buffer, _HEAD_BYTES + at[i], every[i]) for i in held], held)
        while len(kept.sends) > KEPT:
            kept.sends.pop(next(iter(kept.sends)))
    buffer, views, held = found
    head = torch.frombuffer(array.array("q", words), dtype=torch.uint8)
    if device.type != "cpu":  # pinned, so the copy neither waits for the device nor counts as a sync
        head = head.pin_memory()
    buffer[: head.numel()].copy_(head, non_blocking=True)
    internals.copy_all(views, [every[i] for i in held])
    return buffer


def _view(buffer: torch.Tensor, at: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``buffer`` from ``at`` on (a multiple of the dtype's size) viewed as a tensor like ``like``."""
    start = at // like.element_size()
    return buffer.view(like.dtype)[start : start + like.numel()].view(like.shape)


def _gather_rows(flat: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    """Every rank's ``mine`` into its row of ``flat``: into the one tensor where the backend takes it (on the CPU
    from torch 2.13's ``all_gather_single`` on, which saves ``all_gather``'s copy and list checks), else into the
    rows through ``all_gather``."""
    into = getattr(dist, "all_gather_single", None)
    if into is None and flat.device.type == "cuda":
        into = dist.all_gather_into_tensor
    if into is not None:
        into(flat.view(-1), mine, group=group)
    else:
        dist.all_gather(list(flat), mine, group)


def gather_payloads(buffer: torch.Tensor, group: Any, world_size: int) -> list[torch.Tensor]:
    """Collective 2: every rank's payload (all padded to the same size), in group-rank order."""
    flat = torch.empty((world_size, buffer.numel()), dtype=buffer.dtype, device=buffer.device)
    _gather_rows(flat, buffer, group)
    return list(flat)


def words_of(buffer: torch.Tensor, count: int) -> list[int]:
    """The first ``count`` int64 words of a payload: its description."""
    return buffer[: 8 * count].view(torch.int64).tolist()


def forget() -> None:
    """Forget every group's record, the kept pads and the descriptions read once (``fused.reset``)."""
    Group.forget()
    _ZEROS.clear()
    for cached in (read, _tensor_state, _piece, _strides):
        cached.cache_clear()
