"""Patch engine: every reference kind, exact restore, foreign patches, threads, errors.

Each test starts from ``unpatch()`` and puts the import-time state back (the patch is on after the import). A test
that runs a gather runs on a warm one-rank gloo world (``run_ranks(body, 1)``; the uneven gather on two ranks);
the others, which need no process group, run in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torchmetrics.metric as tm_metric
import torchmetrics.utilities.distributed as tm_dist
import wrapt
from packaging.version import Version
from torchmetrics import __version__ as tm_version

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from torchmetrics_gradpatch import _engine

pytestmark = pytest.mark.python

FUNCTION = tm_dist.gather_all_tensors
# On native torchmetrics (>= 1.6) local mode installs nothing by design; the global mode installs the same
# trampoline, so the engine's mechanics are tested through it there.
NATIVE = tg.status().native
MODE = "global" if NATIVE else "local"


def original_code() -> types.CodeType:
    code = _engine._state.original_code
    assert code is not None
    assert code.co_name == "gather_all_tensors"
    assert code.co_filename.replace("\\", "/").endswith("torchmetrics/utilities/distributed.py")
    return code


def snapshot() -> tuple[Any, ...]:
    """Everything ``unpatch()`` must give back: objects by identity, the function's dict by value."""
    return (
        tm_dist.gather_all_tensors,
        FUNCTION.__code__,
        dict(FUNCTION.__dict__),
        FUNCTION.__defaults__,
        tm_metric.gather_all_tensors,
        tm_metric.Metric._sync_dist.__defaults__,
    )


def assert_pristine(before: tuple[Any, ...]) -> None:
    after = snapshot()
    assert after[1] is original_code(), (after[1], original_code())
    same = [a is b for a, b in zip(after, before, strict=True)]
    assert same == [True, True, False, True, True, True], same
    assert after[2] == before[2], (after[2], before[2])


@contextlib.contextmanager
def unpatched() -> Iterator[tuple[Any, ...]]:
    """From ``unpatch()`` (yields :func:`snapshot`), then the import-time state back: blocks closed, ``patch()``."""
    tg.unpatch()
    assert _engine._state.blocks == 0 and not _engine.installed(), "a block open, or the trampoline in, after unpatch()"
    try:
        yield snapshot()
    finally:
        while _engine._state.blocks:
            _engine.exit_block()
        tg.patch()


@pytest.fixture
def from_unpatched() -> Iterator[tuple[Any, ...]]:
    with unpatched() as before:
        yield before


def on_rank(body: Callable[[tuple[Any, ...]], None]) -> Callable[[int, int], None]:
    """``body(before)`` as a rank function, run inside :func:`unpatched` (the rank's gloo group lets the gather
    run). Keeps ``body``'s name, so the pool finds it in this module by that name."""

    @functools.wraps(body)
    def rank_body(rank: int, world_size: int) -> None:
        with unpatched() as before:
            body(before)

    return rank_body


def keeps_graph(gather: Any) -> bool:
    """Whether a call of ``gather`` goes through the patch, and its local entry carries the caller's graph."""
    through: list[bool] = []
    namespace = FUNCTION.__globals__  # the trampoline looks its dispatch up there at each call

    def counting(result: Any, group: Any = None) -> list[Any]:
        through.append(True)
        return _engine.dispatch(result, group)

    saved = namespace.get(_engine.DISPATCH_NAME)
    namespace[_engine.DISPATCH_NAME] = counting
    try:
        x = torch.arange(3.0, requires_grad=True)
        out = gather(x)
    finally:
        namespace[_engine.DISPATCH_NAME] = saved if saved is not None else _engine.dispatch
    kept = out[0].requires_grad
    if kept:
        out[0].sum().backward()
        assert x.grad is not None and x.grad.tolist() == [1.0, 1.0, 1.0], "the local entry must carry x's graph"
    # Old torchmetrics returns a copy without a graph unless patched; native torchmetrics keeps it either way.
    assert kept == (NATIVE or bool(through))
    if not NATIVE:
        assert (out[0] is x) == bool(through)
    return bool(through)


@on_rank
def _restores_the_original_objects(before: tuple[Any, ...]) -> None:
    assert not keeps_graph(FUNCTION)
    tg.patch(MODE)
    assert _engine.installed() and FUNCTION.__code__ is not original_code()
    assert tm_dist.gather_all_tensors is FUNCTION  # never replaced, only its code
    assert keeps_graph(FUNCTION)
    tg.unpatch()
    assert_pristine(before)
    assert not keeps_graph(FUNCTION)


def test_unpatch_restores_the_original_objects_exactly() -> None:
    run_ranks(_restores_the_original_objects, 1)


@on_rank
def _idempotent(before: tuple[Any, ...]) -> None:
    tg.patch(MODE)
    tg.patch(MODE)
    assert tg.is_patched() and keeps_graph(FUNCTION)
    tg.unpatch()
    tg.unpatch()
    assert not tg.is_patched()
    assert_pristine(before)


def test_patch_and_unpatch_are_idempotent() -> None:
    run_ranks(_idempotent, 1)


@on_rank
def _every_reference(before: tuple[Any, ...]) -> None:
    alias = tm_dist.gather_all_tensors
    partial = functools.partial(tm_dist.gather_all_tensors, group=None)
    default = tm_metric.Metric._sync_dist.__defaults__[0]  # type: ignore[index]
    global_name = tm_metric.gather_all_tensors
    references = [alias, partial, default, global_name]
    assert not any(keeps_graph(ref) for ref in references)
    with tg.patched(MODE):
        assert all(keeps_graph(ref) for ref in references)
    assert not any(keeps_graph(ref) for ref in references)
    assert_pristine(before)


def test_every_reference_captured_before_the_patch_sees_it() -> None:
    run_ranks(_every_reference, 1)


@on_rank
def _blocks_nest(before: tuple[Any, ...]) -> None:
    with tg.patched(MODE):
        with tg.patched(MODE):
            assert tg.is_patched()
        assert tg.is_patched() and keeps_graph(FUNCTION)
    assert not tg.is_patched()
    with pytest.raises(KeyError), tg.patched(MODE):
        raise KeyError("inside")
    assert not tg.is_patched()
    assert_pristine(before)
    tg.patch(MODE)
    with tg.patched(MODE):
        pass
    assert tg.is_patched(), "a block restores the state found at entry: patch() stays on"


def test_patched_blocks_nest_and_restore_on_exceptions() -> None:
    run_ranks(_blocks_nest, 1)


def test_the_state_model_patch_or_any_open_block(from_unpatched: tuple[Any, ...]) -> None:
    block = tg.patched(MODE)
    block.__enter__()
    tg.unpatch()
    assert tg.is_patched(), "an open block keeps the patch in force"
    tg.patch(MODE)
    block.__exit__(None, None, None)
    assert tg.is_patched(), "patch() called inside a block stays on after it"
    tg.unpatch()
    assert_pristine(from_unpatched)
    with pytest.raises(RuntimeError, match="exited more often"):
        _engine.exit_block()


@on_rank
def _as_a_decorator(before: tuple[Any, ...]) -> None:
    @tg.patched(MODE)
    def plain(x: int) -> tuple[int, bool]:
        """Doc."""
        return x, tg.is_patched()

    class Model:
        @tg.patched(MODE)
        def method(self) -> bool:
            return keeps_graph(FUNCTION)

    @tg.patched(MODE)
    async def coroutine() -> bool:
        await asyncio.sleep(0)
        return tg.is_patched()

    assert plain(3) == (3, True) and plain.__name__ == "plain" and plain.__doc__ == "Doc."
    assert Model().method()
    assert asyncio.run(coroutine())
    assert not tg.is_patched()
    with pytest.raises(TypeError, match="generator function"):

        @tg.patched(MODE)
        def generator() -> Iterator[int]:
            yield 1

    assert_pristine(before)


def test_patched_as_a_decorator() -> None:
    run_ranks(_as_a_decorator, 1)


@on_rank
def _a_foreign_wrapper(before: tuple[Any, ...]) -> None:
    calls = []

    def spy(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(args[0].shape)
        return wrapped(*args, **kwargs)

    tg.patch(MODE)
    foreign = wrapt.FunctionWrapper(FUNCTION, spy)
    tm_dist.gather_all_tensors = foreign
    try:
        assert keeps_graph(tm_dist.gather_all_tensors)
        tg.unpatch()
        assert tm_dist.gather_all_tensors is foreign, "unpatch() must not remove what it did not install"
        assert not keeps_graph(tm_dist.gather_all_tensors)
        assert FUNCTION.__code__ is original_code() and len(calls) == 2
        assert tg.status().references[f"{_engine.TARGET_MODULE}.{_engine.TARGET_NAME}"] is True
    finally:
        tm_dist.gather_all_tensors = FUNCTION
    assert_pristine(before)


def test_a_foreign_wrapper_on_top_stays_and_sees_the_patch() -> None:
    run_ranks(_a_foreign_wrapper, 1)


def test_a_foreign_code_swap_on_top_is_left_alone(from_unpatched: tuple[Any, ...]) -> None:
    def other(result: Any, group: Any = None) -> list[Any]:
        return ["foreign"]

    tg.patch(MODE)
    FUNCTION.__code__ = other.__code__
    try:
        with pytest.warns(RuntimeWarning, match="another tool has replaced the code"):
            tg.unpatch()
        assert FUNCTION.__code__ is other.__code__
        with pytest.raises(RuntimeError, match="modified in place by another tool"):
            tg.patch(MODE)
        assert not tg.is_patched(), "a failed patch() leaves the state as it was"
        assert FUNCTION.__code__ is other.__code__
    finally:
        FUNCTION.__code__ = original_code()
    assert_pristine(from_unpatched)


def test_eight_threads_toggling_leave_the_exact_original(from_unpatched: tuple[Any, ...]) -> None:
    errors: list[BaseException] = []
    lost: list[int] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                choice = rng.random()
                if choice < 0.6:
                    with tg.patched(MODE):
                        if not _engine.installed():
                            lost.append(seed)
                elif choice < 0.8:
                    tg.patch(MODE)
                else:
                    tg.unpatch()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not [thread.name for thread in threads if thread.is_alive()], "threads still running after 60 s"
    assert errors == [] and lost == []
    tg.unpatch()
    assert_pristine(from_unpatched)


def test_status_says_where_the_patch_is(from_unpatched: tuple[Any, ...]) -> None:
    off = tg.status()
    assert not off.in_force and off.graph_preserving == NATIVE and off.applied_to == ()
    with tg.patched(MODE):
        on = tg.status()
    assert on.in_force and on.graph_preserving and on.native == NATIVE and on.torchmetrics_imported
    assert on.torch_version == torch.__version__
    assert "gather_all_tensors.__code__" in on.applied_to[0]
    assert on.references and all(on.references.values())
    assert '"in_force": true' in on.to_json()
    assert "graph preserved:  yes" in str(on)


@on_rank
def _the_direct_gather_never_warns(before: tuple[Any, ...]) -> None:
    x = torch.ones(2, 2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tg.gather_all_tensors(x)[0] is x


def test_the_direct_gather_never_warns() -> None:
    run_ranks(_the_direct_gather_never_warns, 1)


def _the_uneven_gather_never_warns(rank: int, world_size: int) -> None:
    from tests._rank_tools import uneven_gather_warnings

    paths = uneven_gather_warnings()
    for name, seen in paths.items():
        assert seen["shapes"] == [(2, 3), (3, 3)], (name, seen)
        if name != "unpatched":
            assert seen["warnings"] == [], (name, seen)
    old_torchmetrics = Version(tm_version) < Version("1.6")
    if old_torchmetrics and Version(Version(torch.__version__).base_version) >= Version("2.8"):
        # the control: this really is the path that warns, so the empty lists above say something
        assert any("non-tuple sequence" in w for w in paths["unpatched"]["warnings"]), paths


def test_the_uneven_gather_never_warns() -> None:
    """The uneven path (2 ranks, different rows) is the one torchmetrics < 1.6 warns on with torch >= 2.8."""
    run_ranks(_the_uneven_gather_never_warns, 2)


@on_rank
def _errors_are_the_unpatched_ones(before: tuple[Any, ...]) -> None:
    with pytest.raises(AttributeError, match="'int' object has no attribute 'contiguous'"):
        tg.gather_all_tensors(3)  # type: ignore[arg-type]


def test_errors_are_the_unpatched_ones() -> None:
    run_ranks(_errors_are_the_unpatched_ones, 1)


@on_rank
def _global_graph_does_not_hold_the_default_group(before: tuple[Any, ...]) -> None:
    x = torch.arange(3.0, requires_grad=True)
    out = tg.gather_all_tensors(x, mode="global")
    node = out[0].grad_fn
    assert node is not None and node.group is None, (node, getattr(node, "group", None))
    out[0].sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 1.0, 1.0], x.grad


def test_global_graph_does_not_hold_the_default_group() -> None:
    """A global-mode graph alive at exit must not keep the default process group past destroy_process_group():
    torch then aborts at exit now and then ("terminate called without an active exception"; 3 exits in 35 on
    torch 2.13 before the fix, 0 in 80 after). The node keeps ``group=None`` and resolves it in backward."""
    run_ranks(_global_graph_does_not_hold_the_default_group, 1)


def _in_thread(action: Any) -> None:
    """Run ``action`` in another thread and make sure it finished (a timed-out join alone would pass silently)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the thread did not finish within 30 s"
    assert errors == []


@pytest.mark.usefixtures("from_unpatched")
@pytest.mark.parametrize("where", ["entered in another thread", "exited in another thread"])
def test_a_mode_block_closed_from_another_thread_restores_the_mode(where: str) -> None:
    """README: blocks "may close in any order and from any thread". A global block closed by a thread other than
    the one that opened it must give the mode back, also while another block keeps the patch in force."""
    outer = tg.patched()
    block = tg.patched(mode="global")
    with outer:
        if where == "entered in another thread":
            _in_thread(block.__enter__)
            assert tg.status().mode == "global"
            block.__exit__(None, None, None)
        else:
            block.__enter__()
            assert tg.status().mode == "global"
            _in_thread(lambda: block.__exit__(None, None, None))
        assert tg.is_patched(), "the outer block is still open"
        assert _engine._state.block_modes == []
        assert tg.status().mode == "local", "the closed global block still sets the mode"
        assert _engine.installed() is not NATIVE, "native torchmetrics in local mode runs its own gather"
    assert not tg.is_patched()
