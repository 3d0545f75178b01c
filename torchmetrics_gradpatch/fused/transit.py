"""Where the fused exchange runs, and how tensors held on the CPU cross when it runs on a device: *streamed*,
described in the payload, their bytes crossing afterwards in chunks of at most the smallest chunk size any rank sent,
so every rank counts the same collectives from the exchanged descriptions (docs/fused-sync.md, "States held on the
CPU")."""

from __future__ import annotations

import functools
from typing import Any

import torch

from torchmetrics_gradpatch import _bytes, _gather
from torchmetrics_gradpatch.fused import wire


def devices(metric_device: Any, group: Any) -> tuple[torch.device, torch.device | None, bool]:
    """The exchange device (the Metric's, or the CUDA device a group that takes device tensors only stages on), the
    staging device (``None``: the group takes CPU tensors) and whether CPU-held tensors are streamed."""
    staging = _gather.staging_device(group)
    device = torch.device(metric_device)
    if device.type == "cpu" and staging is not None:
        device = staging
    return device, staging, staging is not None or device.type != "cpu"


@functools.lru_cache(maxsize=128)
def _stream_layout(states: tuple[wire.State, ...], skip: tuple[int, ...]) -> tuple[list[list[int]], int, wire.Views]:
    # a steady exchange streams what it streamed before: its layout is read once
    offsets, size = wire.layout(states, 0, skip, streamed=True)
    return offsets, size, wire.views(states, offsets, skip)


def receive_stream(exchange: Any, chunk: int) -> list[tuple[int, int, int, torch.Tensor]]:
    """Every other rank's streamed pieces in ``exchange`` (read, not changed) as ``(rank, slot, index, piece)``, CPU
    tensors, crossing in chunks of ``chunk`` bytes where a staging device carries them."""
    rank, staging = exchange.rank, exchange.staging
    layouts = [_stream_layout(tuple(states), exchange.skip) for states in exchange.every]
    total = max(size for _, size, _ in layouts)
    if total == 0:
        return []
    mine = [
        (offset, _bytes.as_bytes(tensor))
        for tensors, offsets in zip([slot.tensors for slot in exchange.slots], layouts[rank][0], strict=True)
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

    receive = [None if r == rank else torch.empty(size, dtype=torch.uint8) for r, (_, size, _) in enumerate(layouts)]
    transit = staging if staging is not None else torch.device("cpu")
    chunk = chunk if staging is not None else total
    _gather.all_gather_chunked(receive, fill, total, exchange.group, rank, transit, chunk)
    return [
        (r, s, i, piece)
        for r, buffer in enumerate(receive)
        if buffer is not None
        for s, pieces in enumerate(wire.unpack(buffer, layouts[r][2]))
        for i, piece in enumerate(pieces)
        if piece is not wire.ABSENT
    ]


def forget() -> None:
    """Forget the stream layouts read once (``fused.reset``)."""
    _stream_layout.cache_clear()
