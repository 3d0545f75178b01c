"""The graph-preserving gather: torchmetrics 1.6.0's ``gather_all_tensors`` semantics, for any torchmetrics.

``torch.distributed.all_gather`` writes into fresh tensors, so everything it returns is a leaf without a
graph. Upstream's fix (torchmetrics PR #2754) puts the caller's own tensor back at the caller's index, so
autograd flows through the local rank's entry while every other entry stays a plain value.

This module reproduces that, with three deliberate properties:

* **Same collectives, same order** as the unpatched gather of every torchmetrics from 0.11 to 1.9: one
  ``barrier``, then (for non-scalars) one ``all_gather`` of the shapes, then one ``all_gather`` of the data.
  A job where some ranks are patched and some are not therefore cannot deadlock.
* **Bit-identical values** for every entry but the local one: the same zero buffers, padding and slicing.
* **No extra memory and no warnings**: the local gathered copy is replaced, not kept beside the caller's
  tensor, and uneven results are sliced with a tuple (torchmetrics < 1.6 slices with a list, which torch
  >= 2.8 deprecates with a ``UserWarning`` at every uneven gather).

The index is the caller's rank *within* ``group`` (``torch.distributed.get_rank(group)``), not its global rank.

Gradient modes
--------------
This is the ``"local"`` mode and nothing else; it knows nothing of the ``"global"`` mode
(:mod:`torchmetrics_gradpatch._global`, which has its own forward). :mod:`torchmetrics_gradpatch._modes` chooses
between the two.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional name

__all__ = ["gather_local"]


def _gather_same_shape(result: torch.Tensor, group: Any, world_size: int) -> list[torch.Tensor]:
    """All-gather tensors of one shape, then put the caller's tensor (with its graph) at its own index."""
    with torch.no_grad():
        gathered = [torch.zeros_like(result) for _ in range(world_size)]
        dist.all_gather(gathered, result, group)
    gathered[dist.get_rank(group)] = result
    return gathered


def gather_local(result: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
    """Gather ``result`` from every rank of ``group``; the local entry keeps its autograd graph.

    Tensors must have the same number of dimensions on every rank; each dimension may differ, in which case
    the tensors are padded to the largest size, gathered and trimmed back (as torchmetrics does).

    Returns a list with one tensor per rank of ``group`` (``None``: the default group), in group-rank order. The
    entry at this rank's index is ``result.contiguous()`` itself (``result`` when it is already contiguous), so
    gradients flow back to ``result`` through it; every other entry is a tensor without a graph.
    """
    if group is None:
        group = dist.group.WORLD

    # Same order of operations as upstream, so errors (an uninitialised group, a non-tensor) are the same.
    result = result.contiguous()
    world_size = dist.get_world_size(group)
    dist.barrier(group=group)

    if result.ndim == 0:
        return _gather_same_shape(result, group, world_size)

    local_size = torch.tensor(result.shape, device=result.device)
    local_sizes = [torch.zeros_like(local_size) for _ in range(world_size)]
    dist.all_gather(local_sizes, local_size, group=group)
    max_size = torch.stack(local_sizes).max(dim=0).values
    if all(bool((size == max_size).all()) for size in local_sizes):
        return _gather_same_shape(result, group, world_size)

    # Uneven shapes: pad to the largest size on every dimension, gather, trim. The padded copy and the
    # buffers carry no graph; the local entry is replaced by ``result`` below instead of being trimmed.
    pad: list[int] = []
    for missing in reversed((max_size - local_size).tolist()):
        pad.extend((0, int(missing)))
    with torch.no_grad():
        padded = F.pad(result, pad)
        buffers = [torch.zeros_like(padded) for _ in range(world_size)]
        dist.all_gather(buffers, padded, group)
    rank = dist.get_rank(group)
    del padded
    gathered: list[torch.Tensor] = []
    for idx, (buffer, size) in enumerate(zip(buffers, local_sizes, strict=True)):
        if idx == rank:
            gathered.append(result)
        else:
            gathered.append(buffer[tuple(slice(int(n)) for n in size.tolist())])
    return gathered
