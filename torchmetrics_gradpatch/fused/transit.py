"""Where the fused sync's exchange runs, and how states held on the CPU cross when it runs on a device.

NCCL takes CUDA tensors only, and users keep states on the CPU (``compute_on_cpu=True``, or a Metric left on the
CPU) because they do not fit the GPU (torchmetrics #2477). So (:func:`devices`):

* the **exchange device** is the Metric's device; for a Metric on the CPU under a group that takes device tensors
  only (:func:`torchmetrics_gradpatch._gather.staging_device`), the current CUDA device. Headers and payloads live
  there. Gloo groups are unchanged: a CPU Metric exchanges on the CPU.
* a tensor held on the CPU while the exchange device is not the CPU (or while the group stages) is **streamed**:
  described in the payload, but its bytes cross afterwards (:func:`receive_stream`), every rank's streamed bytes
  one after another, in chunks of at most the agreed chunk size per rank through the staging device (gloo: in one
  piece, on the CPU), into CPU buffers. So the device never holds more than a chunk per rank of a CPU-held state,
  and what comes back is on the CPU, where torchmetrics keeps it.

Every rank computes the number of chunk collectives from the exchanged descriptions and the smallest chunk size
any rank sent in its header, so every rank issues the same ones.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from torchmetrics_gradpatch import _bytes, _gather
from torchmetrics_gradpatch.fused import wire

__all__ = ["devices", "forget", "receive_stream"]


def devices(metric_device: Any, group: Any) -> tuple[torch.device, torch.device | None, bool]:
    """The exchange device, the staging device (``None``: the group takes CPU tensors) and whether CPU-held
    tensors are streamed, for a Metric on ``metric_device`` syncing over ``group``."""
    staging = _gather.staging_device(group)
    device = torch.device(metric_device)
    if device.type == "cpu" and staging is not None:
        device = staging
    return device, staging, staging is not None or device.type != "cpu"


@functools.lru_cache(maxsize=128)
def _stream_layout(states: tuple[wire.State, ...], skip: tuple[int, ...]) -> tuple[list[list[int]], int]:
    # a steady exchange streams what it streamed before: its layout is read once
    return wire.layout(states, 0, skip, streamed=True)


def receive_stream(
    gathered: list[list[list[torch.Tensor]]],
    own: Sequence[Sequence[torch.Tensor]],
    every: Sequence[Sequence[wire.State]],
    skip: Sequence[int],
    rank: int,
    group: Any,
    staging: torch.device | None,
    chunk: int,
) -> int:
    """Move every rank's streamed pieces into ``gathered[r][s][i]`` (CPU tensors), in place; return the number of
    collectives issued (none when no rank streams anything).

    ``own[s]`` are this rank's tensors of slot ``s``; ``every[r]`` rank ``r``'s description; ``skip`` the reduced
    slots; ``chunk`` the agreed chunk size (used when ``staging`` is a device).
    """
    layouts = [_stream_layout(tuple(states), tuple(skip)) for states in every]
    total = max(size for _, size in layouts)
    if total == 0:
        return 0
    mine = [
        (offset, _bytes.as_bytes(tensor))
        for tensors, offsets in zip(own, layouts[rank][0], strict=True)
        for tensor, offset in zip(tensors, offsets, strict=True)
        if offset >= 0
    ]

    def fill(dst: torch.Tensor, start: int) -> None:
        dst.zero_()  # padding carries zeros, not this process's memory
        end = start + dst.numel()
        for offset, data in mine:
            lo, hi = max(start, offset), min(end, offset + data.numel())
            if lo < hi:
                dst[lo - start : hi - start].copy_(data[lo - offset : hi - offset])

    receive = [None if r == rank else torch.empty(size, dtype=torch.uint8) for r, (_, size) in enumerate(layouts)]
    transit = staging if staging is not None else torch.device("cpu")
    count = _gather.all_gather_chunked(
        receive, fill, total, group, rank, transit, chunk if staging is not None else total
    )
    for r, buffer in enumerate(receive):
        if buffer is None:
            continue
        streamed = wire.unpack(buffer, every[r], layouts[r][0], skip)
        for s, pieces in enumerate(streamed):
            for i, piece in enumerate(pieces):
                if layouts[r][0][s][i] >= 0:
                    gathered[r][s][i] = piece
    return count


def forget() -> None:
    """Forget the stream layouts read once (``fused.reset``)."""
    _stream_layout.cache_clear()
