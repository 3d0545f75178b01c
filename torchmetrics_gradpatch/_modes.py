"""The gradient modes: their names, the one spelling rule for every name a user gives (:func:`check_name`), and
the one map from a mode to its gather (:data:`GATHERS`, filled on first use so the package's import stays
torch-free). The modes: docs/gradient-modes.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchmetrics_gradpatch import _compile

if TYPE_CHECKING:
    import torch


#: The gradient modes, see docs/gradient-modes.md.
MODES = ("local", "global")

#: mode -> its gather ``(result, group) -> list``, filled on first use by :func:`gather_for`.
GATHERS: dict[str, Callable[..., list[Any]]] = {}


def check_name(value: object, allowed: tuple[str, ...], what: str, noun: str) -> str:
    """Return the name in ``allowed`` that ``value`` spells (any case, blanks around ignored), else raise a
    ``ValueError`` saying that ``what={value!r}`` is not ``noun`` and listing ``allowed``."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name in allowed:
            return name
    hint = " (to decorate a function, write @patched or @patched(mode=...))" if callable(value) else ""
    names = ", ".join(repr(a) for a in allowed)
    raise ValueError(f"torchmetrics_gradpatch: {what}={value!r} is not {noun}; use one of {names}{hint}, in any case.")


def check_mode(mode: object, what: str = "mode") -> str:
    """Return the mode ``mode`` names (lower case), else raise a ``ValueError`` naming ``what``."""
    return check_name(mode, MODES, what, "a gradient mode")


def gather_for(mode: object) -> Callable[..., list[Any]]:
    """The gather function of ``mode`` (any spelling :func:`check_mode` accepts); imports it on first use."""
    gather = GATHERS.get(mode) if type(mode) is str else None  # a non-string (a list, say) is checked, not hashed
    if gather is not None:
        return gather
    name = check_mode(mode)
    if name not in GATHERS:
        if name == "local":
            from torchmetrics_gradpatch._gather import gather_local  # imports torch: only once a gather is wanted

            GATHERS[name] = gather_local
        else:
            from torchmetrics_gradpatch._global import gather_global  # imports torch: as above

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
        must then run ``backward()`` through the gathered values (docs/gradient-modes.md).
    """
    gather = gather_for(mode)
    if _compile.is_compiling():  # under torch.compile: a graph break, the gather runs eagerly
        return _compile.run_eagerly(gather, result, group)  # type: ignore[no-any-return]
    return gather(result, group)
