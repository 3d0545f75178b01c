"""Exact reductions: states whose reduction gives the same bits in any order are all-reduced, not gathered. Every
rank follows this rank's proposal (:func:`propose`) only where every rank sent the same digest (:func:`agreed`), so
no state of one rank can make the ranks issue other collectives; :func:`run` then issues one ``all_reduce`` per
operation and transport dtype. Which states, and why: docs/fused-sync.md ("Exact reductions")."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torchmetrics_gradpatch._gather import all_reduce_chunked
from torchmetrics_gradpatch.fused import wire

#: A state smaller than this rides in the payload: its own collective would cost more than the bytes it saves.
REDUCE_MIN_BYTES = 64 * 1024

_INTEGERS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
#: Per floating-point dtype: the integer dtype of its width and the mask of its exponent bits.
_EXPONENTS = {
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float32: (torch.int32, 0x7F80_0000),
    torch.float64: (torch.int64, 0x7FF0_0000_0000_0000),
}


class Reduced(NamedTuple):
    """One reduced slot: the operation (``sum``, ``max``, ``min``), the dtype it is reduced in (``transport``) and
    comes out as (``result``), and whether it is held on the CPU and streamed."""

    slot: int
    op: str
    transport: torch.dtype
    result: torch.dtype
    shape: tuple[int, ...]
    streamed: bool


class Proposal(NamedTuple):
    """This rank's proposal: the slots it would reduce and the digest every rank compares (``0``: none)."""

    entries: tuple[Reduced, ...] = ()
    digest: int = 0
    slots: tuple[int, ...] = ()


@functools.cache
def _result_dtype(reduction: Any, dtype: torch.dtype) -> torch.dtype | None:
    """What ``reduction`` over a stack of ``dtype`` gives on this torch (``None``: it fails)."""
    try:
        return reduction(torch.zeros(1, dtype=dtype)).dtype  # type: ignore[no-any-return]
    except Exception:  # a dtype this torch cannot reduce: gathered, as torchmetrics does
        return None


def propose(slots: Sequence[Any], table: Sequence[int] = ()) -> Proposal:
    """This rank's proposal for the exchange's ``slots``; ``table`` (a collection's member table) enters the digest,
    so ranks whose members map to other slots do not agree."""
    from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum

    ops = ((dim_zero_sum, "sum"), (dim_zero_max, "max"), (dim_zero_min, "min"))
    entries = []
    for index, slot in enumerate(slots):
        described = slot.described
        # the cheap tests first: a steady sync's many small states are none of these
        if described.kind != wire.KIND_TENSOR or len(slot.tensors) != 1:
            continue
        tensor, piece = slot.tensors[0], described.pieces[0]
        if piece.dtype is None or piece.requires_grad or piece.nbytes < REDUCE_MIN_BYTES:
            continue
        op = next((name for known, name in ops if known is slot.reduction), None)  # any reduction, hashable or not
        if op is None:
            continue
        if piece.dtype in _INTEGERS:
            transport = torch.int64
        elif piece.dtype in _EXPONENTS and op != "sum":
            transport = torch.float64 if piece.dtype == torch.float64 else torch.float32
        else:
            continue
        result = torch.int64 if op == "sum" else piece.dtype
        if _result_dtype(slot.reduction, piece.dtype) != result:
            continue
        if piece.dtype in _EXPONENTS:
            # a max or min gives the same bits in any order and floating-point mode only without NaN, -0.0 and
            # subnormals (read from the bits, which set_flush_denormal cannot change)
            as_int, exponent = _EXPONENTS[piece.dtype]
            bits = tensor.view(as_int)
            if bool(torch.isnan(tensor).any()) or bool((((bits & exponent) == 0) & (bits != 0)).any()):
                continue
        entries.append(Reduced(index, op, transport, result, piece.shape, piece.streamed))
    if not entries:
        return Proposal()
    text = repr((list(table), [(e.slot, e.op, str(e.transport), str(e.result), e.shape, e.streamed) for e in entries]))
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1 | 1
    return Proposal(tuple(entries), digest, tuple(e.slot for e in entries))


def agreed(rows: Sequence[Sequence[int]], proposal: Proposal) -> bool:
    """Whether every rank follows the proposal: every rank sent this rank's non-zero digest."""
    return proposal.digest != 0 and all(row[wire.PROPOSAL] == proposal.digest for row in rows)


def run(exchange: Any, chunk: int) -> dict[int, torch.Tensor]:
    """``exchange``'s agreed reductions (read, not changed): per slot, its value as torchmetrics' stacked reduction
    gives it. Streamed slots are reduced on the CPU, crossing on its staging device in chunks of ``chunk`` bytes, and
    come back there."""
    proposal, slots, group, staging = exchange.proposal, exchange.slots, exchange.group, exchange.staging
    groups: dict[tuple[Any, torch.dtype, bool], list[Reduced]] = {}
    for entry in proposal.entries:
        reduce_op = dist.ReduceOp.SUM if entry.op == "sum" else dist.ReduceOp.MAX
        groups.setdefault((reduce_op, entry.transport, entry.streamed), []).append(entry)
    out: dict[int, torch.Tensor] = {}
    for (reduce_op, _, streamed), members in groups.items():
        where = torch.device("cpu") if streamed else exchange.device
        # a min crosses as the max of its bitwise complement (integers) or of its negation
        flat = torch.cat(
            [_flip(e, slots[e.slot].tensors[0].detach().to(where, e.transport).reshape(-1)) for e in members]
        )
        if streamed and staging is not None:
            all_reduce_chunked(flat, reduce_op, group, staging, chunk)
        else:
            dist.all_reduce(flat, reduce_op, group)
        for entry, part in zip(members, torch.split(flat, [math.prod(e.shape) for e in members]), strict=True):
            out[entry.slot] = _flip(entry, part).to(entry.result).view(entry.shape)
    return out


def _flip(entry: Reduced, flat: torch.Tensor) -> torch.Tensor:
    if entry.op != "min":
        return flat
    return torch.bitwise_not(flat) if entry.transport == torch.int64 else torch.neg(flat)


def forget() -> None:
    """Forget the result dtypes found once (``fused.reset``)."""
    _result_dtype.cache_clear()
