"""The patch engine: the one owner of the process's patch state, and the swap of torchmetrics' gather's code.

Contract: every change goes through :func:`set_manual`, :func:`enter_block`, :func:`exit_block` or
:func:`set_defaults` under one lock; :func:`dispatch`, the hot path, reads without it what the last change decided;
:func:`observe` takes one consistent reading for ``status()``. The state, refusals, Ctrl-C and what is installed
when: docs/design.md ("The state"). One module because every transition and the code swap share the lock and its
helpers (``_refresh``, ``_sync``, ``_sweep``). Reloading it is not supported (docs/design.md, "Non-goals").
"""

from __future__ import annotations

import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import wrapt

from torchmetrics_gradpatch import _compile, _modes, _syncs
from torchmetrics_gradpatch._errors import UnsupportedVersionError
from torchmetrics_gradpatch._target import TARGET_MODULE, TARGET_NAME, held_functions, own_function, recognise

#: The one name the trampoline looks up: put into torchmetrics' module namespace (the patched function's
#: ``__globals__``) when the trampoline is first installed, and left there, so a call already inside the
#: trampoline while another thread unpatches still finds it.
DISPATCH_NAME = "__torchmetrics_gradpatch_dispatch__"
#: One open block: its mode (or None), a weak reference to what keeps its ``with`` statement alive (or None for
#: a block entered by calling ``__enter__`` directly, open until exited), its sync strategy (or None) and its sync
#: check (or None).
Record = tuple["str | None", "weakref.ref[Any] | None", "str | None", "bool | None"]
_T = TypeVar("_T")


@dataclass
class _State:
    """Everything the engine knows; mutated only under ``lock``. One per process."""

    manual: bool = False  # the patch()/unpatch() switch is on
    manual_from: str = ""  # who last switched it on: "patch()", "import", or "" (never)
    records: dict[int, Record] = field(default_factory=dict)  # open patched() blocks, oldest first
    next_token: int = 0
    native: bool = False  # the installed torchmetrics keeps the graph itself
    torchmetrics_version: str = "unknown"
    # torchmetrics' gather (a types.FunctionType) once recognised. Typed Any because mypy treats a
    # FunctionType-typed dataclass field as a bound method.
    function: Any = None
    original_code: types.CodeType | None = None
    original_clone: Any = None  # a FunctionType running the original code, whatever __code__ is
    ours_installed: bool = False  # we put the trampoline in and nobody has replaced it since
    hook_registered: bool = False
    default_mode: str = "local"  # TORCHMETRICS_GRADPATCH_MODE, set at import
    manual_mode: str = "local"  # the mode patch() was given
    compile_native: bool = False  # compile_support(): install local mode on native torchmetrics too
    default_sync: str = "torchmetrics"  # TORCHMETRICS_GRADPATCH_SYNC, set at import
    manual_sync: str = "torchmetrics"  # the sync patch() was given
    sync_replaced: bool = False  # the engine has asked _syncs to replace Metric._sync_dist
    default_check: bool = False  # TORCHMETRICS_GRADPATCH_CHECK, set at import
    manual_check: bool = False  # the check patch() was given
    # why torchmetrics' gather was refused (the UnsupportedVersionError's message), once it has been; never cleared
    refusal: str | None = None
    settled: bool = True  # the derived fields, __code__ and Metric._sync_dist match the records and switches
    # Derived from the above by _refresh(), under the lock:
    in_force: bool = False  # manual or any record, and not held back
    held_back: bool = False  # manual or any record, but what they ask for needs the refused gather
    blocks: int = 0  # len(records)
    block_modes: list[tuple[int, str]] = field(default_factory=list)  # open blocks with a mode, oldest first
    mode: str = "local"  # the effective mode
    block_syncs: list[tuple[int, str]] = field(default_factory=list)  # open blocks with a sync, oldest first
    sync: str = "torchmetrics"  # the effective sync strategy
    block_checks: list[tuple[int, bool]] = field(default_factory=list)  # open blocks with a check, oldest first
    check: bool = False  # the chosen check, in force or not
    # the check in effect now (``check`` while in force): one field, so effective_check() reads no half-change
    checking: bool = False
    # What dispatch() calls: the effective mode's gather while the patch is in force and torchmetrics' gather is
    # recognised, else None (dispatch then runs the original).
    gather: Callable[..., Any] | None = None
    is_compiling: Callable[[], bool] = field(default=lambda: False)  # torch's check, set with ``gather``
    lock: Any = field(default_factory=threading.RLock)


_state = _State()
_lock = _state.lock


def _trampoline(result, group=None):  # type: ignore[no-untyped-def]
    # This code object is transplanted into torchmetrics' own function; it runs with torchmetrics' globals
    # and the function's own defaults, so it may only use builtins and the one name the engine put into those
    # globals (DISPATCH_NAME: a dict lookup, no import). Its signature mirrors the original's.
    return __torchmetrics_gradpatch_dispatch__(result, group)  # type: ignore[name-defined]  # noqa: F821


_TRAMPOLINE_CODE: types.CodeType = _trampoline.__code__


def dispatch(result: Any, group: Any = None) -> list[Any]:
    """Entry point of the trampoline, the hot path: the effective mode's gather while in force, else the original.
    A change an asynchronous exception cut short is finished first, unless another thread is making one now."""
    if not _state.settled and _lock.acquire(blocking=False):
        try:
            _sweep()
        finally:
            _lock.release()
    gather = _state.gather
    if gather is not None:
        if _state.is_compiling():  # under torch.compile: a graph break, the gather runs eagerly
            return _compile.run_eagerly(gather, result, group)  # type: ignore[no-any-return]
        return gather(result, group)  # type: ignore[no-any-return]
    original = _state.original_clone
    if original is None:  # cannot happen once recognised; keep the failure explicit
        raise RuntimeError("torchmetrics_gradpatch: trampoline called before torchmetrics was recognised")
    return original(result, group)  # type: ignore[no-any-return]


def _adopt(module: types.ModuleType) -> None:
    """Recognise torchmetrics' gather in ``module`` and bring it in line with the state. A refusal is recorded
    (``_state.refusal``) before it is raised, with nothing changed."""
    with _lock:
        if _state.refusal is not None:
            raise UnsupportedVersionError(_state.refusal)
        try:
            function = recognise(module, _state.torchmetrics_version, native=_state.native)
        except UnsupportedVersionError as error:
            _state.refusal = str(error)
            raise
        if _state.function is function:
            return
        original = function.__code__
        _state.settled = False
        _state.function = function
        _state.original_code = original
        _state.original_clone = types.FunctionType(
            original, function.__globals__, function.__name__, function.__defaults__, function.__closure__
        )
        _settle()


def _on_import(module: types.ModuleType) -> None:
    """wrapt post-import hook for ``torchmetrics.utilities.distributed`` (wrapt fires each hook once).

    On native torchmetrics the gather is looked at only while the trampoline is wanted, so an unrecognised (future)
    gather never makes ``import torchmetrics`` fail in local mode. A refusal is raised from torchmetrics' import
    once the state is settled with it, so nothing of torchmetrics is changed then or later.
    """
    with _lock:
        _state.hook_registered = False
        if _state.native and not _wanted():
            return  # the next change that wants the trampoline adopts the module (see _sync)
        try:
            _adopt(module)
        except UnsupportedVersionError:
            _state.settled = False
            _settle()
            raise


def _wanted() -> bool:
    """Whether torchmetrics' function should be running our trampoline right now."""
    return _state.in_force and (not _state.native or _state.mode == "global" or _state.compile_native)


def _chosen(blocks: list[tuple[int, _T]], manual: _T, default: _T) -> _T:
    """The mode, sync or check in effect: the newest open block's that names one, else patch()'s while on, else the
    default."""
    if blocks:
        return blocks[-1][1]
    return manual if _state.manual else default


def _refresh() -> None:
    """Recompute what is derived from the records and switches: counts, the mode, what dispatch calls. Under lock.
    The gather is looked up only once torchmetrics' is recognised: torch is imported by then."""
    records = _state.records
    _state.blocks = len(records)
    _state.block_modes = (
        [(token, mode) for token, (mode, _, _, _) in records.items() if mode is not None] if records else []
    )
    _state.block_syncs = (
        [(token, sync) for token, (_, _, sync, _) in records.items() if sync is not None] if records else []
    )
    _state.block_checks = (
        [(token, check) for token, (_, _, _, check) in records.items() if check is not None] if records else []
    )
    _state.mode = _chosen(_state.block_modes, _state.manual_mode, _state.default_mode)
    _state.sync = _chosen(_state.block_syncs, _state.manual_sync, _state.default_sync)
    _state.check = _chosen(_state.block_checks, _state.manual_check, _state.default_check)
    # "in force" is computed here only; everything else reads this field. A refused gather holds back all that
    # needs it: before 1.6 the patch itself, on native torchmetrics the global mode and compile support.
    asked = _state.manual or bool(records)
    needs_gather = not _state.native or _state.mode == "global" or _state.compile_native
    _state.held_back = asked and needs_gather and _state.refusal is not None
    _state.in_force = asked and not _state.held_back
    _state.checking = _state.check and _state.in_force
    _state.gather = _modes.gather_for(_state.mode) if _state.in_force and _state.function is not None else None
    if _state.gather is not None:
        _state.is_compiling = _compile.is_compiling_function()


def refresh() -> None:
    """Recompute what dispatch calls (after :data:`torchmetrics_gradpatch._modes.GATHERS` changed)."""
    with _lock:
        _refresh()


def effective_mode() -> str:
    """The gradient mode a sync called now uses (a strategy asks at every sync; one attribute read, no lock)."""
    return _state.mode


def effective_sync() -> str:
    """The sync strategy a Metric sync called now uses: the chosen one while the patch is in force, else
    ``"torchmetrics"`` (one attribute read, no lock)."""
    return _state.sync if _state.in_force else "torchmetrics"


def effective_check() -> bool:
    """Whether a fused sync called now also runs torchmetrics' own sync on the same states and compares: the chosen
    check while the patch is in force, else ``False`` (the fused sync asks at every sync; one attribute read, no
    lock)."""
    return _state.checking


def _sync() -> None:
    """Make ``__code__`` and ``Metric._sync_dist`` match the state. Under ``_lock``."""
    _sync_gather()
    _sync_metric()


def _sync_metric() -> None:
    """Replace ``Metric._sync_dist`` (:mod:`._syncs`, on native torchmetrics too) while in force with a feature's
    strategy or the trampoline wanted; else take out the replacement the engine asked for, and no other."""
    # the flag is set before and cleared after the (idempotent) call, so an interrupted one is finished later
    if _state.in_force and (_state.sync != "torchmetrics" or _wanted()):
        _state.sync_replaced = True
        _syncs.install(_state.sync, mode=effective_mode)  # idempotent: wraps at most once
    elif _state.sync_replaced:
        _syncs.uninstall()
        _state.sync_replaced = False


def _sync_gather() -> None:
    """Make ``__code__`` match the state. Under ``_lock``; a single assignment either way, so never half-done."""
    function = _state.function
    if function is None:
        if _wanted():
            _ensure_hook()
        return
    current = function.__code__
    if _wanted():
        if current is _TRAMPOLINE_CODE:
            function.__globals__[DISPATCH_NAME] = dispatch  # this copy's (a reloaded module's) dispatch
            _state.ours_installed = True
            return
        if current is not _state.original_code:
            raise RuntimeError(
                f"torchmetrics_gradpatch: {TARGET_MODULE}.{TARGET_NAME} has been modified in place by another "
                "tool (its __code__ is neither the original nor ours); refusing to overwrite it. "
                "Remove the other patch, or import torchmetrics_gradpatch before it."
            )
        function.__globals__[DISPATCH_NAME] = dispatch
        _state.ours_installed = True  # before the swap: an interrupt after it must not look like another tool
        function.__code__ = _TRAMPOLINE_CODE
        _compile.watch_dynamo()  # torch.compile: the graph break's wrapper, once dynamo is imported
    elif current is _TRAMPOLINE_CODE or current is _state.original_code:
        if current is not _state.original_code:  # (it is after an uninstall an interrupt cut short)
            function.__code__ = _state.original_code
        _state.ours_installed = False
    elif _state.ours_installed:
        _state.ours_installed = False
        warnings.warn(
            f"torchmetrics_gradpatch: another tool has replaced the code of {TARGET_MODULE}.{TARGET_NAME} on "
            "top of this patch; leaving it in place. Our trampoline, if restored later, behaves as the original "
            "while the patch is off.",
            RuntimeWarning,
            stacklevel=5,  # the caller of set_manual() and the like
        )


def _ensure_hook() -> None:
    """Adopt torchmetrics now if it is imported, else register (once) a hook that adopts it on import."""
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        _adopt(module)
    elif not _state.hook_registered:
        _state.hook_registered = True
        wrapt.register_post_import_hook(_on_import, TARGET_MODULE)


def _settle() -> None:
    """Bring the derived fields, ``__code__`` and ``Metric._sync_dist`` in line with the records and switches.

    Under ``_lock``; each step is idempotent, so a run an asynchronous exception cut short is finished by the next.
    An error of ours (an ``Exception``) would be raised again by every retry, so it leaves the state settled.
    """
    try:
        _refresh()
        _sync()
    except Exception:
        _state.settled = True
        raise
    _state.settled = True


def _change(undo: Callable[[], object], *, asks: bool = False) -> None:
    """Settle after a change (``_state.settled`` cleared by the caller); on failure ``undo`` it and re-raise.

    ``asks``: the change asks for the patch, so a refusal of the gather it needs is raised before anything is
    swapped. An asynchronous exception may have cut the swap short: the state is then left for the next reading
    to settle.
    """
    try:
        if asks:
            _refresh()
            if _state.held_back:
                raise UnsupportedVersionError(_state.refusal)
        _settle()
    except BaseException as error:
        undo()
        _refresh()
        _state.settled = isinstance(error, Exception)
        raise


def configure(*, native: bool, torchmetrics_version: str) -> None:
    """Record what the version gate found. Before 1.6, recognise the gather now (or when torchmetrics is imported),
    so an unrecognised one is refused by the import; on native torchmetrics nothing is looked at until needed."""
    with _lock:
        _state.native = native
        _state.torchmetrics_version = torchmetrics_version
        if not native:
            _ensure_hook()


def set_manual(
    on: bool, mode: str | None = None, *, by: str = "patch()", sync: str | None = None, check: bool | None = None
) -> None:
    """``patch()`` / ``unpatch()`` (``by="import"``: the import's own patch); idempotent. Turning it on sets the
    mode, sync and check ``patch()`` stands for (``None``: the default)."""
    with _lock:
        _sweep()
        previous = _state.manual, _state.manual_mode, _state.manual_from, _state.manual_sync, _state.manual_check

        def undo() -> None:
            _state.manual, _state.manual_mode, _state.manual_from, _state.manual_sync, _state.manual_check = previous

        _state.settled = False
        _state.manual = on
        if on:
            _state.manual_mode = _state.default_mode if mode is None else mode
            _state.manual_sync = _state.default_sync if sync is None else sync
            _state.manual_check = _state.default_check if check is None else check
            _state.manual_from = by
        _change(undo, asks=on)


def set_defaults(
    *,
    mode: str | None = None,
    sync: str | None = None,
    compile_support: bool | None = None,
    check: bool | None = None,
) -> None:
    """Set what applies when neither ``patch()`` nor a ``patched()`` block names one: the default ``mode``, ``sync``
    and ``check`` (from the environment at import), and ``compile_support`` (on native torchmetrics, install the
    trampoline in local mode too). ``None`` leaves a field as it is."""
    if compile_support is not None:
        _compile.watch_dynamo()
    with _lock:
        previous = _state.default_mode, _state.default_sync, _state.compile_native, _state.default_check

        def undo() -> None:
            _state.default_mode, _state.default_sync, _state.compile_native, _state.default_check = previous

        _state.settled = False
        _state.default_mode = previous[0] if mode is None else mode
        _state.default_sync = previous[1] if sync is None else sync
        _state.compile_native = previous[2] if compile_support is None else compile_support
        _state.default_check = previous[3] if check is None else check
        _change(undo, asks=bool(compile_support))


def enter_block(
    mode: str | None = None, alive: weakref.ref[Any] | None = None, sync: str | None = None, check: bool | None = None
) -> int:
    """Open one ``patched()`` block and return its token, which :func:`exit_block` takes.

    ``mode`` / ``sync`` / ``check``: what the block sets while no newer block sets one (``None``: leaves it alone).
    ``alive``: a weak reference to what keeps the block's ``with`` statement alive; once it is dead the block is
    closed whether or not its exit ran.
    """
    with _lock:
        _sweep()
        token = _state.next_token
        _state.next_token = token + 1
        _state.settled = False
        _state.records[token] = (mode, alive, sync, check)  # the block is open from this one store on
        _change(lambda: _state.records.pop(token, None), asks=True)
        return token


def exit_block(token: int | None = None) -> None:
    """Close the block ``token`` names (``None``: the newest open block); closing one that is closed is a no-op."""
    with _lock:
        _sweep()
        if token is None:
            if not _state.records:
                raise RuntimeError("torchmetrics_gradpatch: patched() exited more often than it was entered")
            token = next(reversed(_state.records))
        if token in _state.records:
            _state.settled = False
            del _state.records[token]  # the block is closed from this one deletion on
            _settle()


def _sweep() -> None:
    """Finish a change cut short and drop the records whose ``with`` statement is gone. Under the lock, before any
    use of the records or the derived state."""
    if not _state.settled:
        _settle()
    if not _state.records:
        return
    dead = [token for token, (_, alive, _, _) in _state.records.items() if alive is not None and alive() is None]
    if dead:
        _state.settled = False
        for token in dead:
            _state.records.pop(token, None)
        _settle()


def in_force() -> bool:
    """Whether the patch is in force: ``patch()`` is on or a ``patched()`` block is open."""
    if _state.records or not _state.settled:
        with _lock:
            _sweep()
    return _state.in_force


def snapshot() -> _State:
    """A copy of the engine state, taken under the lock."""
    with _lock:
        _sweep()
        copy = _State(**vars(_state))
        copy.records = dict(_state.records)
        copy.block_modes = list(_state.block_modes)
        copy.block_syncs = list(_state.block_syncs)
        copy.block_checks = list(_state.block_checks)
        return copy


def installed() -> bool:
    """Whether torchmetrics' function currently runs our trampoline."""
    function = _state.function
    return function is not None and function.__code__ is _TRAMPOLINE_CODE


class Observation(NamedTuple):
    """One consistent reading of the engine, taken under its lock: what ``status()`` is derived from."""

    state: _State  #: a copy of the engine's state
    installed: bool  #: our trampoline is torchmetrics' function's code now (in force or not)
    imported: bool  #: ``torchmetrics.utilities.distributed`` is imported
    function: Any  #: torchmetrics' own gather (``None`` when torchmetrics is not imported)
    held: dict[str, Any]  #: what each path into the gather holds (:func:`._target.held_functions`)
    sync_dist: str | None  #: the strategy ``Metric._sync_dist``'s replacement runs now, ``None`` when not in place
    sites: tuple[str, ...]  #: further sites the strategy in force has put in place


def observe() -> Observation:
    """Read the engine and what torchmetrics' paths hold, under the lock. The function is the adopted one, or (never
    adopted: native torchmetrics in local mode) the one torchmetrics holds, not judged."""
    with _lock:
        _sweep()
        module = sys.modules.get(TARGET_MODULE)
        function = _state.function
        if function is None and module is not None:
            function = own_function(module)
        return Observation(
            state=snapshot(),
            installed=installed(),
            imported=module is not None,
            function=function,
            held=held_functions(module) if module is not None else {},
            sync_dist=_syncs.installed(),
            sites=_syncs.sites(),
        )
