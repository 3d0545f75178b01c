"""Patch engine: make every reference to torchmetrics' gather keep the graph, and restore it exactly.

How it reaches every reference
------------------------------
torchmetrics reaches its gather by at least four paths: the module attribute in
``torchmetrics.utilities.distributed``, the copy imported into ``torchmetrics.metric``'s namespace (looked up
by ``Metric.sync``), the default argument of ``Metric._sync_dist`` (bound when the class was created), and
whatever user code holds: ``from ... import gather_all_tensors`` aliases, ``functools.partial`` objects,
metrics built with ``dist_sync_fn=gather_all_tensors``. All of them hold the *same function object*.

Two designs were measured on this project's machines (``docs/design.md``; ``benchmarks/run_all.py``'s toggle
section re-measures the module scan against a ``patched()`` block):

* Replace the object wherever it is referenced (the freezegun way, or a ``wrapt`` wrapper assigned to each
  attribute): one scan of every loaded module costs milliseconds, ``gc.get_referrers`` about ten times that, and
  neither reaches a ``partial`` or a default-argument tuple without walking the whole heap.
* Change the function object itself (the time-machine way): its ``__code__`` is swapped for a one-line
  trampoline into this package. Every holder of the object sees the change at once, at O(1): a
  ``with patched(): pass`` block costs a few microseconds, far less than 1% of one module scan.

We use the second. The function object, its ``__defaults__``, ``__globals__``, annotations and identity never
change; only ``__code__`` is swapped while the patch is in force, and swapped back -- the very same code
object -- when it is not. The original code's location is also recorded on the function
(``__torchmetrics_gradpatch_original__``) while patched, so a re-imported copy of this package can still
restore it; the attribute is removed on restore.

The trampoline runs with torchmetrics' globals, so it reaches :func:`dispatch` through one name the engine puts
into that module's namespace (``DISPATCH_NAME``) when it first installs the trampoline: a dict lookup, where an
``import`` statement in the trampoline cost most of a microsecond per call. The name stays there after
``unpatch()`` (a call that already entered the trampoline in another thread must still find it).
:func:`dispatch` calls the function the state chose (``_State.gather``), recomputed under the lock at every change.

One state per process
---------------------
The state (:class:`_State`, with its lock and the trampoline's code object) is kept on :mod:`sys`
(``SHARED_NAME``), not in this module: ``importlib.reload`` of any module of the package (notebook autoreload
reloads them all) or a second copy imported after clearing ``sys.modules`` re-runs this module's code, and each
copy then finds the same state -- so torchmetrics' gather keeps working, ``is_patched()`` answers the same in
every copy, and any copy's ``unpatch()`` restores the original code without a false warning.

Coexistence
-----------
Another tool's wrapper placed around the gather (a ``wrapt``/``functools.wraps`` wrapper assigned to the
module attribute, say) calls the original function object, so it sees the patch and is never removed by us.
If another tool has swapped ``__code__`` on top of ours, ``unpatch()`` leaves its code in place and warns:
restoring would destroy its patch. The trampoline itself checks whether the patch is in force and, if not,
runs the original code, so even then behaviour is the original's once our patch is off.

State model
-----------
The patch is in force while ``patch()`` is on **or** any ``patched()`` block is open (a counter, so blocks may
close in any order and from any thread). All state changes happen under one lock.

Gradient mode (``"local"`` or ``"global"``, see :mod:`torchmetrics_gradpatch._global`): the mode of the most
recently opened ``patched(mode=...)`` block that is still open; with no such block, the mode ``patch()`` was
given while ``patch()`` is on; otherwise the default mode (``TORCHMETRICS_GRADPATCH_MODE``, else ``"local"``).
Blocks opened without a mode count towards "in force" but never choose the mode. The effective mode, and the
gather it means, are recomputed under the lock at every change and read, lock-free, by :func:`dispatch`.

What is installed: on torchmetrics before 1.6 the trampoline goes in whenever the patch is in force. On
native torchmetrics (1.6.0 and newer) the local mode installs **nothing** -- torchmetrics' own gather already
has these semantics -- while the global mode installs the trampoline like anywhere else, because no
torchmetrics has a global-mode backward; it comes out again as soon as the mode is back to local. On native
torchmetrics the gather is not even looked at (recognised) until the global mode is wanted, so a future
torchmetrics whose gather this package does not know imports fine in local mode, and ``patch(mode="global")``
refuses it with :class:`UnsupportedVersionError`, changing nothing.

torchmetrics need not be imported yet: a ``wrapt`` post-import hook recognises and patches
``torchmetrics.utilities.distributed`` the moment it is imported.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import wrapt

from torchmetrics_gradpatch import _compile, _modes
from torchmetrics_gradpatch._version import UnsupportedVersionError

TARGET_MODULE = "torchmetrics.utilities.distributed"
TARGET_NAME = "gather_all_tensors"
_ORIGINAL_ATTR = "__torchmetrics_gradpatch_original__"
#: The one name the trampoline looks up: put into torchmetrics' module namespace (the patched function's
#: ``__globals__``) when the trampoline is first installed, and left there, so a call already inside the
#: trampoline while another thread unpatches still finds it.
DISPATCH_NAME = "__torchmetrics_gradpatch_dispatch__"
#: Where the process-wide state lives (see "One state per process" above): an attribute of :mod:`sys`.
SHARED_NAME = "_torchmetrics_gradpatch_engine"
_SCHEMA = 3  # bumped whenever _State changes shape; a state of another shape is not shared


@dataclass
class _State:
    """Everything the engine knows; mutated only under ``lock``. One per process (see :func:`_shared_state`)."""

    manual: bool = False  # patch() is on
    blocks: int = 0  # open patched() blocks
    native: bool = False  # the installed torchmetrics keeps the graph itself
    torchmetrics_version: str = "unknown"
    # torchmetrics' gather (a types.FunctionType) once its module is imported. Typed Any because mypy treats a
    # FunctionType-typed dataclass field as a bound method.
    function: Any = None
    original_code: types.CodeType | None = None
    original_clone: Any = None  # a FunctionType running the original code, whatever __code__ is
    ours_installed: bool = False  # we put the trampoline in and nobody has replaced it since
    hook_registered: bool = False
    default_mode: str = "local"  # TORCHMETRICS_GRADPATCH_MODE, read by _api at import
    manual_mode: str = "local"  # the mode patch() was given
    block_modes: list[tuple[int, str]] = field(default_factory=list)  # open patched(mode=...) blocks, oldest first
    next_token: int = 0
    mode: str = "local"  # the effective mode (see "State model"), recomputed by _refresh_mode()
    # What dispatch() calls: the effective mode's gather while the patch is in force and torchmetrics' gather is
    # recognised, else None (dispatch then runs the original). Recomputed by _refresh_mode().
    gather: Callable[..., Any] | None = None
    trampoline: types.CodeType | None = None  # the trampoline code object every copy of this module installs
    schema: int = _SCHEMA
    lock: Any = field(default_factory=threading.RLock)
    compile_native: bool = False  # _compile.compile_support(): install local mode on native torchmetrics too
    # torch's is_compiling check, set with ``gather`` (torch is imported by then): dispatch's graph break
    is_compiling: Callable[[], bool] = field(default=lambda: False)


def _shared_state() -> _State:
    """The process's engine state: the one an earlier import (or copy) of this module left on :mod:`sys`, else new.

    ``importlib.reload`` of this module, or a second copy imported after ``sys.modules`` was cleared, re-runs this
    module's code; keeping the state outside the module is what keeps torchmetrics' patched function, the patch's
    state and the lock the same for every copy.
    """
    existing: Any = getattr(sys, SHARED_NAME, None)
    if getattr(existing, "schema", None) == _SCHEMA:
        return existing  # type: ignore[no-any-return]
    state = _State()
    setattr(sys, SHARED_NAME, state)
    return state


_state = _shared_state()
_lock = _state.lock


def _trampoline(result, group=None):  # type: ignore[no-untyped-def]
    # This code object is transplanted into torchmetrics' own function; it runs with torchmetrics' globals
    # and the function's own defaults, so it may only use builtins and the one name the engine put into those
    # globals (DISPATCH_NAME: a dict lookup, no import). Its signature mirrors the original's.
    return __torchmetrics_gradpatch_dispatch__(result, group)  # type: ignore[name-defined]  # noqa: F821


if _state.trampoline is None:
    _state.trampoline = _trampoline.__code__
_TRAMPOLINE_CODE: types.CodeType = _state.trampoline


def _is_trampoline(code: types.CodeType) -> bool:
    """True for our trampoline, including one installed by an earlier, re-imported copy of this module."""
    return code is _TRAMPOLINE_CODE or (
        code.co_name == _TRAMPOLINE_CODE.co_name and code.co_filename == _TRAMPOLINE_CODE.co_filename
    )


def dispatch(result: Any, group: Any = None) -> list[Any]:
    """Entry point of the trampoline: the effective mode's gather while in force, else the original.

    The hot path of every patched gather: two attribute reads, torch's is_compiling check and one call. Everything
    else (the mode, whether the patch is in force, which function that means) was decided under the lock when the
    state last changed.
    """
    gather = _state.gather
    if gather is not None:
        if _state.is_compiling():  # under torch.compile: a graph break, the gather runs eagerly (see _compile.py)
            return _compile.gather_when_compiling(result, group, _state.mode)
        return gather(result, group)  # type: ignore[no-any-return]
    original = _state.original_clone
    if original is None:  # cannot happen once recognised; keep the failure explicit
        raise RuntimeError("torchmetrics_gradpatch: trampoline called before torchmetrics was recognised")
    return original(result, group)  # type: ignore[no-any-return]


def recognise(module: types.ModuleType, torchmetrics_version: str, *, native: bool = False) -> types.FunctionType:
    """Return torchmetrics' gather function, or raise :class:`UnsupportedVersionError` naming why not.

    ``native``: the installed torchmetrics keeps the graph itself, so only the global mode needs the function;
    the message then says that local mode still works.
    """
    where = f"torchmetrics {torchmetrics_version} ({TARGET_MODULE}.{TARGET_NAME})"
    if native:
        advice = (
            "torchmetrics_gradpatch cannot install its global mode on this torchmetrics (it knows torchmetrics 0.11 "
            "to 1.9); nothing was patched. The local mode needs no patch here (torchmetrics >= 1.6 keeps the "
            "graph itself) and keeps working: use patch() / patched() without mode='global'."
        )
    else:
        advice = "torchmetrics_gradpatch supports torchmetrics 0.11 to 1.9; nothing was patched."
    candidate = getattr(module, TARGET_NAME, None)
    if candidate is None:
        raise UnsupportedVersionError(f"{where}: the function does not exist. {advice}")
    function = inspect.unwrap(candidate)  # look through functools.wraps-style wrappers to the function
    if not isinstance(function, types.FunctionType):
        raise UnsupportedVersionError(f"{where}: expected a Python function, found {type(function).__name__}. {advice}")
    code = function.__code__
    if _is_trampoline(code) and isinstance(function.__dict__.get(_ORIGINAL_ATTR), types.CodeType):
        code = function.__dict__[_ORIGINAL_ATTR]  # patched by an earlier copy of this package
    plain_positional = not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    if not (
        plain_positional
        and (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount) == (2, 0, 0)
        and code.co_varnames[:2] == ("result", "group")
        and function.__defaults__ == (None,)
        and not code.co_freevars
    ):
        raise UnsupportedVersionError(
            f"{where}: unrecognised signature {TARGET_NAME}{inspect.signature(function)}; expected "
            f"{TARGET_NAME}(result, group=None). {advice}"
        )
    return function


def _adopt(module: types.ModuleType) -> None:
    """Recognise torchmetrics' gather in ``module`` and bring it in line with the current state."""
    with _lock:
        function = recognise(module, _state.torchmetrics_version, native=_state.native)
        if _state.function is function:
            return
        saved = function.__dict__.get(_ORIGINAL_ATTR)
        original = saved if saved is not None and _is_trampoline(function.__code__) else function.__code__
        _state.function = function
        _state.original_code = original
        _state.original_clone = types.FunctionType(
            original, function.__globals__, function.__name__, function.__defaults__, function.__closure__
        )
        _refresh_mode()
        _sync()


def _on_import(module: types.ModuleType) -> None:
    """wrapt post-import hook for ``torchmetrics.utilities.distributed`` (wrapt fires each hook once).

    On native torchmetrics the gather is only looked at while the global mode wants it installed: in local mode
    nothing is patched there, so an unrecognised (future) gather must not make ``import torchmetrics`` fail.
    """
    with _lock:
        _state.hook_registered = False
        if _state.native and not _wanted():
            return  # the next change that wants the trampoline adopts the module (see _sync)
        _adopt(module)


def _wanted() -> bool:
    """Whether torchmetrics' function should be running our trampoline right now."""
    return (_state.manual or _state.blocks > 0) and (
        not _state.native or _state.mode == "global" or _state.compile_native  # compile_support()
    )


def _refresh_mode() -> None:
    """Recompute the effective gradient mode (see "State model") and what dispatch calls. Under ``_lock``.

    The gather function is looked up only once torchmetrics' gather is recognised: torchmetrics (and so torch) is
    imported by then, and ``import torchmetrics_gradpatch`` alone imports neither.
    """
    if _state.block_modes:
        _state.mode = _state.block_modes[-1][1]
    elif _state.manual:
        _state.mode = _state.manual_mode
    else:
        _state.mode = _state.default_mode
    in_force_now = _state.manual or _state.blocks > 0
    _state.gather = _modes.gather_for(_state.mode) if in_force_now and _state.function is not None else None
    if _state.gather is not None:
        _state.is_compiling = _compile.check()


def refresh() -> None:
    """Recompute what dispatch calls (after :data:`torchmetrics_gradpatch._modes.GATHERS` changed)."""
    with _lock:
        _refresh_mode()


def _sync() -> None:
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
            return
        if current is not _state.original_code and not _is_trampoline(current):
            raise RuntimeError(
                f"torchmetrics_gradpatch: {TARGET_MODULE}.{TARGET_NAME} has been modified in place by another "
                "tool (its __code__ is neither the original nor ours); refusing to overwrite it. "
                "Remove the other patch, or import torchmetrics_gradpatch before it."
            )
        function.__dict__[_ORIGINAL_ATTR] = _state.original_code
        function.__globals__[DISPATCH_NAME] = dispatch
        function.__code__ = _TRAMPOLINE_CODE
        _state.ours_installed = True
        _compile.watch_dynamo()  # torch.compile: the graph break's wrapper, once dynamo is imported
    elif _is_trampoline(current):
        function.__code__ = _state.original_code
        function.__dict__.pop(_ORIGINAL_ATTR, None)
        _state.ours_installed = False
    elif _state.ours_installed:
        _state.ours_installed = False
        warnings.warn(
            f"torchmetrics_gradpatch: another tool has replaced the code of {TARGET_MODULE}.{TARGET_NAME} on "
            "top of this patch; leaving it in place. Our trampoline, if restored later, behaves as the original "
            "while the patch is off.",
            RuntimeWarning,
            stacklevel=4,
        )


def _ensure_hook() -> None:
    """Adopt torchmetrics now if it is imported, else register (once) a hook that adopts it on import.

    If the hook refused an unrecognised torchmetrics, that import failed; should torchmetrics be imported
    after all, the next state change lands here and refuses again instead of silently doing nothing.
    """
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        _adopt(module)
    elif not _state.hook_registered:
        _state.hook_registered = True
        wrapt.register_post_import_hook(_on_import, TARGET_MODULE)


def configure(*, native: bool, torchmetrics_version: str) -> None:
    """Record what the version gate found, and adopt torchmetrics now if it is already imported.

    Before 1.6 the gather is recognised at once (or when torchmetrics is imported), patch in force or not, so an
    unrecognised torchmetrics is refused by the import. On native torchmetrics nothing is looked at until the
    global mode is wanted: the local mode patches nothing there, and ``patch(mode="global")`` refuses instead.
    """
    with _lock:
        _state.native = native
        _state.torchmetrics_version = torchmetrics_version
        if not native:
            _ensure_hook()


def set_manual(on: bool, mode: str | None = None) -> None:
    """``patch()`` / ``unpatch()``: switch the manual flag; idempotent.

    Turning it on sets the mode ``patch()`` stands for: ``mode``, or the default mode when ``None``.
    """
    with _lock:
        previous = _state.manual, _state.manual_mode
        _state.manual = on
        if on:
            _state.manual_mode = _state.default_mode if mode is None else mode
        try:
            _refresh_mode()
            _sync()
        except BaseException:
            _state.manual, _state.manual_mode = previous
            _refresh_mode()
            raise


def set_default_mode(mode: str) -> None:
    """Set the mode used when neither ``patch()`` nor a ``patched()`` block names one."""
    with _lock:
        _state.default_mode = mode
        _refresh_mode()
        _sync()


def enter_block(mode: str | None = None) -> int | None:
    """Open one ``patched()`` block; with a ``mode``, return the token that :func:`exit_block` must be given."""
    with _lock:
        token = None
        if mode is not None:
            token = _state.next_token
            _state.next_token += 1
            _state.block_modes.append((token, mode))
        _state.blocks += 1
        try:
            _refresh_mode()
            _sync()
        except BaseException:
            _state.blocks -= 1
            if token is not None:
                _state.block_modes.pop()
            _refresh_mode()
            raise
        return token


def exit_block(token: int | None = None) -> None:
    """Close one ``patched()`` block (the one ``token`` names, for a block opened with a mode)."""
    with _lock:
        if _state.blocks <= 0:
            raise RuntimeError("torchmetrics_gradpatch: patched() exited more often than it was entered")
        _state.blocks -= 1
        if token is not None:
            _state.block_modes[:] = [entry for entry in _state.block_modes if entry[0] != token]
        if not _state.blocks:
            _state.block_modes.clear()
        _refresh_mode()
        _sync()


def in_force() -> bool:
    """Whether the patch is in force: ``patch()`` is on or a ``patched()`` block is open."""
    return _state.manual or _state.blocks > 0


def snapshot() -> _State:
    """A copy of the engine state, for :func:`torchmetrics_gradpatch.status`."""
    with _lock:
        copy = _State(**vars(_state))
        copy.block_modes = list(_state.block_modes)
        return copy


def installed() -> bool:
    """Whether torchmetrics' function currently runs our trampoline."""
    function = _state.function
    return function is not None and _is_trampoline(function.__code__)
