"""The public switches: ``patch``, ``unpatch``, ``is_patched``, ``compile_support``, and the environment variables.

Role: check what the caller gave (a clear error naming the argument) and change the engine through its functions;
read ``TORCHMETRICS_GRADPATCH_MODE`` / ``TORCHMETRICS_GRADPATCH_SYNC`` / ``TORCHMETRICS_GRADPATCH_AUTOPATCH`` (a
``ValueError`` naming the variable and its allowed values). :func:`patched` lives in
:mod:`torchmetrics_gradpatch._blocks`, :func:`status` in :mod:`torchmetrics_gradpatch._status`; the state model
they share is in docs/design.md.

Invariants:

* importing this module changes nothing: the package's ``__init__`` applies the environment once, through
  :func:`apply_environment`;
* :func:`reset_for_tests` is the one way a test harness puts the patch back as a fresh import leaves it;
* every variable is read by one function (:func:`_read`), so each names itself and its allowed values alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from torchmetrics_gradpatch import _engine
from torchmetrics_gradpatch._modes import check_mode
from torchmetrics_gradpatch._syncs import STRATEGIES, check_sync

__all__ = [
    "AUTOPATCH_ENV",
    "MODE_ENV",
    "SYNC_ENV",
    "apply_environment",
    "autopatch_requested",
    "compile_support",
    "is_patched",
    "mode_requested",
    "patch",
    "reset_for_tests",
    "sync_requested",
    "unpatch",
]

AUTOPATCH_ENV = "TORCHMETRICS_GRADPATCH_AUTOPATCH"
MODE_ENV = "TORCHMETRICS_GRADPATCH_MODE"
SYNC_ENV = "TORCHMETRICS_GRADPATCH_SYNC"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def patch(mode: str | None = None, sync: str | None = None) -> None:
    """Put the graph-preserving gather in force until :func:`unpatch`. Idempotent.

    Args:
        mode: ``"local"`` or ``"global"`` (README, "Gradient modes"; case-insensitive); ``None`` means the default
            mode (``TORCHMETRICS_GRADPATCH_MODE``, else ``"local"``). Calling ``patch`` again changes the mode.
        sync: ``"torchmetrics"`` (its own collectives) or ``"fused"`` (two collectives per Metric sync,
            docs/fused-sync.md; case-insensitive); ``None`` means the default (``TORCHMETRICS_GRADPATCH_SYNC``,
            else ``"torchmetrics"``). Every rank must use the same sync, as with the mode.

    In local mode on a torchmetrics that keeps the graph natively (1.6.0 and newer) nothing is changed; the
    global mode is installed on every torchmetrics. If torchmetrics is not imported yet, the patch lands the
    moment ``torchmetrics.utilities.distributed`` is imported.
    """
    chosen_mode = None if mode is None else check_mode(mode)
    _engine.set_manual(True, chosen_mode, sync=None if sync is None else check_sync(sync))


def unpatch() -> None:
    """Switch off what :func:`patch` switched on (open ``patched()`` blocks stay in force). Idempotent.

    Once nothing holds the patch in force, torchmetrics' gather gets back its original code object and
    ``Metric._sync_dist`` is torchmetrics' own function object again.
    """
    _engine.set_manual(False)


def is_patched() -> bool:
    """Whether the patch is in force: :func:`patch` is on or a :func:`patched` block is open.

    On native torchmetrics (1.6.0 and newer) the patch can be "in force" without anything being replaced;
    :func:`status` tells the two apart.
    """
    return _engine.in_force()


def compile_support(enabled: bool = True) -> None:
    """On native torchmetrics (1.6 and newer), also install the trampoline in local mode, for ``torch.compile``.

    torchmetrics' own gather fails inside ``torch.compile`` on gloo (dynamo traces its collectives and gloo
    refuses the 0-d states). With ``compile_support()`` on, the patch in force installs this package's gather in
    local mode too, which runs behind a graph break with the same semantics as torchmetrics >= 1.6. It takes effect
    at once and while the patch is in force (``patch()``, which the import calls, or a ``patched()`` block).
    ``compile_support(False)`` goes back to installing nothing in local mode. On torchmetrics before 1.6 the
    trampoline is installed anyway and this changes nothing. ``enabled`` must be ``True`` or ``False``.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"torchmetrics_gradpatch: compile_support(enabled={enabled!r}): enabled must be True or False.")
    _engine.set_defaults(compile_support=enabled)


def _read(variable: str, unset: str, check: Callable[[str], str], noun: str, allowed: str, see: str) -> str:
    """``variable``'s value as ``check`` spells it (unset or blank: ``unset``); else a ``ValueError`` saying that
    the variable's value is not ``noun``, what it may hold and where to read more."""
    raw = os.environ.get(variable, "")
    if not raw.strip():
        return unset
    try:
        return check(raw)
    except ValueError:
        raise ValueError(
            f"{variable}={raw!r} is not {noun}; use one of: {allowed}, in any case (unset means {unset}). {see}"
        ) from None


def _flag(raw: str) -> str:
    value = raw.strip().lower()
    if value in _TRUE:
        return "1"
    if value in _FALSE:
        return "0"
    raise ValueError(raw)


def autopatch_requested() -> bool:
    """Read ``TORCHMETRICS_GRADPATCH_AUTOPATCH`` (unset or blank: patch at import)."""
    allowed = f"{', '.join(_FALSE)} (import without patching) / {', '.join(_TRUE)} (patch, the default)"
    return _read(AUTOPATCH_ENV, "1", _flag, "a flag", allowed, "").strip() == "1"


def mode_requested() -> str:
    """Read ``TORCHMETRICS_GRADPATCH_MODE`` (the rule of ``patch(mode=...)``; unset or blank: local)."""
    return _read(MODE_ENV, "local", check_mode, "a gradient mode", "local, global", "See the README.")


def sync_requested() -> str:
    """Read ``TORCHMETRICS_GRADPATCH_SYNC`` (the rule of ``patch(sync=...)``; unset or blank: torchmetrics)."""
    strategies = ", ".join(STRATEGIES)
    return _read(SYNC_ENV, "torchmetrics", check_sync, "a sync strategy", strategies, "See docs/fused-sync.md.")


def apply_environment() -> None:
    """What the import does: read the variables (any may raise), set the default mode and sync, and patch unless
    ``TORCHMETRICS_GRADPATCH_AUTOPATCH`` says not to."""
    mode, sync, autopatch = mode_requested(), sync_requested(), autopatch_requested()
    _engine.set_defaults(mode=mode, sync=sync)
    if autopatch:
        _engine.set_manual(True, by="import")


def reset_for_tests() -> str | None:
    """Put the patch back as a fresh import leaves it, read from the environment now; say what the test left.

    For a test harness that reuses a process between tests: closes every open block, switches compile support
    off, sets the default mode, the default sync and the import's patch from the environment. Returns ``None``, or
    why this process should not be reused (a block was left open).
    """
    left = _engine.close_all_blocks()
    _engine.set_defaults(mode=mode_requested(), sync=sync_requested(), compile_support=False)
    _engine.set_manual(autopatch_requested(), by="import")
    return "the test left a torchmetrics_gradpatch.patched() block open" if left else None
