"""The public switches (``patch``, ``unpatch``, ``is_patched``, ``compile_support``) and the environment variables.

Contract: check what the caller gave (an error naming the argument) and change the engine through its functions;
importing this module changes nothing (the package's ``__init__`` calls :func:`apply_environment` once); every
variable is read by :func:`_read`, so each error names the variable and its allowed values alike. The variables and
the switches for users: docs/api.md; the state they share: docs/design.md ("The state").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from torchmetrics_gradpatch import _engine
from torchmetrics_gradpatch._modes import check_mode
from torchmetrics_gradpatch._syncs import STRATEGIES, check_sync

AUTOPATCH_ENV = "TORCHMETRICS_GRADPATCH_AUTOPATCH"
CHECK_ENV = "TORCHMETRICS_GRADPATCH_CHECK"
MODE_ENV = "TORCHMETRICS_GRADPATCH_MODE"
SYNC_ENV = "TORCHMETRICS_GRADPATCH_SYNC"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def patch(mode: str | None = None, sync: str | None = None, check: bool | None = None) -> None:
    """Put the graph-preserving gather in force until :func:`unpatch`. Idempotent.

    Args:
        mode: ``"local"`` or ``"global"`` (README, "Gradient modes"; case-insensitive); ``None`` means the default
            mode (``TORCHMETRICS_GRADPATCH_MODE``, else ``"local"``). Calling ``patch`` again changes the mode.
        sync: ``"torchmetrics"`` (its own collectives) or ``"fused"`` (one exchange per Metric sync, one collective
            when steady, docs/fused-sync.md; case-insensitive); ``None`` means the default
            (``TORCHMETRICS_GRADPATCH_SYNC``, else ``"torchmetrics"``). Every rank must use the same sync, as with
            the mode.
        check: ``True``: each fused sync also runs torchmetrics' own sync on the same states and compares the two bit
            for bit (docs/fused-sync.md); ``False``: it does not; ``None`` means the default
            (``TORCHMETRICS_GRADPATCH_CHECK``, else ``False``).

    In local mode on a torchmetrics that keeps the graph natively (1.6.0 and newer) nothing is changed; the
    global mode is installed on every torchmetrics. If torchmetrics is not imported yet, the patch lands the
    moment ``torchmetrics.utilities.distributed`` is imported.

    Raises:
        TypeError: ``check`` is not ``True``, ``False`` or ``None``; nothing is changed.
        ValueError: ``sync="torchmetrics"`` with ``check=True`` (nothing would be checked); nothing is changed.
        UnsupportedVersionError: torchmetrics' gather has been refused (by the import, or when torchmetrics was
            imported after this package); nothing is changed, and ``status()`` says why.
    """
    chosen_mode = None if mode is None else check_mode(mode)
    chosen_sync = None if sync is None else check_sync(sync)
    chosen_check = check_pairing("patch", chosen_sync, check_choice("patch", check))
    _engine.set_manual(True, chosen_mode, sync=chosen_sync, check=chosen_check)


def unpatch() -> None:
    """Switch off what :func:`patch` switched on (open ``patched()`` blocks stay in force). Idempotent.

    Once nothing holds the patch in force, torchmetrics' gather gets back its original code object and
    ``Metric._sync_dist`` is torchmetrics' own function object again.
    """
    _engine.set_manual(False)


def is_patched() -> bool:
    """Whether the patch is in force: :func:`patch` is on or a :func:`patched` block is open.

    On native torchmetrics (1.6.0 and newer) the patch can be "in force" without anything being replaced;
    :func:`status` tells the two apart. After a refusal of torchmetrics' gather, what needs the gather is not in
    force (:func:`status`: ``state == "refused"``).
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

    Once torchmetrics' gather has been refused, ``compile_support()`` raises that refusal while the patch is asked
    for (the import's, ``patch()``'s or a block's) and changes nothing.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"torchmetrics_gradpatch: compile_support(enabled={enabled!r}): enabled must be True or False.")
    _engine.set_defaults(compile_support=enabled)


def check_choice(call: str, check: object) -> bool | None:
    """``check`` as ``call(check=...)`` was given it: ``True``, ``False`` or ``None``; anything else a ``TypeError``
    naming the call and the argument."""
    if check is None or isinstance(check, bool):
        return check
    raise TypeError(f"torchmetrics_gradpatch: {call}(check={check!r}): check must be True, False or None.")


def check_pairing(call: str, sync: str | None, check: bool | None) -> bool | None:
    """``check``, refused with a ``ValueError`` where the same call chose torchmetrics' own sync with it: the check
    compares the fused sync with torchmetrics' own, so there would be nothing to check. (A check chosen in one place
    and torchmetrics' sync in another is allowed: ``status()`` says the check is idle.)"""
    if check and sync == "torchmetrics":
        raise ValueError(
            f"torchmetrics_gradpatch: {call}(sync='torchmetrics', check=True): the check mode compares the fused sync "
            "with torchmetrics' own, and torchmetrics' own sync was chosen, so nothing would be checked. Choose "
            "sync='fused' with check=True, or leave check out."
        )
    return check


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


def check_requested() -> bool:
    """Read ``TORCHMETRICS_GRADPATCH_CHECK`` (the flag spellings of ``TORCHMETRICS_GRADPATCH_AUTOPATCH``; unset or
    blank: off)."""
    allowed = f"{', '.join(_FALSE)} (do not check, the default) / {', '.join(_TRUE)} (check the fused sync)"
    return _read(CHECK_ENV, "0", _flag, "a flag", allowed, "See docs/fused-sync.md.") == "1"


def mode_requested() -> str:
    """Read ``TORCHMETRICS_GRADPATCH_MODE`` (the rule of ``patch(mode=...)``; unset or blank: local)."""
    return _read(MODE_ENV, "local", check_mode, "a gradient mode", "local, global", "See the README.")


def sync_requested() -> str:
    """Read ``TORCHMETRICS_GRADPATCH_SYNC`` (the rule of ``patch(sync=...)``; unset or blank: torchmetrics)."""
    strategies = ", ".join(STRATEGIES)
    return _read(SYNC_ENV, "torchmetrics", check_sync, "a sync strategy", strategies, "See docs/fused-sync.md.")


@dataclass(frozen=True)
class ImportChoice:
    """What the import found in ``TORCHMETRICS_GRADPATCH_AUTOPATCH`` and did with it."""

    patched: bool  #: the import switched the patch on (a refusal of torchmetrics may hold it back since)
    variable: str | None  #: the variable's value at import, or ``None`` when it was unset or blank


_at_import = ImportChoice(patched=False, variable=None)


def at_import() -> ImportChoice:
    """What the import found and did (before :func:`apply_environment` has run: nothing)."""
    return _at_import


def apply_environment() -> None:
    """What the import does: read the variables (any may raise), set the default mode, sync and check, and patch
    unless ``TORCHMETRICS_GRADPATCH_AUTOPATCH`` says not to; record that for :func:`at_import`."""
    global _at_import
    mode, sync, check, autopatch = mode_requested(), sync_requested(), check_requested(), autopatch_requested()
    if check and sync == "torchmetrics" and os.environ.get(SYNC_ENV, "").strip():
        raise ValueError(
            f"{CHECK_ENV}={os.environ[CHECK_ENV]!r} checks the fused sync, but {SYNC_ENV}={os.environ[SYNC_ENV]!r} "
            "chooses torchmetrics' own sync, so nothing would be checked. Set "
            f"{SYNC_ENV}=fused, or unset {CHECK_ENV}. See docs/fused-sync.md."
        )
    raw = os.environ.get(AUTOPATCH_ENV, "")
    _engine.set_defaults(mode=mode, sync=sync, check=check)
    _at_import = ImportChoice(patched=autopatch, variable=raw if raw.strip() else None)
    if autopatch:
        _engine.set_manual(True, by="import")
