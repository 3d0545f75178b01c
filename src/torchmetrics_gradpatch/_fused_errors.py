"""The fused sync's error, defined where importing it loads no torch (``import torchmetrics_gradpatch`` stays light)."""

from __future__ import annotations

__all__ = ["FusedSyncError", "structure_error"]


class FusedSyncError(RuntimeError):
    """The ranks' states cannot be synced together; raised on every rank of the group after the same exchange."""


def structure_error(metric: str, attr: str | None, rule: str, seen: dict[int, str]) -> FusedSyncError:
    """The error for a state (``attr``; ``None``: the Metric as a whole) whose ranks break ``rule``.

    ``seen`` maps each rank (within the group) to what it holds, so the message names the ranks on each side.
    """
    what = f"state {attr!r} of {metric}" if attr is not None else metric
    held = "; ".join(f"rank {rank}: {value}" for rank, value in sorted(seen.items()))
    return FusedSyncError(
        f"torchmetrics_gradpatch: fused sync of {what}: {rule}. The ranks hold: {held}. Every rank of the group "
        "raised this error after the same exchange, before changing any state; none is left waiting. Make every "
        "rank hold states of the same structure, or sync with torchmetrics' own path (sync='torchmetrics')."
    )
