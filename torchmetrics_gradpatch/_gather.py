"""The graph-preserving gather ("local" mode): torchmetrics 1.6.0's ``gather_all_tensors``, for any torchmetrics.

Role: the unpatched gather, except that the caller's own tensor is put back at the caller's index (the rank
*within* ``group``), so autograd flows through that entry; every other entry is a plain value. It also holds the
data step both modes share (:func:`gather_entries`) and :func:`size_and_rank`.

Invariants:

* The same collectives in the same order as the unpatched gather of torchmetrics 0.11 to 1.9 (``barrier``, the
  shapes' ``all_gather`` for non-scalars, the data's ``all_gather``), so patched and unpatched ranks cannot
  deadlock each other; the same results and errors, a non-member of ``group`` included.
* Every other entry is bit for bit the unpatched one (the same zeroed buffers, padding and trimming); no
  gathered copy of the caller's own tensor outlives the call; no warning (uneven results are sliced with a tuple).
* It knows nothing of global mode (:mod:`torchmetrics_gradpatch._global`); :mod:`torchmetrics_gradpatch._modes`
  chooses between the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the conventional name

__all__ = ["gather_entries", "gather_local", "size_and_rank"]


def _all_gather(buffers: list[torch.Tensor], tensor: torch.Tensor, group: Any) -> None:
    """``dist.all_gather``, under ``no_grad`` only when ``tensor`` has a graph to keep out (this runs at every sync)."""
    if tensor.requires_grad:
        with torch.no_grad():
            dist.all_gather(buffers, tensor, group)
    else:
        dist.all_gather(buffers, tensor, group)


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
    """One ``all_gather`` of the data, given every rank's shape: one entry per rank, the caller's own at ``rank``.

    ``shapes[i]`` is the shape of group rank ``i``'s tensor as a sequence of ints, every one of the same type
    (all lists or all tuples: the caller exchanged them); ``rank`` is the caller's rank within ``group``. Equal
    shapes are gathered as they are. Otherwise every rank pads its tensor to the largest size on every dimension,
    the padded tensors are gathered and each entry is trimmed back to its rank's shape (sliced with a tuple: a list
    index is deprecated from torch 2.8 and warns). The entry at ``rank`` is ``result`` itself, so its graph is
    kept; every other entry is a buffer without a graph, and no gathered copy of the caller's own tensor outlives
    the call.

    Both modes' forwards use it, so they trim and order entries the same way. ``new_buffer`` allocates the receive
    buffers: local mode keeps torchmetrics' zeroed ones; global mode, whose ranks have first agreed on dtype and
    shapes (so ``all_gather`` writes every element), takes ``torch.empty_like``.
    """
    if shapes.count(shapes[0]) == len(shapes):  # one C-level pass; this runs at every sync of every metric state
        return _gather_equal(result, len(shapes), group, rank, new_buffer)
    max_shape = [max(sizes) for sizes in zip(*shapes, strict=True)]
    pad: list[int] = []
    for have, most in zip(reversed(shapes[rank]), reversed(max_shape), strict=True):
        pad.extend((0, most - have))
    with torch.no_grad():
        padded = F.pad(result, pad)
        buffers = [new_buffer(padded) for _ in shapes]
        dist.all_gather(buffers, padded, group)
    del padded
    return [
        result if idx == rank else buffer[tuple(slice(n) for n in shape)]
        for idx, (buffer, shape) in enumerate(zip(buffers, shapes, strict=True))
    ]


def size_and_rank(group: Any) -> tuple[int, int]:
    """``group``'s size and this process's rank within it, as ``dist.get_world_size`` / ``dist.get_rank`` give them.

    For a process group object (what every member of a group holds) both are plain C++ getters, far cheaper than
    the ``torch.distributed`` functions. Anything else (an uninitialised default group, a non-member's
    placeholder, for which both are -1) goes through those functions, so their errors and answers stay as they are.
    """
    if isinstance(group, dist.ProcessGroup):
        return group.size(), group.rank()
    return dist.get_world_size(group), dist.get_rank(group)


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

    # Same order of operations as upstream (contiguous, group size, barrier), so errors are the same.
    result = result.contiguous()
    world_size, rank = size_and_rank(group)
    dist.barrier(group=group)

    if result.ndim == 0:
        return _gather_equal(result, world_size, group, rank, torch.zeros_like)

    local_size = torch.tensor(result.shape, device=result.device)
    local_sizes = [torch.zeros_like(local_size) for _ in range(world_size)]
    dist.all_gather(local_sizes, local_size, group=group)
    if not local_sizes:  # a non-member of ``group``: the unpatched gather fails in ``torch.stack`` of no sizes
        torch.stack(local_sizes)
    return gather_entries(result, [size.tolist() for size in local_sizes], group, rank)
