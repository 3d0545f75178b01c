"""The floor's collective: one gather of the bytes a steady fused exchange moves in its collective 1.

A steady fused exchange sends, per rank, an 80-byte header (``wire.HEADER_WORDS`` int64 words) and the group's
inline capacity (``wire.Group``), and receives that from every rank. :func:`exchange_bytes`
reads those bytes for a group (read it after a warm-up fused exchange, when the capacity has settled), and
:func:`collective` returns a function that issues one gather of that many bytes per rank on the group, into buffers
made once: ``all_gather_single`` where torch has it (it renamed ``all_gather_into_tensor``, which then warns),
else ``all_gather_into_tensor``. The function is looked up on ``torch.distributed`` at each call, so a wrapper put
there (``bench_collection.py`` counts the bytes the collectives fill) sees it.

:func:`stand_in` is the other half of a floor that computes on synced states: torchmetrics' own ``_sync_dist``
without its communication, so that what a sync sets (every rank's copy stacked, flattened, reduced) and what
``compute()`` then does with it are timed without any collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def exchange_bytes(group: Any) -> int:
    """Per rank, the bytes of ``group``'s next fused exchange's collective 1: the header and the inline capacity."""
    from torchmetrics_gradpatch.fused import wire

    return 8 * wire.HEADER_WORDS + wire.Group.of(group).capacity.data


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


def stand_in(metric: Any, world_size: int) -> Callable[..., None]:
    """A ``_sync_dist`` for ``metric`` that sets what torchmetrics' own sets over ``world_size`` ranks, without
    communication: every other rank's copy of a state is this rank's, detached (as a gathered copy, it has no
    graph; as the fused sync's views of its receive buffer, it costs no copy), stacked, flattened (list states,
    element by element) and reduced as torchmetrics does."""
    import torch
    from torchmetrics.utilities.data import dim_zero_cat

    def _sync_dist(dist_sync_fn: Any = None, process_group: Any = None) -> None:
        for attr, reduction in metric._reductions.items():
            value = getattr(metric, attr)
            if isinstance(value, torch.Tensor):
                gathered: Any = torch.stack([value] + [value.detach()] * (world_size - 1))
            else:
                if reduction == dim_zero_cat and len(value) > 1:
                    value = [dim_zero_cat(value)]
                gathered = [each for item in value for each in [item] + [item.detach()] * (world_size - 1)]
                if not gathered:
                    setattr(metric, attr, [])
                    continue
            setattr(metric, attr, reduction(gathered) if reduction is not None else gathered)

    return _sync_dist
