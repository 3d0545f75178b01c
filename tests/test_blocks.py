"""``patched()`` blocks under asynchronous exceptions and misuse: a Ctrl-C storm, interrupted exits, stray exits.

The storm runs in a fresh interpreter (SIGINT sent to the pytest process itself would stop the run); the gather
after an interrupted exit on a one-rank gloo world (``run_ranks``); the rest in this process. Each test starts from
``unpatch()`` and puts the import-time state back.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torchmetrics.utilities.distributed as tm_dist

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from tests._subprocess import ok
from torchmetrics_gradpatch import _engine, _syncs

pytestmark = pytest.mark.once

NATIVE = tg.status().native
MODE = "global" if NATIVE else "local"  # the mode that installs the trampoline on this torchmetrics


@pytest.fixture(autouse=True)
def from_unpatched() -> Iterator[None]:
    tg.unpatch()
    assert not tg.is_patched()
    yield
    while _engine._state.blocks:
        _engine.exit_block()
    tg.patch()


# Ctrl-C as a storm: a thread sends SIGINT to the main thread every 0-200 us while it enters and exits blocks (a
# fresh block, a block object entered nested and repeatedly, a global-mode block, a block without a mode). The
# handler raises KeyboardInterrupt -- as Ctrl-C does -- wherever the main thread is, except in the driving loop's own
# instructions and in the handler (a nested one would raise into the loop), so the loop stays inside its ``try``.
STORM = """
import os, random, signal, sys, threading, time
os.environ["TORCHMETRICS_GRADPATCH_AUTOPATCH"] = "0"
import torchmetrics_gradpatch as tg
import torchmetrics.utilities.distributed as tm_dist

FUNCTION = tm_dist.gather_all_tensors
ORIGINAL = FUNCTION.__code__
MODE = "global" if tg.status().native else "local"
ACTIVE = [False]

def drive(seconds):
    shared, moded = tg.patched(), tg.patched(mode="global")
    counts = {"rounds": 0, "interrupts": 0}
    deadline = time.monotonic() + seconds
    ACTIVE[0] = True
    while True:
        try:
            if time.monotonic() > deadline:
                ACTIVE[0] = False
                return counts
            with tg.patched(MODE):
                with shared:
                    with moded:
                        pass
            with shared, tg.patched():
                pass
            counts["rounds"] += 1
        except KeyboardInterrupt:
            counts["interrupts"] += 1

DRIVER = drive.__code__

def on_sigint(signum, frame):
    if ACTIVE[0] and not (frame is not None and frame.f_code in (DRIVER, on_sigint.__code__)):
        raise KeyboardInterrupt

stop = threading.Event()
main = threading.main_thread().ident

def storm():
    rng = random.Random(0)
    while not stop.is_set():
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(rng.uniform(0, 0.0002))

sys.setswitchinterval(1e-5)  # let the storm thread run often
signal.signal(signal.SIGINT, on_sigint)
thread = threading.Thread(target=storm, daemon=True)
thread.start()
counts = drive(3.0)
stop.set()
thread.join()
signal.signal(signal.SIGINT, signal.default_int_handler)
after = tg.status()
print("interrupts", counts["interrupts"], "rounds", counts["rounds"])
print("after", after.open_blocks, after.in_force, after.state, after.mode)
tg.patch(MODE)
tg.unpatch()
print("unpatched", tg.is_patched(), tg.status().state, tg.status().mode, FUNCTION.__code__ is ORIGINAL)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="signal.pthread_kill is POSIX-only")
@pytest.mark.timeout(120)
def test_a_ctrl_c_storm_leaves_no_block_open_and_unpatch_means_unpatched() -> None:
    out = ok(STORM, timeout=100).split("\n")
    interrupts = int(out[0].split()[1])
    assert interrupts > 100, f"the storm interrupted the blocks too rarely to test anything: {out}"
    assert out[1].split() == ["after", "0", "False", "off", "off"], out
    assert out[2].split() == ["unpatched", "False", "off", "off", "True"], out


# What the engine runs after a block's record is stored or deleted, to bring everything else in line with it
SETTLING = (_engine._settle, _engine._refresh, _engine._sync, _engine._sync_gather, _engine._sync_metric)


def body_lines(function: Callable[..., Any]) -> list[int]:
    """The line numbers of ``function``'s code after its ``def`` line."""
    code = function.__code__
    return sorted({line for _, _, line in code.co_lines() if line is not None and line > code.co_firstlineno})


@contextlib.contextmanager
def interrupt_at(code: types.CodeType, line: int) -> Iterator[list[int]]:
    """Raise KeyboardInterrupt once, as Ctrl-C would, when this thread reaches ``line`` of ``code``."""
    hits: list[int] = []

    def local(frame: types.FrameType, event: str, arg: object) -> Any:
        if event == "line" and frame.f_lineno == line and not hits:
            hits.append(line)
            raise KeyboardInterrupt
        return local

    def calls(frame: types.FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code is code and not hits else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield hits
    finally:
        sys.settrace(previous)


def assert_unpatched(original: types.CodeType, where: str) -> None:
    status = tg.status()
    assert (tg.is_patched(), status.open_blocks, status.state) == (False, 0, "off"), where
    assert tm_dist.gather_all_tensors.__code__ is original and not _engine.installed(), where
    assert not _syncs.guarded(), where


@pytest.mark.parametrize("step", ["enter", "exit"])
def test_an_interrupt_anywhere_in_settling_a_block_leaves_the_next_reading_unpatched(step: str) -> None:
    """A Ctrl-C landing on any line the engine runs after storing or deleting a block's record (recomputing what
    is in force, swapping the code, replacing ``Metric._sync_dist``): the block is closed, and the next reading of
    the state finds everything put back."""
    original = tm_dist.gather_all_tensors.__code__  # unpatched by the fixture
    reached: list[tuple[str, int]] = []
    for function in SETTLING:
        for line in body_lines(function):
            block = tg.patched(MODE)
            if step == "exit":
                block.__enter__()  # by hand, so the record stays until exited; not interrupted
            with interrupt_at(function.__code__, line) as hits, contextlib.suppress(KeyboardInterrupt):
                if step == "enter":
                    block.__enter__()
                else:
                    block.__exit__(None, None, None)
            if not hits:  # a line this step does not run is not a case
                if step == "enter":
                    block.__exit__(None, None, None)
                continue
            reached.append((function.__name__, line - function.__code__.co_firstlineno))
            assert_unpatched(original, f"{step}, interrupted at {function.__name__}:{reached[-1][1]}")
    # every settling function was interrupted, on several of its lines
    assert {name for name, _ in reached} == {function.__name__ for function in SETTLING}, reached
    assert len(reached) >= len(SETTLING) * 3, reached


def _a_gather_after_an_interrupted_exit(rank: int, world_size: int) -> None:
    import torch

    tg.unpatch()  # what the module's fixture does in this process
    try:
        original = tm_dist.gather_all_tensors.__code__
        x = torch.ones(2, requires_grad=True)
        reached = []
        for line in body_lines(_engine._refresh):
            block = tg.patched(MODE)
            block.__enter__()
            assert tm_dist.gather_all_tensors(x)[0] is x, "the block is in force"
            with interrupt_at(_engine._refresh.__code__, line) as hits, contextlib.suppress(KeyboardInterrupt):
                block.__exit__(None, None, None)
            reached += hits
            assert tm_dist.gather_all_tensors(x)[0] is not x, f"interrupted at _refresh:{line}"
            assert_unpatched(original, f"interrupted at _refresh:{line}")
        assert len(reached) >= 5, reached  # the lines an exit runs there (a line not run is not a case)
    finally:
        while _engine._state.blocks:
            _engine.exit_block()
        tg.patch()


@pytest.mark.skipif(NATIVE, reason="torchmetrics >= 1.6 keeps the graph itself: both gathers give the same list")
def test_a_gather_after_an_interrupted_exit_runs_unpatched() -> None:
    """The first thing after the interrupt is a gather, before anything reads the state: the gather finishes
    putting the original back and runs it (the patched gather would return the input itself at this rank)."""
    run_ranks(_a_gather_after_an_interrupted_exit, 1)  # the gather runs in a one-rank gloo world


def test_an_exit_that_never_ran_closes_the_block_once_the_with_statement_is_gone() -> None:
    """What an interrupt at the first line of ``__exit__`` leaves, replayed step by step as ``with`` does it: the
    exit looked up before ``__enter__``, then dropped without having run."""
    block = tg.patched(MODE)
    exit_ = block.__exit__  # what `with` looks up first and holds for the block's duration
    block.__enter__()
    assert tg.is_patched() and _engine.installed() is not (NATIVE and MODE == "local")
    del exit_  # the with statement is gone: its __exit__ was interrupted before it ran a line
    assert not tg.is_patched() and tg.status().open_blocks == 0 and not _engine.installed()


def test_an_enter_interrupted_after_the_record_leaves_no_block() -> None:
    """An interrupt landing in ``__enter__`` after the engine recorded the block: ``with`` never runs the exit."""
    block = tg.patched(MODE)
    exit_ = block.__exit__
    real_enter_block = _engine.enter_block

    def enter_then_interrupt(*args: object) -> int:
        real_enter_block(*args)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    _engine.enter_block = enter_then_interrupt  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            block.__enter__()
    finally:
        _engine.enter_block = real_enter_block
    assert tg.status().open_blocks == 1, "the record was made (the case under test)"
    del exit_  # `with` drops its exit when __enter__ raises
    assert not tg.is_patched() and tg.status().open_blocks == 0


def test_a_stray_exit_raises_and_closes_no_other_block() -> None:
    with tg.patched(MODE):
        with pytest.raises(RuntimeError, match=r"patched\(\).__exit__\(\) called on a block with no entry open"):
            tg.patched().__exit__(None, None, None)
        assert tg.is_patched() and tg.status().open_blocks == 1, "another block was closed by the stray exit"
    block = tg.patched()
    block.__enter__()
    block.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="no entry open"):
        block.__exit__(None, None, None)  # exited already
    assert not tg.is_patched()


def test_one_block_object_entered_many_times_exits_each_entry_exactly() -> None:
    block = tg.patched(mode="global")
    with block:
        with block:
            assert tg.status().open_blocks == 2
        assert tg.status().open_blocks == 1 and tg.status().mode == "global"
    assert not tg.is_patched()
    entered = threading.Barrier(4)
    seen: list[int] = []

    def worker() -> None:
        with block:
            entered.wait(10)
            seen.append(tg.status().open_blocks)
            entered.wait(10)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    entered.wait(10)
    entered.wait(10)
    for thread in threads:
        thread.join(10)
    assert seen == [3, 3, 3] and not tg.is_patched()


def test_exit_stack_enters_and_exits_a_block() -> None:
    with contextlib.ExitStack() as stack:
        stack.enter_context(tg.patched(MODE))
        assert tg.is_patched()
    assert not tg.is_patched()
    assert tm_dist.gather_all_tensors.__code__ is _engine._state.original_code
