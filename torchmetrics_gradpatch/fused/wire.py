"""The fused sync's wire format: a description of a Metric's states, one byte buffer for their data, two collectives.

What one rank sends
-------------------
* A **header** of :data:`HEADER_WORDS` int64 words, the same size on every rank: a format tag, the length of the
  rank's description, the length of its payload, flags (grad mode on, some own tensor requires grad, the rank
  could not prepare its states), a fingerprint of the Metric (class and state names, each state's reduction), the
  length of its payload when the states it proposes to reduce are left out, a digest of that proposal (``0``: none; see
  :mod:`torchmetrics_gradpatch.fused.reduced`) and its chunk size for CPU-held states.
* A **payload** of bytes: the description (int64 words), then every tensor's bytes, each at an offset aligned to
  :data:`ALIGN` so that it can be viewed back as its dtype in place. Left out: the states every rank agreed to
  reduce (:func:`layout`'s ``skip``), *separate* pieces (large ``cat`` states, which cross in a collective apart:
  :mod:`torchmetrics_gradpatch.fused.large`), and *streamed* pieces: tensors held on the CPU while the exchange
  runs on a device, which cross afterwards in chunks (:mod:`torchmetrics_gradpatch.fused.transit`).

``all_gather`` needs the same size on every rank, and a description's size depends on what the rank holds (list
lengths, numbers of dimensions). So the fixed-size header goes first (collective 1) and tells every rank every
payload's size; each rank then pads its payload to the largest and one ``all_gather`` moves every description and
every byte of data at once (collective 2). A sync therefore costs two collectives whatever the states, and every
rank decides what to do next from the same gathered headers and descriptions.

The description: ``[n, *table]`` (``n`` words a caller puts in front: the collection sync's member table; none
for one Metric), the number of states, then per state ``[kind, placeholder, n_pieces]`` and per piece ``[dtype
code, flags (requires_grad, streamed, separate), ndim, *shape]``. A tensor state is one piece; a list state is its
elements. Dtype codes, sizes and alignment are :mod:`torchmetrics_gradpatch._bytes`'s, so they mean the same on
every rank even where a torch lacks some dtype; a dtype a buffer cannot carry is described as
:data:`UNKNOWN_DTYPE` and refused on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch._bytes import ALIGN, as_bytes

__all__ = [
    "ALIGN",
    "FLAG_FAILED",
    "HEADER_WORDS",
    "KIND_LIST",
    "KIND_OTHER",
    "KIND_TENSOR",
    "Piece",
    "State",
    "decode",
    "encode",
    "gather_headers",
    "gather_payloads",
    "layout",
    "pack",
    "piece_of",
    "sendable",
    "unpack",
    "words_of",
]

FORMAT = 0x7467_6673_0004  # "tgfs", format 4: a rank running another format is told so, not misread
HEADER_WORDS = 8
SIZE, FLAGS, FINGERPRINT, SIZE_REDUCED, PLAN, CHUNK = 2, 3, 4, 5, 6, 7  # a header row's words
FLAG_GRAD_MODE = 1
FLAG_REQUIRES_GRAD = 2
FLAG_FAILED = 8  # this rank could not prepare its states: every rank raises after the header

KIND_TENSOR = 0
KIND_LIST = 1
KIND_OTHER = 2  # neither a tensor nor a list of tensors: refused on every rank, see _fused_sync

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

    @property
    def nbytes(self) -> int:
        return _bytes.nbytes(self.shape, self.dtype) if self.dtype is not None else 0


@dataclass(frozen=True)
class State:
    """One state as the description gives it: its kind, its pieces, and whether its one piece is the placeholder
    torchmetrics puts in for an empty ``cat`` list (so it is no data of this rank's)."""

    kind: int
    pieces: tuple[Piece, ...]
    placeholder: bool = False


def sendable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or an empty stand-in when its dtype is unknown to the format (described, refused, never sent)."""
    return tensor if _bytes.plain(tensor.dtype) else torch.empty(0, dtype=torch.uint8)


def piece_of(tensor: torch.Tensor, streamed: bool = False) -> Piece:
    """The description of ``tensor``."""
    dtype = tensor.dtype if _bytes.plain(tensor.dtype) else None
    return Piece(dtype, tuple(tensor.shape), tensor.requires_grad, streamed)


def encode(states: Sequence[State], table: Sequence[int] = ()) -> list[int]:
    """The description as int64 words (see the module docstring), padded to an even count (``ALIGN`` bytes).

    ``table``: words the caller adds in front (the collection sync's member table), given back by :func:`decode`.
    """
    words = [len(table), *table, len(states)]
    for state in states:
        words += [state.kind, int(state.placeholder), len(state.pieces)]
        for piece in state.pieces:
            code = UNKNOWN_DTYPE if piece.dtype is None else _bytes.code(piece.dtype)
            flags = int(piece.requires_grad) | 2 * int(piece.streamed) | 4 * int(piece.separate)
            words += [code, flags, len(piece.shape), *piece.shape]
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
) -> torch.Tensor:
    """This rank's payload in a buffer of ``size`` bytes: its description, then each tensor's bytes at its offset.

    The one copy of the local states' bytes that the fused sync makes; padding bytes are zeroed, not left
    uninitialised, so nothing of this process's memory travels.
    """
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    head = torch.tensor(list(words), dtype=torch.int64).view(torch.uint8)
    buffer[: head.numel()].copy_(head)
    end = head.numel()
    for state_tensors, state_offsets in zip(tensors, offsets, strict=True):
        for tensor, offset in zip(state_tensors, state_offsets, strict=True):
            if offset < 0:
                continue  # reduced, or streamed
            if offset > end:
                buffer[end:offset].zero_()
            data = as_bytes(tensor)
            buffer[offset : offset + data.numel()].copy_(data)
            end = offset + data.numel()
    buffer[end:].zero_()
    return buffer


def unpack(
    buffer: torch.Tensor, states: Sequence[State], offsets: Sequence[Sequence[int]], skip: Sequence[int] = ()
) -> list[list[torch.Tensor]]:
    """Every piece of one rank's ``buffer`` (its payload, or its stream) viewed back as its dtype and shape (views
    into ``buffer``, no copy). A piece not in it (offset ``-1``) is an empty stand-in, for the other buffer to fill;
    a state in ``skip`` (reduced) has no pieces."""
    left_out = set(skip)
    out: list[list[torch.Tensor]] = []
    for s, (state, state_offsets) in enumerate(zip(states, offsets, strict=True)):
        if s in left_out:
            out.append([])
            continue
        out.append(
            [
                buffer[offset : offset + piece.nbytes].view(piece.dtype).view(piece.shape) if offset >= 0 else _ABSENT
                for piece, offset in zip(state.pieces, state_offsets, strict=True)
                if piece.dtype is not None
            ]
        )
    return out


_ABSENT = torch.empty(0)


def gather_headers(header: Sequence[int], group: Any, world_size: int, device: torch.device) -> list[list[int]]:
    """Collective 1: every rank's header, in group-rank order."""
    mine = torch.tensor([FORMAT, *header], dtype=torch.int64, device=device)
    received = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(received, mine, group)
    return torch.stack(received).tolist()


def gather_payloads(buffer: torch.Tensor, group: Any, world_size: int) -> list[torch.Tensor]:
    """Collective 2: every rank's payload (all padded to the same size), in group-rank order."""
    received = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(received, buffer, group)
    return received


def words_of(buffer: torch.Tensor, count: int) -> list[int]:
    """The first ``count`` int64 words of a payload: its description."""
    return buffer[: 8 * count].view(torch.int64).tolist()
