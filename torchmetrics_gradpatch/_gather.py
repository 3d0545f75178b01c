"""Local mode's gather (torchmetrics 1.6.0's ``gather_all_tensors`` on any torchmetrics) and what both modes share.

Contract: the unpatched gather's collectives in its order, its results and its errors, except that the caller's
entry is its own tensor, graph and all; a CPU tensor under NCCL crosses on the CUDA device in chunks and comes back
on the CPU. See docs/design.md ("What each rank gets back") and docs/fused-sync.md ("States held on the CPU").
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional name

CHUNK_ENV = "TORCHMETRICS_GRADPATCH_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 32 * 2**20
#: The largest chunk size accepted: it crosses in an int64 header word, and sums of it must stay int64 too.
MAX_CHUNK_BYTES = 2**62
#: How every error raised alike on every rank after an exchange ends.
RAISED_ALIKE = "Every rank of the group raised this error after the same exchange; none is left waiting."


def chunk_bytes() -> int:
    """The most bytes per rank a CPU-held tensor puts on the device at once: ``TORCHMETRICS_GRADPATCH_CHUNK_BYTES``
    (default 32 MiB), read at every sync, so it is the one place to set it. ``0`` for a value that is not a whole
    number from 1 to :data:`MAX_CHUNK_BYTES`: callers exchange it, and every rank refuses alike
    (:func:`chunk_refusal`), so a value one rank cannot use never leaves the others waiting."""
    raw = os.environ.get(CHUNK_ENV, "").strip()
    if not raw:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(raw)
    except ValueError:
        return 0
    return value if 0 < value <= MAX_CHUNK_BYTES else 0


def chunk_refusal(sizes: Sequence[int]) -> str | None:
    """The error text when some rank's chunk size (``sizes``, by rank) is not valid; ``None`` when all are."""
    bad = [rank for rank, size in enumerate(sizes) if size < 1]
    if not bad:
        return None
    return (
        f"torchmetrics_gradpatch: {CHUNK_ENV} is not a whole number of bytes from 1 to {MAX_CHUNK_BYTES} on rank(s) "
        f"{bad}. Set it alike on every rank (default {DEFAULT_CHUNK_BYTES}), or unset it. {RAISED_ALIKE}"
    )


def staging_device(group: Any) -> torch.device | None:
    """The device CPU-held tensors cross on for ``group``: the current CUDA device where the group takes device
    tensors only (NCCL), ``None`` where it takes CPU tensors as they are (gloo, or a group with a CPU backend)."""
    global _last_cpu_group
    # This runs at every gather of a CPU tensor, and a group's backends never change: the group that last took CPU
    # tensors answers in tens of nanoseconds (a weak reference: a destroyed group is not kept alive), any group
    # once seen in a dictionary lookup, and torch.distributed's lookup (microseconds) runs once per group object.
    if group is not None and _last_cpu_group() is group:
        return None
    try:
        cpu_ok = _CPU_OK[group]
    except (KeyError, TypeError):  # not seen yet; or None, or an object without weak references: not kept
        backend = str(dist.get_backend(group)).lower()
        cpu_ok = "cpu:" in backend if ":" in backend else backend != "nccl"
        with contextlib.suppress(TypeError):
            _CPU_OK[group] = cpu_ok
    if cpu_ok:
        with contextlib.suppress(TypeError):
            _last_cpu_group = weakref.ref(group)
        return None
    return torch.device("cuda", torch.cuda.current_device())  # read at every call: the caller may switch devices


_CPU_OK: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_last_cpu_group: Callable[[], Any] = type(None)  # called: None, which is no group


def _gather_into(out: torch.Tensor, n: int, rank: int, world_size: int, group: Any) -> None:
    """All-gather each rank's ``out[rank * n : (rank + 1) * n]`` into ``out``, in place: on NCCL into the one flat
    tensor (no further device buffer), elsewhere through views of it."""
    mine = out[rank * n : (rank + 1) * n]
    if out.device.type == "cuda":
        into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        into(out, mine, group=group)
    else:
        dist.all_gather([out[r * n : (r + 1) * n] for r in range(world_size)], mine.clone(), group)


def all_gather_chunked(
    receive: Sequence[torch.Tensor | None],
    fill: Callable[[torch.Tensor, int], None],
    total: int,
    group: Any,
    rank: int,
    device: torch.device,
    chunk: int,
) -> int:
    """All-gather ``total`` bytes from every rank through ``device``, at most ``chunk`` bytes per rank at a time.

    ``fill(dst, start)`` writes this rank's bytes ``[start, start + dst.numel())`` into the ``uint8`` tensor
    ``dst``; rank ``r``'s bytes land in ``receive[r]`` (``uint8``; ``None``: not wanted, this rank's own; bytes past
    its size are dropped). Every rank must pass the same ``total`` and ``chunk``. Returns the collectives issued:
    ``ceil(total / chunk)``. The device holds one chunk per rank at a time.
    """
    world_size = len(receive)
    count = 0
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        out = torch.empty(world_size * n, dtype=torch.uint8, device=device)
        fill(out[rank * n : (rank + 1) * n], start)
        _gather_into(out, n, rank, world_size, group)
        for r, target in enumerate(receive):
            if target is not None and start < target.numel():
                end = min(target.numel(), start + n)
                target[start:end].copy_(out[r * n : r * n + end - start])
        count += 1
    return count


def all_reduce_chunked(flat: torch.Tensor, op: Any, group: Any, device: torch.device, chunk: int) -> int:
    """``dist.all_reduce`` of the 1-d ``flat`` in place, through ``device`` at most ``chunk`` bytes at a time.

    Every rank must pass the same numel, dtype and ``chunk``. Returns the collectives issued.
    """
    step = max(1, chunk // flat.element_size())
    count = 0
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        moved = part.to(device, copy=True)
        dist.all_reduce(moved, op, group)
        part.copy_(moved)
        count += 1
    return count


def _all_gather(buffers: list[torch.Tensor], tensor: torch.Tensor, group: Any) -> None:
    """``dist.all_gather``, under ``no_grad`` only when ``tensor`` has a graph to keep out (this runs at every sync)."""
    if tensor.requires_grad:
        with torch.no_grad():
            dist.all_gather(buffers, tensor, group)
    else:
        dist.all_gather(buffers, tensor, group)


def exchange(tensor: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
    """Every rank's ``tensor`` (the same size on every rank) as the rows of one tensor, row ``r`` rank ``r``'s: one
    ``all_gather`` into zeroed rows, on ``tensor``'s device."""
    received = torch.zeros((world_size, tensor.numel()), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather(list(received.unbind()), tensor, group)
    return received


def _pad(shapes: Sequence[Sequence[int]], rank: int) -> list[int]:
    """``F.pad``'s widths that bring rank ``rank``'s tensor to the largest size on every dimension of ``shapes``."""
    most = [max(sizes) for sizes in zip(*shapes, strict=True)]
    pad: list[int] = []
    for have, top in zip(reversed(shapes[rank]), reversed(most), strict=True):
        pad.extend((0, top - have))
    return pad


def _trimmed(
    result: torch.Tensor, buffers: Sequence[torch.Tensor | None], shapes: Sequence[Sequence[int]], rank: int
) -> list[torch.Tensor]:
    """Each rank's padded buffer trimmed back to its shape, and ``result`` itself at ``rank``. A tuple index: a
    list index is deprecated from torch 2.8 and warns."""
    return [
        result if r == rank else buffer[tuple(slice(n) for n in shape)]  # type: ignore[index]
        for r, (buffer, shape) in enumerate(zip(buffers, shapes, strict=True))
    ]


def _gather_equal(
    result: torch.Tensor,
    world_size: int,
    group: Any,
    rank: int,
    new_buffer: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """Every rank's tensor has ``result``'s shape: one ``all_gather``, then the caller's own entry put back."""
    entries = [new_buffer(result) for _ in range(world_size)]  # *_like factories never copy requires_grad
    _all_gather(entries, result, group)
    if entries:  # none on a non-member of ``group`` (world size -1): the unpatched gather returns [] there
        entries[rank] = result
    return entries


def gather_entries(
    result: torch.Tensor,
    shapes: Sequence[Sequence[int]],
    group: Any,
    rank: int,
    new_buffer: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like,
) -> list[torch.Tensor]:
    """One ``all_gather`` of the data, given every rank's shape (``shapes``, all lists or all tuples): one entry per
    rank, ``result`` itself at ``rank`` (the caller's rank within ``group``), every other entry without a graph.

    Uneven shapes are padded to the largest and trimmed back. Both modes' forwards use it, so they trim and order
    entries alike. ``new_buffer`` allocates the receive buffers: torchmetrics' zeroed ones in local mode,
    ``torch.empty_like`` in global mode, whose ranks have agreed on dtype and shapes first.
    """
    if shapes.count(shapes[0]) == len(shapes):  # one C-level pass; this runs at every sync of every metric state
        return _gather_equal(result, len(shapes), group, rank, new_buffer)
    with torch.no_grad():
        padded = F.pad(result, _pad(shapes, rank))  # a copy, conjugate and negative views resolved
        buffers = [new_buffer(padded) for _ in shapes]
        dist.all_gather(buffers, padded, group)
    del padded  # no gathered copy of the caller's own tensor outlives the call
    return _trimmed(result, buffers, shapes, rank)


def size_and_rank(group: Any) -> tuple[int, int]:
    """``group``'s size and this process's rank within it, as ``dist.get_world_size`` / ``dist.get_rank`` give them.

    A process group object answers with C++ getters, far cheaper; anything else (an uninitialised default group, a
    non-member's placeholder) goes through those functions, so their errors and answers stay as they are.
    """
    if isinstance(group, dist.ProcessGroup):
        return group.size(), group.rank()
    return dist.get_world_size(group), dist.get_rank(group)


def gather_local(result: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
    """Gather ``result`` from every rank of ``group`` (``None``: the default group), in group-rank order; the entry
    at this rank's index is ``result.contiguous()`` itself, graph and all, every other entry a plain tensor."""
    if group is None:
        group = dist.group.WORLD

    # Same order of operations as upstream (contiguous, group size, barrier), so errors are the same.
    result = result.contiguous()
    world_size, rank = size_and_rank(group)
    dist.barrier(group=group)
    staging = staging_device(group) if result.is_cpu and world_size > 0 else None  # is_cpu: 5x device.type's speed
    if staging is not None:
        return _gather_staged(result, world_size, group, rank, staging)

    if result.ndim == 0:
        return _gather_equal(result, world_size, group, rank, torch.zeros_like)

    local_size = torch.tensor(result.shape, device=result.device)
    local_sizes = [torch.zeros_like(local_size) for _ in range(world_size)]
    dist.all_gather(local_sizes, local_size, group=group)
    if not local_sizes:  # a non-member of ``group``: the unpatched gather fails in ``torch.stack`` of no sizes
        torch.stack(local_sizes)
    return gather_entries(result, [size.tolist() for size in local_sizes], group, rank)


def _gather_staged(
    result: torch.Tensor, world_size: int, group: Any, rank: int, staging: torch.device
) -> list[torch.Tensor]:
    """:func:`gather_local` for a CPU tensor under a group that takes device tensors only (NCCL): the shapes and
    each rank's chunk size cross on ``staging`` in one ``all_gather`` (scalars too), then the padded data in chunks
    of the smallest chunk size; the entries are CPU tensors, as on gloo."""
    local = torch.tensor([*result.shape, chunk_bytes()], dtype=torch.int64, device=staging)
    rows = exchange(local, group, world_size).tolist()
    refusal = chunk_refusal([row[-1] for row in rows])
    if refusal is not None:
        raise ValueError(refusal)
    shapes = [row[:-1] for row in rows]
    pad = _pad(shapes, rank)
    with torch.no_grad():
        padded = F.pad(result, pad) if any(pad) else result.detach()
        buffers = [torch.zeros_like(padded) if r != rank else None for r in range(world_size)]
        mine = padded.reshape(-1).view(torch.uint8)

        def fill(dst: torch.Tensor, start: int) -> None:
            dst.copy_(mine[start : start + dst.numel()])

        receive = [b.reshape(-1).view(torch.uint8) if b is not None else None for b in buffers]
        all_gather_chunked(receive, fill, mine.numel(), group, rank, staging, min(row[-1] for row in rows))
    return _trimmed(result, buffers, shapes, rank)
