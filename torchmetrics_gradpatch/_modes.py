"""The one place that chooses between the gradient modes: ``gather_all_tensors(x, group, mode=...)``.

``"local"`` is :func:`torchmetrics_gradpatch._gather.gather_local` (upstream 1.6 semantics, the unpatched
gather's collectives); ``"global"`` is :func:`torchmetrics_gradpatch._global.gather_global` (every entry carries
a graph, one backward collective). Both modules import nothing of each other; only this one imports both, and
the engine's trampoline and the public :func:`gather_all_tensors` both come here.
"""

from __future__ import annotations

from typing import Any

import torch

from torchmetrics_gradpatch import _compile  # torch.compile (H17)
from torchmetrics_gradpatch._compile import is_compiling  # torch.compile (H17)
from torchmetrics_gradpatch._gather import gather_local
from torchmetrics_gradpatch._global import gather_global

__all__ = ["MODES", "check_mode", "gather_all_tensors"]

#: The gradient modes, see docs/gradient-modes.md.
MODES = ("local", "global")


def check_mode(mode: object, what: str = "mode") -> str:
    """Return ``mode`` if it is one of :data:`MODES`, else raise a ``ValueError`` naming ``what``."""
    if isinstance(mode, str) and mode in MODES:
        return mode
    allowed = ", ".join(repr(m) for m in MODES)
    raise ValueError(f"torchmetrics_gradpatch: {what}={mode!r} is not a gradient mode; use one of {allowed}.")


def gather_all_tensors(result: torch.Tensor, group: Any | None = None, *, mode: str = "local") -> list[torch.Tensor]:
    """Gather ``result`` from every rank of ``group``, keeping autograd graphs as ``mode`` says.

    Tensors must have the same number of dimensions on every rank; each dimension may differ, in which case the
    tensors are padded to the largest size, gathered and trimmed back (as torchmetrics does).

    Args:
        result: this rank's tensor.
        group: the process group to gather over; ``None`` means the default (world) group.
        mode: ``"local"`` (upstream 1.6 semantics) or ``"global"`` (every entry carries a graph; the backward
            sums all ranks' gradients for each rank's tensor). Every rank of ``group`` must use the same mode:
            the two modes issue different collectives.

    Returns:
        A list with one tensor per rank of ``group``, in group-rank order, the same values, bit for bit, in both
        modes. In ``"local"`` mode the entry at this rank's index is ``result.contiguous()`` itself, so gradients
        flow back to ``result`` through it, and every other entry is a tensor without a graph. In ``"global"``
        mode, when any rank's tensor requires grad and every rank gathers with grad mode on, every entry on every
        rank is an output of one autograd node whose backward issues one collective: every rank of ``group``
        must then run ``backward()`` through the gathered values (see :mod:`torchmetrics_gradpatch._global`).
    """
    if is_compiling():  # torch.compile (H17): a graph break, the gather runs eagerly (see _compile.py)
        return _compile.gather_when_compiling(result, group, check_mode(mode))
    if mode == "local":  # the hot path: every metric sync of every step
        return gather_local(result, group)
    check_mode(mode)
    return gather_global(result, group)
