"""``patched()``: the context manager and decorator that keeps the patch in force for a block or a call.

Contract: each entry is one engine record (:func:`._engine.enter_block`), closed by its own exit; an ``__exit__``
called by hand with no entry open raises ``RuntimeError``. ``with`` looks ``__exit__`` up before it calls
``__enter__``, so each entry gets its own exit object, held only by the ``with`` statement, and the engine's record
holds a weak reference to it: however a Ctrl-C lands, the record goes with the statement (docs/design.md, "The
state"). Blocks nest, close in any order and from any thread; an exit by hand in another thread closes that
thread's newest entry of the block, else the block's newest.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, cast, overload

import wrapt

from torchmetrics_gradpatch import _engine
from torchmetrics_gradpatch._api import check_choice, check_pairing
from torchmetrics_gradpatch._modes import check_mode
from torchmetrics_gradpatch._syncs import check_sync

F = TypeVar("F", bound=Callable[..., Any])
ExitFunction = Callable[[type[BaseException] | None, BaseException | None, TracebackType | None], None]


def _close(block: _Patched, cell: list[int | None], *_exc_info: object) -> None:
    """The exit of one ``with`` entry: close the entry ``cell`` names, else (no entry made through it) by hand."""
    token = cell[0]
    if token is None:
        block._exit_by_hand()
    else:
        cell[0] = None
        _engine.exit_block(token)


class _Exit:
    """``_Patched.__exit__``: looked up on a block (as ``with`` does), a fresh exit object for the coming entry;
    looked up on the class (as ``contextlib.ExitStack`` does), the plain by-hand exit."""

    @overload
    def __get__(self, block: None, owner: type[_Patched]) -> Callable[..., None]: ...

    @overload
    def __get__(self, block: _Patched, owner: type[_Patched] | None = None) -> ExitFunction: ...

    def __get__(self, block: _Patched | None, owner: type[_Patched] | None = None) -> Callable[..., None]:
        if block is None:
            return _Patched._exit_unbound
        cell: list[int | None] = [None]  # the token of the entry this exit closes, set by __enter__
        exit_ = functools.partial(_close, block, cell)  # a C object: calling it runs no line before _close
        block._armed[threading.get_ident()] = (weakref.ref(exit_), cell)
        return exit_


class _Patched:
    """What :func:`patched` returns: a context manager and decorator keeping the patch in force (see there)."""

    __exit__ = _Exit()

    def __init__(self, mode: object = None, sync: object = None, check: object = None) -> None:
        self._mode = None if mode is None else check_mode(mode)
        self._sync = None if sync is None else check_sync(sync)
        self._check = check_pairing("patched", self._sync, check_choice("patched", check))
        # thread -> (the exit object ``with`` just looked up, its cell): picked up by that thread's __enter__
        self._armed: dict[int, tuple[weakref.ref[Any], list[int | None]]] = {}
        # entries made by calling __enter__ by hand: (thread, token), oldest first
        self._by_hand: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> _Patched:
        ident = threading.get_ident()
        armed = self._armed.pop(ident, None)
        if armed is not None and armed[0]() is not None:
            # Through ``with``: the record lives while the exit object does; the cell store below runs no line
            # that can be interrupted before this frame returns into the ``with`` statement.
            token = _engine.enter_block(self._mode, armed[0], self._sync, self._check)
            armed[1][0] = token
            return self
        token = _engine.enter_block(self._mode, None, self._sync, self._check)
        with self._lock:
            self._by_hand.append((ident, token))
        return self

    def _exit_by_hand(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            if not self._by_hand:
                raise RuntimeError(
                    "torchmetrics_gradpatch: patched().__exit__() called on a block with no entry open (never "
                    "entered, or exited already); call __exit__ once after each __enter__ of the same block."
                )
            mine = [i for i, (owner, _) in enumerate(self._by_hand) if owner == ident]
            token = self._by_hand.pop(mine[-1] if mine else -1)[1]
        _engine.exit_block(token)

    def _exit_unbound(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        self._exit_by_hand()

    def __call__(self, function: F) -> F:
        if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
            raise TypeError(
                f"@patched() cannot decorate the generator function {function.__qualname__}: the block would "
                "stay open while the generator is suspended. Use `with patched():` inside it instead."
            )
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with _Patched(self._mode, self._sync, self._check):
                    return await function(*args, **kwargs)

            return cast(F, run_async)

        @wrapt.decorator
        def run(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            with _Patched(self._mode, self._sync, self._check):
                return wrapped(*args, **kwargs)

        return cast(F, run(function))


@overload
def patched(mode: F, /) -> F: ...


@overload
def patched(mode: str | None = None, sync: str | None = None, check: bool | None = None) -> _Patched: ...


def patched(mode: str | F | None = None, sync: str | None = None, check: bool | None = None) -> _Patched | F:
    """Keep the patch in force for a block (``with patched():``) or for every call of a function (``@patched``).

    ``@patched`` and ``@patched()`` are the same decorator; ``patched(mode="global")`` (or ``"local"``,
    case-insensitive) also sets the gradient mode while its block is open and no newer block with a mode is;
    ``patched(sync="fused")`` (or ``"torchmetrics"``) likewise sets the sync strategy (docs/fused-sync.md), and
    ``patched(check=True)`` (or ``False``) whether each fused sync also runs torchmetrics' own sync and compares;
    ``check`` must be ``True``, ``False`` or ``None`` (a ``TypeError`` otherwise), and is not ``True`` beside
    ``sync="torchmetrics"`` (a ``ValueError``: nothing would be checked).
    Blocks nest, are thread-safe and, on exit, undo only their own entry (also when the block raises), so the
    state found at entry is restored unless the block itself called :func:`patch` or :func:`unpatch`. As a
    decorator, each call opens its own block; a coroutine function's block spans the awaited call, and generator
    functions are refused (``TypeError``): the block would leak into the code that iterates the generator.
    """
    if callable(mode):  # @patched without parentheses: Python passed the decorated function as ``mode``
        return _Patched()(mode)
    return _Patched(mode, sync, check)
