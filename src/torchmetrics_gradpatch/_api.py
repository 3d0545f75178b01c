"""The public patch API: ``patch``, ``unpatch``, ``is_patched``, ``patched`` and ``status``.

The state model, in one sentence: the patch is in force while ``patch()`` is on **or** any ``patched()``
block is open. ``import torchmetrics_gradpatch`` calls ``patch()`` unless ``TORCHMETRICS_GRADPATCH_AUTOPATCH``
is ``0``. Blocks are counted, not stacked, so they nest, may be closed in any order and from any thread, and
each one's exit undoes exactly its own entry -- also when the block raises. Calling ``patch()`` or
``unpatch()`` inside a block changes only the ``patch()`` switch: it takes effect once the blocks are closed.

``patched`` works with and without parentheses: ``@patched`` is ``@patched()``.

The gradient mode (``"local"`` or ``"global"``, in any case; README, "Gradient modes"), in one sentence: the mode of the
most recently opened ``patched(mode=...)`` block that is still open wins; with none open, the mode ``patch()``
was given while it is on; otherwise the default mode. The default mode is ``TORCHMETRICS_GRADPATCH_MODE``
(read once, at import; ``"local"`` when unset) and is also what ``patch()`` without a mode stands for, so it
chooses the mode of the import-time patch. ``patched()`` without a mode never chooses: it only keeps the
patch in force. The mode is process-wide, like the patch itself: a block opened in one thread sets the mode
for every thread until it exits, and blocks may exit in any order (a block that exits while a newer one is
still open changes nothing until that newer one exits too).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, TypeVar, cast, overload

import wrapt

from torchmetrics_gradpatch import _engine, _fused
from torchmetrics_gradpatch._modes import MODES, check_mode

F = TypeVar("F", bound=Callable[..., Any])

AUTOPATCH_ENV = "TORCHMETRICS_GRADPATCH_AUTOPATCH"
MODE_ENV = "TORCHMETRICS_GRADPATCH_MODE"
SYNC_ENV = "TORCHMETRICS_GRADPATCH_SYNC"
_TRUE = {"", "1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def patch(mode: str | None = None, sync: str | None = None) -> None:
    """Put the graph-preserving gather in force until :func:`unpatch`. Idempotent.

    Args:
        mode: ``"local"`` or ``"global"`` (README, "Gradient modes"; case-insensitive); ``None`` means the default
            mode (``TORCHMETRICS_GRADPATCH_MODE``, else ``"local"``). Calling ``patch`` again changes the mode.

    In local mode on a torchmetrics that keeps the graph natively (1.6.0 and newer) nothing is changed; the
    global mode is installed on every torchmetrics. If torchmetrics is not imported yet, the patch lands the
    moment ``torchmetrics.utilities.distributed`` is imported.

    ``sync``: ``"torchmetrics"`` (its own collectives) or ``"fused"`` (two collectives per Metric sync,
    docs/fused-sync.md); ``None`` means ``TORCHMETRICS_GRADPATCH_SYNC``, else ``"torchmetrics"``.
    """
    chosen = sync_requested() if sync is None else _fused.check_sync(sync)
    _engine.set_manual(True, None if mode is None else check_mode(mode))
    _fused.install(chosen, mode=lambda: _engine.snapshot().mode)


def unpatch() -> None:
    """Switch off what :func:`patch` switched on (open ``patched()`` blocks stay in force). Idempotent.

    Once nothing holds the patch in force, torchmetrics' gather gets back its original code object; the fused
    sync, if on, is switched off (``Metric._sync_dist`` is torchmetrics' own function object again).
    """
    _engine.set_manual(False)
    _fused.uninstall()


def is_patched() -> bool:
    """Whether the patch is in force: :func:`patch` is on or a :func:`patched` block is open.

    On native torchmetrics (1.6.0 and newer) the patch can be "in force" without anything being replaced;
    :func:`status` tells the two apart.
    """
    return _engine.in_force()


class _Patched:
    """What :func:`patched` returns: a context manager and decorator keeping the patch in force.

    ``with patched(): ...`` and ``@patched()`` nest, are thread-safe and, on exit, undo only their own entry
    (also when the block raises), so the state found at entry is restored unless the block itself called
    :func:`patch` or :func:`unpatch`. As a decorator, each call of the function opens its own block; coroutine
    functions are supported (the block spans the awaited call). Generator functions are refused, because a
    block around a suspended generator would leak into the code that iterates it.

    ``patched(mode="global")`` (or ``"local"``) also sets the gradient mode while the block is open and no
    newer block with a mode is; ``patched()`` leaves the mode alone (see the module docstring).
    """

    def __init__(self, mode: object = None) -> None:
        self._mode = None if mode is None else check_mode(mode)
        # The same instance may be open several times, also in several threads at once: one entry per open
        # block, oldest first, each the opening thread and the engine's token for it.
        self._entries: list[tuple[int, int | None]] = []
        self._entries_lock = threading.Lock()

    def __enter__(self) -> _Patched:
        token = _engine.enter_block(self._mode)
        with self._entries_lock:
            self._entries.append((threading.get_ident(), token))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A thread closes its own most recent entry. A thread that opened none (the block was handed over to it)
        # closes the instance's most recent entry from any thread: every entry of one instance has the same mode,
        # so the token only has to name *an* open entry of it -- with none, the mode it set would outlive it.
        ident = threading.get_ident()
        token: int | None = None
        with self._entries_lock:
            if self._entries:
                mine = [i for i, (owner, _) in enumerate(self._entries) if owner == ident]
                token = self._entries.pop(mine[-1] if mine else -1)[1]
        _engine.exit_block(token)

    def __call__(self, function: F) -> F:
        if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
            raise TypeError(
                f"@patched() cannot decorate the generator function {function.__qualname__}: the block would "
                "stay open while the generator is suspended. Use `with patched():` inside it instead."
            )
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with _Patched(self._mode):
                    return await function(*args, **kwargs)

            return cast(F, run_async)

        @wrapt.decorator
        def run(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            with _Patched(self._mode):
                return wrapped(*args, **kwargs)

        return cast(F, run(function))


@overload
def patched(mode: F, /) -> F: ...


@overload
def patched(mode: str | None = None) -> _Patched: ...


def patched(mode: str | F | None = None) -> _Patched | F:
    """Keep the patch in force for a block (``with patched():``) or for every call of a function (``@patched``).

    ``@patched`` and ``@patched()`` are the same decorator; ``patched(mode="global")`` (or ``"local"``,
    case-insensitive) also sets the gradient mode while its block is open and no newer block with a mode is.
    Blocks nest, are thread-safe and, on exit, undo only their own entry (also when the block raises); see
    :class:`_Patched` for decorating coroutine and generator functions.
    """
    if callable(mode):  # @patched without parentheses: Python passed the decorated function as ``mode``
        return _Patched()(mode)
    return _Patched(mode)


@dataclass(frozen=True)
class Status:
    """What a person debugging a cluster job needs to know about the patch in this process.

    ``state`` says in one word what a gather called now runs, and ties the other fields together:

    * ``"patched"``: the patch is in force and this package's gather runs in place of torchmetrics' own;
      ``applied_to`` names where (never empty in this state, and empty in every other);
    * ``"native"``: the patch is in force on a torchmetrics that keeps the graph itself (1.6.0 and newer) in local
      mode: nothing needs applying, torchmetrics' own gather runs and keeps the graph;
    * ``"pending"``: the patch is in force and lands the moment torchmetrics is imported;
    * ``"off"``: the patch is not in force (``unpatch()``, or ``TORCHMETRICS_GRADPATCH_AUTOPATCH=0`` and no
      ``patch()`` since): torchmetrics' own gather runs.
    """

    torch_version: str
    torchmetrics_version: str
    native: bool  #: this torchmetrics keeps the local graph itself (1.6.0+)
    in_force: bool  #: patch() is on or a patched() block is open (state is not "off")
    graph_preserving: bool  #: a gather called now keeps the local rank's graph
    torchmetrics_imported: bool
    applied_to: tuple[str, ...]  #: where our code is installed: non-empty exactly when state is "patched"
    references: dict[str, bool]  #: known paths into the gather and whether each reaches the same function object
    autopatch: bool  #: what TORCHMETRICS_GRADPATCH_AUTOPATCH asked of the import
    mode: str = "local"  #: gradient mode a gather called now uses: "local", "global", or "off" when not in force
    default_mode: str = "local"  #: TORCHMETRICS_GRADPATCH_MODE (or "local"): the mode of patch() without one
    state: str = "off"  #: "patched", "native", "pending" or "off" (see the class docstring)
    manual: bool = False  #: patch() is on
    blocks: int = 0  #: patched() blocks open now
    mode_from: str = ""  #: what chose ``mode``: "patched(mode=...)", "patch()", "default", or "" when off

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        data = asdict(self)
        data["applied_to"] = list(self.applied_to)
        return data

    def to_json(self) -> str:
        """The status as indented JSON."""
        return json.dumps(self.as_dict(), indent=2, sort_keys=True)

    def _in_force_text(self) -> str:
        if not self.in_force:
            if self.autopatch:
                return "no: unpatch() has switched off the patch the import put in force"
            return f"no: {AUTOPATCH_ENV}=0 kept the import from patching, and patch() has not been called"
        reasons = []
        if self.manual:
            reasons.append("patch() is on")
        if self.blocks:
            reasons.append(f"{self.blocks} patched() block{'s are' if self.blocks > 1 else ' is'} open")
        return "yes: " + " and ".join(reasons)

    def _gather_text(self) -> str:
        if self.state == "patched":
            return "patched: torchmetrics_gradpatch's gather runs in place of torchmetrics' own (see applied to)"
        if self.state == "native":
            return "native: torchmetrics keeps the graph itself, so nothing needs applying"
        if self.state == "pending":
            return "patched as soon as torchmetrics is imported"
        own = " (which keeps the graph itself)" if self.native else " (which drops the graph)"
        return "not patched: torchmetrics' own gather runs" + own

    def _mode_text(self) -> str:
        default = f"{self.default_mode} (from {MODE_ENV})" if self.default_mode != "local" else "local"
        if not self.in_force:
            return f"off (not in force); patch() without a mode would use {default}"
        chosen = {
            "patched(mode=...)": "chosen by an open patched(mode=...) block",
            "patch()": "the mode given to patch()",
            "default": "the default mode",
        }.get(self.mode_from, self.mode_from)
        return f"{self.mode}, {chosen}; patch() without a mode uses {default}"

    def __str__(self) -> str:
        lines = [
            f"torch:            {self.torch_version}",
            f"torchmetrics:     {self.torchmetrics_version}",
            f"in force:         {self._in_force_text()}",
            f"gather:           {self._gather_text()}",
            f"graph preserved:  {'yes' if self.graph_preserving else 'NO'}",
            f"gradient mode:    {self._mode_text()}",
            f"at import:        {'patched' if self.autopatch else 'not patched'} ({AUTOPATCH_ENV}"
            f"{'' if self.autopatch else '=0'})",
        ]
        lines += [f"applied to:       {where}" for where in self.applied_to]
        if self.state == "patched":  # only then does "reaching the function" mean reaching the patch
            lines += [
                f"reference:        {path}: {'reaches the patched function' if ok else 'DOES NOT reach it'}"
                for path, ok in self.references.items()
            ]
        return "\n".join(lines)


def _unwrap(obj: Any) -> Any:
    return inspect.unwrap(obj) if callable(obj) else obj


def _references(function: Any) -> dict[str, bool]:
    """Check the paths torchmetrics itself uses to reach its gather (``docs/design.md`` lists them)."""
    found: dict[str, bool] = {}
    distributed = sys.modules.get(_engine.TARGET_MODULE)
    if distributed is not None:
        found[f"{_engine.TARGET_MODULE}.{_engine.TARGET_NAME}"] = (
            _unwrap(getattr(distributed, _engine.TARGET_NAME, None)) is function
        )
    metric_module = sys.modules.get("torchmetrics.metric")
    if metric_module is not None:
        found[f"torchmetrics.metric.{_engine.TARGET_NAME}"] = (
            _unwrap(getattr(metric_module, _engine.TARGET_NAME, None)) is function
        )
        sync_dist = getattr(getattr(metric_module, "Metric", None), "_sync_dist", None)
        defaults = getattr(sync_dist, "__defaults__", None) or ()
        if defaults:
            found["torchmetrics.Metric._sync_dist default dist_sync_fn"] = _unwrap(defaults[0]) is function
    return found


def status() -> Status:
    """Report versions, whether the patch is in force and where it is applied, and whether the graph is kept."""
    state = _engine.snapshot()
    installed = _engine.installed()
    in_force = state.manual or state.blocks > 0
    distributed = sys.modules.get(_engine.TARGET_MODULE)
    applied: tuple[str, ...] = ()
    if installed and state.function is not None:
        applied = (
            f"{_engine.TARGET_MODULE}.{_engine.TARGET_NAME}.__code__ (function object at "
            f"{id(state.function):#x}; every reference to that object sees the patch)",
        )
        where = "patched"
    elif not in_force:
        where = "off"
    elif state.native and state.mode == "local":
        where = "native"
    elif distributed is None:
        where = "pending"
    else:  # in force, torchmetrics imported, nothing installed: the adoption must have failed; say it plainly
        where = "off"
    function = state.function
    if function is None and distributed is not None:
        # Native torchmetrics in local mode: the engine never adopted (nor checked) the gather; report the
        # references to whatever function torchmetrics holds, without judging its signature.
        function = _unwrap(getattr(distributed, _engine.TARGET_NAME, None))
    if state.block_modes:
        mode_from = "patched(mode=...)"
    elif state.manual:
        mode_from = "patch()"
    else:
        mode_from = "default" if in_force else ""
    return Status(
        torch_version=_versions()[0],
        torchmetrics_version=state.torchmetrics_version,
        native=state.native,
        in_force=in_force,
        graph_preserving=(state.native and where != "patched") or where in ("patched", "pending"),
        torchmetrics_imported=distributed is not None,
        applied_to=applied,
        references=_references(function) if function is not None else {},
        autopatch=autopatch_requested(),
        mode=state.mode if in_force else "off",
        default_mode=state.default_mode,
        state=where,
        manual=state.manual,
        blocks=state.blocks,
        mode_from=mode_from,
    )


def _versions() -> tuple[str, str]:
    from torchmetrics_gradpatch._version import installed_version

    return installed_version("torch") or "not installed", installed_version("torchmetrics") or "not installed"


def autopatch_requested() -> bool:
    """Read ``TORCHMETRICS_GRADPATCH_AUTOPATCH``; raise ``ValueError`` naming the variable if it is not a flag."""
    raw = os.environ.get(AUTOPATCH_ENV, "1")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{AUTOPATCH_ENV}={raw!r} is not understood; use 0 to import without patching or 1 (the default) to patch."
    )


def mode_requested() -> str:
    """Read ``TORCHMETRICS_GRADPATCH_MODE`` (the same case rule as ``patch(mode=...)``; unset or blank: local).

    Raises ``ValueError`` naming the variable if it is not a mode.
    """
    raw = os.environ.get(MODE_ENV, "")
    if not raw.strip():
        return "local"
    try:
        return check_mode(raw)
    except ValueError:
        allowed = ", ".join(MODES)
        raise ValueError(
            f"{MODE_ENV}={raw!r} is not a gradient mode; use one of: {allowed}, in any case (unset means local). "
            "See the README section 'Gradient modes'."
        ) from None


def sync_requested() -> str:
    """Read ``TORCHMETRICS_GRADPATCH_SYNC`` (unset or blank: ``"torchmetrics"``); a bad value names the variable."""
    raw = os.environ.get(SYNC_ENV, "")
    if not raw.strip():
        return "torchmetrics"
    try:
        return _fused.check_sync(raw)
    except ValueError:
        raise ValueError(f"{SYNC_ENV}={raw!r} is not a sync strategy; use one of: {', '.join(_fused.SYNCS)}.") from None


# The default mode is read once, when the package is imported; an invalid value makes the import fail.
_engine.set_default_mode(mode_requested())
