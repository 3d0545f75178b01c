"""The rank helper's own guarantees (tests/_ranks.py): rank order, a failing rank's traceback, a deadline that ends
a rank stuck in C code holding the GIL and shows its stack, and no process left behind."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from tests._ranks import RankError, alive, run_ranks

pytestmark = pytest.mark.once


def _whoami(rank: int, world_size: int) -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist

    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([rank, os.getpid()]))
    assert [int(t[0]) for t in gathered] == list(range(world_size)), "entry j must come from rank j"
    return rank, dist.get_rank(), int(gathered[rank][1])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_runs_as_the_rank_it_joined_as(world_size: int) -> None:
    first = run_ranks(_whoami, world_size)
    again = run_ranks(_whoami, world_size)  # warm: the same processes, whichever takes which item
    assert [r for r, _, _ in first] == [g for _, g, _ in first] == list(range(world_size))
    assert {pid for _, _, pid in first} == {pid for _, _, pid in again}
    assert len({pid for _, _, pid in first}) == world_size and os.getpid() not in {pid for _, _, pid in first}


def _quick_one(rank: int, world_size: int) -> int:
    if rank != 1:
        time.sleep(0.5)  # rank 1's process is free again long before these finish
    return rank


def test_every_rank_runs_once_even_when_a_process_is_slow_to_take_its_item() -> None:
    """A pool hands an item to whichever process is free: rank 1's quick process must not take a second one while
    rank 0's is still waking up (stopped here for a second)."""
    slow = run_ranks(_pid, 3)[0]
    os.kill(slow, signal.SIGSTOP)
    waking = threading.Timer(1.0, os.kill, (slow, signal.SIGCONT))
    waking.start()
    try:
        assert run_ranks(_quick_one, 3, timeout=30) == [0, 1, 2]
    finally:
        waking.join()


def _fail_on_one(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one's own failure")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that never comes


def test_a_failing_rank_reports_its_traceback_and_the_waiting_rank_its_stack() -> None:
    started = time.monotonic()
    with pytest.raises(RankError) as raised:
        run_ranks(_fail_on_one, 2, timeout=60)
    text = str(raised.value)
    assert "rank 1 of 2 failed in _fail_on_one" in text and "ValueError: rank one's own failure" in text
    assert 'raise ValueError("rank one' in text  # the line, from the rank's traceback
    waiting = text.split("rank 0 of 2 (pid ")[1]
    assert "did not finish _fail_on_one" in waiting and "in _fail_on_one" in waiting.split("its stack:")[1]
    assert time.monotonic() - started < 40, "the waiting rank must be ended a grace period after the failure"
    assert run_ranks(_whoami, 2)[1][:2] == (1, 1)  # a new pool replaced the ended one


def _exit_on_one(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        os._exit(7)
    # wait until the pool has replaced rank 1's process (its stack file is the third) and the replacement is idle:
    while len(list(Path(os.environ["TMGP_RANKS_DIR"]).glob("*.stack"))) < 3:  # ending the pool must not wait on it
        time.sleep(0.1)
    time.sleep(0.5)
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_dies_is_named_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 failed in _exit_on_one:\nits process \d+ died"):
        run_ranks(_exit_on_one, 2, timeout=120)
    assert time.monotonic() - started < 40, "a dead rank must not wait for the deadline"


def test_the_timeout_bounds_a_warm_call() -> None:
    run_ranks(_pid, 2)  # warm
    started = time.monotonic()
    with pytest.raises(RankError, match="did not finish _sleep in 2 s"):
        run_ranks(_sleep, 2, 30, timeout=2)
    assert time.monotonic() - started < 15


def _sleep(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def _hold_the_gil(rank: int, world_size: int) -> None:
    libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL through the call: no Python thread of this process runs
    while True:
        libc.sleep(3600)


def test_a_rank_stuck_in_c_holding_the_gil_is_ended_at_the_deadline_with_its_stack() -> None:
    started = time.monotonic()
    with pytest.raises(RankError) as raised:
        run_ranks(_hold_the_gil, 2, timeout=5, fresh=True)
    elapsed = time.monotonic() - started
    text = str(raised.value)
    for rank in (0, 1):
        assert re.search(f"rank {rank} of 2 \\(pid \\d+\\) did not finish _hold_the_gil in 5 s", text), text
    stacks = text.split("its stack:")[1:]
    assert all("in _hold_the_gil" in stack for stack in stacks), text
    assert elapsed < 5 + 30, elapsed  # the ranks' start-up (a few seconds), the deadline, the dump, the teardown
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\) did not finish", text)]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids), pids


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def test_fresh_ranks_leave_no_process_behind() -> None:
    pids = run_ranks(_pid, 2, fresh=True)
    assert not any(alive(pid) for pid in pids), pids


def _skip_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        pytest.skip("rank 0 cannot run this")


def test_a_skip_on_a_rank_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match="rank 0: rank 0 cannot run this"):
        run_ranks(_skip_on_rank_0, 2)


def test_a_child_stuck_in_c_holding_the_gil_is_ended_at_the_deadline_with_its_stack() -> None:
    """The same bound for the suite's one-off child interpreters (tests/_subprocess.py)."""
    from tests._subprocess import run_python

    code = "import ctypes\ndef stuck():\n    ctypes.PyDLL(None).sleep(3600)\nstuck()\n"
    started = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish in 3 s") as raised:
        run_python(code, timeout=3)
    assert time.monotonic() - started < 20
    assert 'File "<string>", line 3 in stuck' in str(raised.value), raised.value
