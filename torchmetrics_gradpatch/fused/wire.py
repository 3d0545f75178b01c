"""The fused exchange's wire format: a rank sends a header row of :data:`HEADER_WORDS` int64 words, then its payload,
its description (:func:`encode`) and each piece's bytes, which are viewed back in place. :class:`Group` holds what
must evolve alike on every rank of a group, its agreed inline capacity. The format, the capacity rule and why every
rank holds the same capacity: docs/design.md ("The wire")."""

from __future__ import annotations

import array
import functools
import itertools
import math
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch.fused import internals

ALIGN = _bytes.ALIGN  # every piece starts at a multiple of it
TAG = 0x7467_6673_0006  # "tgfs", format 6: a rank running another format of this header size is told so
HEADER_WORDS = 10  # 80 bytes: a multiple of ALIGN, so an inline payload's pieces can be viewed in place
# a header row's fields, as docs/design.md ("The wire") gives them; the words after them are zeros
FORMAT, WORDS, SIZE, FLAGS, FINGERPRINT, SIZE_REDUCED, PROPOSAL, CHUNK, CAPACITY = range(9)
FLAG_GRAD_MODE = 1
FLAG_REQUIRES_GRAD = 2
FLAG_FAILED = 8  # this rank could not prepare its states: every rank raises after the header
FLAG_INLINE = 16  # this rank's payload (its proposal's layout) is in collective 1
FLAG_UNSTAGED = 32  # a collection step's rank that sends its member table alone (it ran no member yet)
FLAG_ASIDE = 64  # this rank runs torchmetrics' own path here: every rank does (docs/fused-sync.md, stepping aside)
FLAG_CHECK = 128  # this rank runs in check mode: every rank must

INLINE_MAX = 64 * 1024  # the largest inline capacity: a payload over it always takes collective 2
INLINE_MIN = 256  # the smallest non-zero inline capacity (a few states' description and data)
WINDOW = 32  # how many of a group's recent exchanges the capacity follows
KEPT = 8  # collective 1's send buffers a group keeps
_HEAD_BYTES = 8 * HEADER_WORDS

# a state's kind (other: neither a tensor nor a list of tensors, refused on every rank by Exchange.validate)
KIND_TENSOR, KIND_LIST, KIND_OTHER = range(3)

UNKNOWN_DTYPE = -1  # a dtype a packed buffer cannot carry (no code is negative)


@dataclass(frozen=True)
class Piece:
    """One tensor as a description gives it (``dtype`` ``None``: unknown to the format); ``streamed``: held on the
    CPU while the exchange runs on a device (:mod:`.transit`); ``separate``: out of the payload (:mod:`.large`)."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]
    requires_grad: bool
    streamed: bool = False
    separate: bool = False

    @functools.cached_property
    def nbytes(self) -> int:
        return _bytes.nbytes(self.shape, self.dtype) if self.dtype is not None else 0


@dataclass(frozen=True)
class State:
    """One state as a description gives it; ``placeholder``: its one piece is the stand-in torchmetrics puts in for
    an empty ``cat`` list, no data of this rank's."""

    kind: int
    pieces: tuple[Piece, ...]
    placeholder: bool = False

    @functools.cached_property
    def words(self) -> tuple[int, ...]:  # made once: a steady exchange describes the same objects
        words = [self.kind, int(self.placeholder), len(self.pieces)]
        for piece in self.pieces:
            code = UNKNOWN_DTYPE if piece.dtype is None else _bytes.code(piece.dtype)
            flags = int(piece.requires_grad) | 2 * int(piece.streamed) | 4 * int(piece.separate)
            words += [code, flags, len(piece.shape), *piece.shape]
        return tuple(words)


def piece_of(tensor: torch.Tensor, streamed: bool = False) -> Piece:
    """The description of ``tensor``."""
    return _tensor_state(tensor.dtype, tuple(tensor.shape), tensor.requires_grad, streamed).pieces[0]


def tensor_state(tensor: torch.Tensor, streamed: bool = False) -> State:
    """The description of a tensor state holding ``tensor``."""
    return _tensor_state(tensor.dtype, tuple(tensor.shape), tensor.requires_grad, streamed)


# a steady exchange describes the same tensors step after step: one object each, its nbytes and words made once
@functools.lru_cache(maxsize=2048)
def _tensor_state(dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, streamed: bool) -> State:
    return State(KIND_TENSOR, (Piece(dtype if _bytes.plain(dtype) else None, shape, requires_grad, streamed),))


def encode(states: Sequence[State], table: Sequence[int] = ()) -> list[int]:
    """The description as int64 words, padded to an even count (``ALIGN`` bytes); ``table``: words the caller puts
    in front (a collection's member table), given back by :func:`decode`."""
    words = [len(table), *table, len(states)]
    for state in states:
        words += state.words
    return words + [0] * (len(words) % 2)


def decode(words: Sequence[int]) -> tuple[list[int], list[State]]:
    """The inverse of :func:`encode`: the table and the states (trailing padding ignored)."""
    at = iter(words)
    table = list(itertools.islice(at, next(at)))
    states = []
    for _ in range(next(at)):
        kind, placeholder, n_pieces = itertools.islice(at, 3)
        pieces = []
        for _ in range(n_pieces):
            code, flags, ndim = itertools.islice(at, 3)
            shape = tuple(itertools.islice(at, ndim))
            dtype = _bytes.dtype_of(code)
            known = dtype if dtype is not None and _bytes.plain(dtype) else None
            pieces.append(Piece(known, shape, bool(flags & 1), bool(flags & 2), bool(flags & 4)))
        states.append(State(kind, tuple(pieces), bool(placeholder)))
    return table, states


#: how to view one rank's pieces in a buffer: per state, ``None`` where it is left out (reduced), else per piece of
#: a known dtype its dtype, shape, strides and offset in elements (``-1``: not in this buffer)
Views = tuple[tuple[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int], ...] | None, ...]


class Described(NamedTuple):
    """A rank's description read back, with its payload's offsets and size (the reduced states left out)."""

    table: tuple[int, ...]
    states: tuple[State, ...]
    offsets: list[list[int]]
    size: int
    streams: bool  # some piece is streamed
    separates: bool  # some piece is sent apart
    views: Views


@functools.lru_cache(maxsize=128)
def read(words: tuple[int, ...], skip: tuple[int, ...] = ()) -> Described:
    """The description ``words`` read back, the states ``skip`` left out of its payload (read once per description:
    the result is shared, callers do not change it)."""
    table, states = decode(words)
    pieces = [piece for state in states for piece in state.pieces]
    offsets, size = layout(states, 8 * len(words), skip)
    streams, separates = any(p.streamed for p in pieces), any(p.separate for p in pieces)
    return Described(tuple(table), tuple(states), offsets, size, streams, separates, views(states, offsets, skip))


def views(states: Sequence[State], offsets: Sequence[Sequence[int]], skip: Sequence[int]) -> Views:
    """How to view each piece of a buffer laid out by ``offsets`` (:func:`layout`)."""
    return tuple(
        None
        if s in skip
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
    """Each piece's byte offset in the payload (from ``start`` on, each aligned), and the payload's size; with
    ``streamed``, in the stream instead. A piece not in it (of a reduced state in ``skip``, separate, or of the other
    buffer) has offset ``-1``."""
    offsets: list[list[int]] = []
    end, left_out = _bytes.aligned(start), set(skip)
    for s, state in enumerate(states):
        offsets.append([])
        for piece in state.pieces:
            if s in left_out or piece.separate or piece.streamed != streamed:
                offsets[-1].append(-1)
            else:
                offsets[-1].append(end)
                end = _bytes.aligned(end + piece.nbytes)
    return offsets, end


def pack(
    words: Sequence[int],
    tensors: Sequence[Sequence[torch.Tensor]],
    offsets: Sequence[Sequence[int]],
    size: int,
    device: torch.device,
    base: int = 0,
    kept: Group | None = None,
) -> torch.Tensor:
    """This rank's payload in a zeroed buffer of ``size`` bytes (no byte of this process's memory travels): ``words``,
    then each tensor's bytes at its offset plus ``base`` (where the payload starts after a header). With ``kept``, the
    buffer it keeps per layout (words after ``base``, offsets: its padding stays zeros) and on CUDA per current stream
    (a collective's ``wait()`` orders only that stream's next write); on devices but CUDA and the CPU, a new one."""
    pairs = zip(itertools.chain.from_iterable(offsets), itertools.chain.from_iterable(tensors), strict=True)
    sent = [(at, tensor) for at, tensor in pairs if at >= 0 and tensor.numel()]  # a key's are the same
    found = key = None
    if kept is not None and device.type in ("cuda", "cpu"):
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        key = (device, stream, size, tuple(words[base // 8 :]), tuple(itertools.chain.from_iterable(offsets)))
        found = kept.sends.get(key)
    if found is None:
        buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        found = (buffer, [buffer[base + at :].view(t.dtype)[: t.numel()].view(t.shape) for at, t in sent])
        if kept is not None and key is not None:
            kept.sends[key] = found
            while len(kept.sends) > KEPT:
                kept.sends.pop(next(iter(kept.sends)))
    buffer, places = found
    head = torch.frombuffer(array.array("q", words), dtype=torch.uint8)
    if buffer.device.type != "cpu":  # pinned, so the copy neither waits for the device nor counts as a sync
        head = head.pin_memory()
    buffer[: head.numel()].copy_(head, non_blocking=True)
    internals.copy_all(places, [tensor for _, tensor in sent])  # the exchange sends under no_grad
    return buffer


#: the stand-in for a piece a buffer does not hold (see :func:`unpack`)
ABSENT = torch.empty(0)


def unpack(buffer: torch.Tensor, views: Views) -> list[list[torch.Tensor]]:
    """Every piece of one rank's ``buffer`` (its payload, or its stream) viewed back as its dtype and shape, without
    a copy; a piece not in it is :data:`ABSENT`, and a state left out (reduced) has no pieces."""
    typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # one view of the buffer per dtype
    out: list[list[torch.Tensor]] = []
    for pieces in views:
        held = []
        for dtype, shape, strides, at in pieces or ():
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


@functools.lru_cache(maxsize=1024)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides."""
    return tuple(math.prod(max(size, 1) for size in shape[i + 1 :]) for i in range(len(shape)))


class Capacity(NamedTuple):
    """A group's inline capacity: payload bytes a rank may put in collective 1 (``0``: none), and description words
    every rank reads back from it (at most ``data // 8``)."""

    data: int = 0
    words: int = 0


class Group:
    """What a process group's fused exchanges keep: the needs of its last :data:`WINDOW` exchanges, the capacity they
    give, and the kept send buffers. Made at its first exchange (:meth:`of`), agreed at every one (:meth:`agree`),
    forgotten with the group object or by ``fused.reset()``: nothing else changes it (docs/design.md, "The wire")."""

    _all: ClassVar[weakref.WeakKeyDictionary[Any, Group]] = weakref.WeakKeyDictionary()
    _strong: ClassVar[dict[Any, Group]] = {}  # groups that take no weak reference (kept alive, as the group itself is)

    def __init__(self) -> None:
        self.needs: deque[tuple[int, int] | None] = deque(maxlen=WINDOW)  # bytes and words; None: over INLINE_MAX
        self.capacity = Capacity()
        #: collective 1's send buffers by layout (the newest :data:`KEPT`), each with the views its pieces are
        #: copied into: nothing reads one after its collective returned
        self.sends: dict[tuple[Any, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    @classmethod
    def of(cls, group: Any) -> Group:
        key = dist.group.WORLD if group is None else group
        try:
            return cls._all[key]
        except KeyError:
            return cls._all.setdefault(key, cls())
        except TypeError:  # no weak reference to it
            return cls._strong.setdefault(key, cls())

    def agree(self, rows: Sequence[Sequence[int]]) -> None:
        """Record one exchange from its gathered header ``rows`` (every rank, right after collective 1)."""
        size = max(row[SIZE_REDUCED] for row in rows)
        need = (size, max(row[WORDS] for row in rows)) if size <= INLINE_MAX else None
        # the capacity is a function of the window: where the need a full window drops is the one added (a steady
        # group's, or one whose layouts repeat in a cycle, as alternating batch sizes make), it is unchanged
        unchanged = len(self.needs) == WINDOW and self.needs[0] == need
        self.needs.append(need)
        if unchanged:
            return
        needs = [need for need in self.needs if need is not None]
        data = min(max(_power_of_two(max(n for n, _ in needs)), INLINE_MIN), INLINE_MAX) if needs else 0
        self.capacity = Capacity(data, min(_power_of_two(max((w for _, w in needs), default=0)), data // 8))


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def gather_first(
    header: Sequence[int],
    words: Sequence[int],
    tensors: Sequence[Sequence[torch.Tensor]],
    offsets: Sequence[Sequence[int]],
    size: int,
    group: Any,
    world_size: int,
    device: torch.device,
) -> tuple[list[list[int]], list[list[int] | None], list[torch.Tensor]]:
    """Collective 1: every rank's header row and, where it fits the group's capacity, its payload (``words``, then
    ``tensors`` at ``offsets``: ``size`` bytes). Returns every rank's row, its description where inline (else
    ``None``) and its inline region (a view of the receive buffer). ``header``: the row without tag and capacity."""
    kept = Group.of(group)
    agreed = kept.capacity
    inline = 0 < size <= agreed.data and len(words) <= agreed.words
    row = [TAG, *header, agreed.data]
    row[FLAGS] |= FLAG_INLINE if inline else 0
    row += [0] * (HEADER_WORDS - len(row))
    if not inline:
        words, tensors, offsets = [], [], []
    total = _HEAD_BYTES + agreed.data
    mine = pack([*row, *words], tensors, offsets, total, device, _HEAD_BYTES, kept)
    flat = gather_rows(mine, group, world_size)
    del mine
    # the exchange's one device-to-host read: every header and every inline description at once
    table = flat[:, : _HEAD_BYTES + 8 * agreed.words].view(torch.int64).tolist()
    inline_words = [t[HEADER_WORDS : HEADER_WORDS + t[WORDS]] if t[FLAGS] & FLAG_INLINE else None for t in table]
    return [t[:HEADER_WORDS] for t in table], inline_words, list(flat[:, _HEAD_BYTES:].unbind(0))


def gather_rows(mine: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
    """Every rank's ``mine`` (collective 1's row, or collective 2's payload, padded alike) in its row of a new tensor,
    gathered into it where the backend takes one tensor (on the CPU from torch 2.13's ``all_gather_single`` on,
    saving ``all_gather``'s copy and list checks)."""
    flat = torch.empty((world_size, mine.numel()), dtype=mine.dtype, device=mine.device)
    into = getattr(dist, "all_gather_single", None)
    if into is None and flat.device.type == "cuda":
        into = dist.all_gather_into_tensor
    if into is not None:
        into(flat.view(-1), mine, group=group)
    else:
        dist.all_gather(list(flat), mine, group)
    return flat


def words_of(buffer: torch.Tensor, count: int) -> list[int]:
    """The first ``count`` int64 words of a payload: its description."""
    return buffer[: 8 * count].view(torch.int64).tolist()


def forget() -> None:
    """Forget every group's record and the descriptions read once (``fused.reset``)."""
    Group._all.clear()
    Group._strong.clear()
    for cached in (read, _tensor_state, _strides):
        cached.cache_clear()
