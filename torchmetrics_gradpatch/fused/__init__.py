"""The sync strategy: torchmetrics' own ``Metric._sync_dist``, or the fused one, switched in place and restored.

``install("fused")`` sets ``torchmetrics.Metric._sync_dist`` to a function that, when the sync function is
torchmetrics' own gather (``torchmetrics.utilities.distributed.gather_all_tensors``: the original object, which the
engine patches in place, so this also holds while the graph-preserving patch is in force), runs
:func:`torchmetrics_gradpatch.fused.sync.fused_sync` (two collectives per Metric sync); any other
``dist_sync_fn`` goes to torchmetrics' original method unchanged. Subclasses that override ``_sync_dist`` and
call ``super()._sync_dist(...)`` reach it through the class attribute. ``uninstall()`` (or
``install("torchmetrics")``) puts the very same original function object back.

``install("torchmetrics", guard=True)`` sets the same replacement with torchmetrics' own sync inside. Either way,
inside ``torch.compile`` the whole sync runs behind one graph break (``_compile.run_eagerly``): dynamo never
traces torchmetrics' ``apply_to_collection`` nor the fused packing (torch 2.15's dynamo cannot build a guard on
the former for a ``cat`` state; docs/design.md, "torch.compile").

What it replaced is kept on the replacement itself (``__wrapped__``), not in this module, so a reloaded or second
copy of this module restores it too. If another tool has set ``Metric._sync_dist`` on top of ours,
``uninstall()`` leaves that in place and warns, as the engine does for the gather.

Every rank of a group must use the same strategy: the fused sync issues other collectives than torchmetrics'
own. This module imports neither torch nor torchmetrics at import time; ``install`` applies at once when
``torchmetrics.metric`` is imported, else the moment it is (a ``wrapt`` post-import hook).
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import wrapt

from torchmetrics_gradpatch import _compile
from torchmetrics_gradpatch._errors import FusedSyncError

__all__ = [
    "SYNCS",
    "FusedSyncError",
    "check_sync",
    "fused_sync",
    "guarded",
    "install",
    "installed",
    "original_sync_dist",
    "uninstall",
]

#: The sync strategies: torchmetrics' own collectives (the default), or the fused exchange.
SYNCS = ("torchmetrics", "fused")
_MODULE = "torchmetrics.metric"
_MARK = "__torchmetrics_gradpatch_fused__"  # set on our replacement, so any copy of this module recognises it

#: What was asked (``on``, ``sync``, ``mode``), whether the import hook is registered, and the replacement this copy
#: set. ``sync`` is read at every call of the replacement, so switching strategies replaces nothing.
_wanted: dict[str, Any] = {"on": False, "sync": "fused", "mode": "local", "hook": False, "ours": None}


def check_sync(sync: object, what: str = "sync") -> str:
    """Return the strategy ``sync`` names (lower case, blanks ignored), else raise ``ValueError`` naming ``what``."""
    if isinstance(sync, str) and sync.strip().lower() in SYNCS:
        return sync.strip().lower()
    allowed = ", ".join(repr(s) for s in SYNCS)
    raise ValueError(
        f"torchmetrics_gradpatch: {what}={sync!r} is not a sync strategy; use one of {allowed} (in any case)."
    )


def fused_sync(metric: Any, process_group: Any | None = None, mode: str = "local") -> None:
    """Sync ``metric``'s states across ``process_group`` in two collectives, as ``Metric._sync_dist`` would.

    Values are torchmetrics' own, state by state; ``mode`` is the gradient mode (``"local"``: each rank's states
    keep their own graphs; ``"global"``: every rank's states get the gradients of every rank's loss, one backward
    collective for the whole sync). A collective: every rank of the group calls it for the same Metric class.
    Raises :class:`FusedSyncError` (on every rank alike) when the ranks' states cannot be synced together.
    """
    from torchmetrics_gradpatch.fused.sync import fused_sync as run

    run(metric, process_group, mode)


def _mode_now() -> str:
    mode = _wanted["mode"]
    return mode() if callable(mode) else str(mode)


def _is_torchmetrics_gather(fn: object, original: Any) -> bool:
    """Whether ``fn`` is torchmetrics' own gather (the object the original method's default names)."""
    default = (original.__defaults__ or (None,))[0]
    if fn is default:
        return True
    module = sys.modules.get("torchmetrics.utilities.distributed")
    return module is not None and fn is getattr(module, "gather_all_tensors", None)


def _run(original: Any, metric: Any, dist_sync_fn: Any, process_group: Any) -> None:
    if _wanted["sync"] == "fused" and _is_torchmetrics_gather(dist_sync_fn, original):
        fused_sync(metric, process_group, _mode_now())
    else:
        original(metric, dist_sync_fn, process_group)


def _replacement(original: Any) -> Callable[..., None]:
    def _sync_dist(self: Any, dist_sync_fn: Any = None, process_group: Any | None = None) -> None:
        if _compile.is_compiling():  # under torch.compile: one graph break, the whole sync runs eagerly
            _compile.run_eagerly(_run, original, self, dist_sync_fn, process_group)
        else:
            _run(original, self, dist_sync_fn, process_group)

    functools.update_wrapper(_sync_dist, original)  # name, doc, __wrapped__ = the original, restored by uninstall
    _sync_dist.__defaults__ = original.__defaults__  # the same default gather object as torchmetrics'
    setattr(_sync_dist, _MARK, True)
    return _sync_dist


def _metric_class() -> Any:
    """``torchmetrics.Metric``, or ``None`` while ``torchmetrics.metric`` is not imported or still being imported."""
    return getattr(sys.modules.get(_MODULE), "Metric", None)


def _apply(module: Any = None) -> None:
    """Bring ``Metric._sync_dist`` in line with :data:`_wanted`.

    While ``torchmetrics.metric`` is still being imported (a hook of the gather's module, which it imports, changed
    the strategy) there is no class yet: the post-import hook registered by :func:`install` applies it once the
    import is done.
    """
    metric = _metric_class()
    if metric is None:
        return
    current = metric.__dict__["_sync_dist"]
    ours = getattr(current, _MARK, False)
    if _wanted["on"] and not ours:
        metric._sync_dist = _wanted["ours"] = _replacement(current)
    elif not _wanted["on"] and ours:
        metric._sync_dist = current.__wrapped__
        _wanted["ours"] = None


def _on_import(module: Any) -> None:
    _wanted["hook"] = False
    _apply(module)


def install(sync: str = "fused", *, mode: str | Callable[[], str] = "local", guard: bool = False) -> None:
    """Use ``sync`` (see :data:`SYNCS`) for every Metric; ``mode`` is the gradient mode, or a function giving it
    at each sync (the engine's effective mode). ``install("torchmetrics")`` is :func:`uninstall` unless ``guard``
    asks for torchmetrics' own sync behind the replacement (a graph break under ``torch.compile``)."""
    chosen = check_sync(sync)
    if chosen == "torchmetrics" and not guard:
        uninstall()
        return
    _wanted["on"], _wanted["sync"], _wanted["mode"] = True, chosen, mode
    _compile.watch_dynamo()  # the graph break's wrapper, once dynamo is imported
    if _MODULE in sys.modules:  # being imported: the hook registered earlier applies it at the end
        _apply()
    elif not _wanted["hook"]:
        _wanted["hook"] = True
        wrapt.register_post_import_hook(_on_import, _MODULE)


def uninstall() -> None:
    """Put torchmetrics' original ``Metric._sync_dist`` back (the same object); idempotent."""
    _wanted["on"] = False
    metric = _metric_class()
    if metric is None:
        return
    current = metric.__dict__["_sync_dist"]
    ours, _wanted["ours"] = _wanted["ours"], None
    if getattr(current, _MARK, False):
        metric._sync_dist = current.__wrapped__
    elif ours is not None:
        warnings.warn(
            "torchmetrics_gradpatch: another tool has replaced Metric._sync_dist on top of the fused sync; "
            "leaving it in place.",
            RuntimeWarning,
            stacklevel=2,
        )


def guarded() -> bool:
    """Whether ``torchmetrics.Metric._sync_dist`` currently is this package's replacement (either strategy)."""
    metric = _metric_class()
    return metric is not None and bool(getattr(metric.__dict__["_sync_dist"], _MARK, False))


def installed() -> bool:
    """Whether ``torchmetrics.Metric._sync_dist`` currently is the replacement and runs the fused sync."""
    return guarded() and _wanted["on"] and _wanted["sync"] == "fused"


def original_sync_dist() -> Any:
    """torchmetrics' own ``Metric._sync_dist`` (what the replacement wraps, if it is in place); needs torchmetrics."""
    current = sys.modules[_MODULE].Metric.__dict__["_sync_dist"]
    return current.__wrapped__ if getattr(current, _MARK, False) else current
