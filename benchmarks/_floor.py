"""The floor's collective: one gather of the bytes a steady fused exchange moves in its collective 1.

A steady fused exchange sends, per rank, an 80-byte header (``wire.HEADER_WORDS`` int64 words) and the group's
inline capacity (``wire.capacity(group).data`` bytes), and receives that from every rank. :func:`exchange_bytes`
reads those bytes for a group (read it after a warm-up fused exchange, when the capacity has settled), and
:func:`collective` returns a function that issues one gather of that many bytes per rank on the group, into buffers
made once: ``all_gather_single`` where torch has it (it renamed ``all_gather_into_tensor``, which then warns),
else ``all_gather_into_tensor``. The function is looked up on ``torch.distributed`` at each call, so a wrapper put
there (``bench_collection.py`` counts the bytes the collectives fill) sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def exchange_bytes(group: Any) -> int:
    """Per rank, the bytes of ``group``'s next fused exchange's collective 1: the header and the inline capacity."""
    from torchmetrics_gradpatch.fused import wire

    return 8 * wire.HEADER_WORDS + wire.capacity(group).data


def collective(nbytes: int, group: Any) -> Callable[[], None]:
    """A function that gathers ``nbytes`` bytes from every rank of ``group`` in one collective."""
    import torch
    import torch.distributed as dist

    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    mine = torch.zeros(nbytes, dtype=torch.uint8)
    received = torch.empty(nbytes * dist.get_world_size(group), dtype=torch.uint8)

    def gather() -> None:
        getattr(dist, name)(received, mine, group=group)

    return gather
