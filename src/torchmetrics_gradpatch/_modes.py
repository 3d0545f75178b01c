"""The one place that chooses between the gradient modes, and the one rule for their names.

``"local"`` is :func:`torchmetrics_gradpatch._gather.gather_local` (upstream 1.6 semantics, the unpatched
gather's collectives); ``"global"`` is :func:`torchmetrics_gradpatch._global.gather_global` (every entry carries
a graph, one backward collective). Both modules import nothing of each other; only this one knows both, and the
engine's dispatch and the public :func:`gather_all_tensors` both take their function from :data:`GATHERS`.

Names: a mode is matched case-insensitively, surrounding blanks ignored (``"Global"``, ``" LOCAL "``), in
``patch()``, ``patched()``, :func:`gather_all_tensors`, the ``TORCHMETRICS_GRADPATCH_MODE`` variable and the
command line alike; :func:`check_mode` is that rule.

This module imports neither torch nor the two gathers at import time: ``import torchmetrics_gradpatch`` must stay
cheap (``--version``, ``--help``), and by the time a gather runs torch is imported anyway. Each gather is imported
on its first use and kept in :data:`GATHERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from torchmetrics_gradpatch import _compile

__all__ = ["GATHERS", "MODES", "GradModeMismatchError", "check_mode", "gather_all_tensors", "gather_for"]

#: The gradient modes, see docs/gradient-modes.md.
MODES = ("local", "global")


class GradModeMismatchError(RuntimeError):
    """Ranks gathered in global mode with different grad modes while a tensor requires grad (raised on every rank)."""


#: mode -> its gather ``(result, group) -> list``, filled on first use by :func:`gather_for`.
GATHERS: dict[str, Callable[..., list[Any]]] = {}


def check_mode(mode: object, what: str = "mode") -> str:
    """Return the mode ``mode`` names (lower case), else raise a ``ValueError`` naming ``what``.

    Case-insensitive and blank-tolerant, the same rule everywhere a mode is given (see the module docstring).
    """
    if isinstance(mode, str):
        name = mode.strip().lower()
        if name in MODES:
            return name
    allowed = ", ".join(repr(m) for m in MODES)
    hint = ""
    if callable(mode):
        hint = " (to decorate a function, write @patched or @patched(mode=...))"
    raise ValueError(f"torchmetrics_gradpatch: {what}={mode!r} is not a gradient mode; use one of {allowed}{hint}.")


def gather_for(mode: str) -> Callable[..., list[Any]]:
    """The gather function of ``mode`` (any spelling :func:`check_mode` accepts); imports it on first use."""
    gather = GATHERS.get(mode)
    if gather is not None:
        return gather
    name = check_mode(mode)
    if name not in GATHERS:
        if name == "local":
            from torchmetrics_gradpatch._gather import gather_local

            GATHERS[name] = gather_local
        else:
            from torchmetrics_gradpatch._global import gather_global

            GATHERS[name] = gather_global
    return GATHERS[name]


def gather_all_tensors(result: torch.Tensor, group: Any | None = None, *, mode: str = "local") -> list[torch.Tensor]:
    """Gather ``result`` from every rank of ``group``, keeping autograd graphs as ``mode`` says.

    Tensors must have the same number of dimensions on every rank; each dimension may differ, in which case the
    tensors are padded to the largest size, gathered and trimmed back (as torchmetrics does).

    Args:
        result: this rank's tensor.
        group: the process group to gather over; ``None`` means the default (world) group.
        mode: ``"local"`` (upstream 1.6 semantics) or ``"global"`` (every entry carries a graph; the backward
            sums all ranks' gradients for each rank's tensor), case-insensitive. Every rank of ``group`` must use
            the same mode: the two modes issue different collectives.

    Returns:
        A list with one tensor per rank of ``group``, in group-rank order, the same values, bit for bit, in both
        modes. In ``"local"`` mode the entry at this rank's index is ``result.contiguous()`` itself, so gradients
        flow back to ``result`` through it, and every other entry is a tensor without a graph. In ``"global"``
        mode, when any rank's tensor requires grad and every rank gathers with grad mode on, every entry on every
        rank is an output of one autograd node whose backward issues one collective: every rank of ``group``
        must then run ``backward()`` through the gathered values (see :mod:`torchmetrics_gradpatch._global`).
    """
    if _compile.is_compiling():  # under torch.compile: a graph break, the gather runs eagerly (_compile.py)
        return _compile.gather_when_compiling(result, group, check_mode(mode))
    gather = GATHERS.get(mode) or gather_for(mode)
    return gather(result, group)
