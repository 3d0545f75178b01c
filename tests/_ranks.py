"""Run a function on real gloo ranks: torchmetrics' pool pattern, with a deadline.

``run_ranks(fn, n, *args)`` calls ``fn(rank, n, *args)`` on ``n`` spawned processes that form a gloo group and
returns the results in rank order. ``fn`` is a module-level function (it is pickled by name), usually beside the
test that calls it, as in torchmetrics' own DDP tests. The pytest process only waits: it never holds a process
group (gloo's teardown on torch 2.0 to 2.4 can deadlock holding the GIL, past every in-process timeout).

* **Warm ranks.** Pools are kept per world size for the session. A process joins the default group on its first
  call, and ``fn`` always gets ``dist.get_rank()`` (a pool may hand any process any item: the rank-order lesson of
  torchmetrics' review). After each call the rank's patch state is put back. ``fresh=True`` runs on a new pool,
  ended after the call, for tests whose subject is process start-up or a rank that dies.
* **A deadline.** At ``timeout`` seconds the ranks still running dump their Python stacks (faulthandler, which
  needs no GIL) and the pool is ended; :class:`RankError` names each rank that hung, with its stack. A rank that
  raises fails the call with its traceback; the others get a few seconds to finish before the pool is ended.
* **Nothing left behind.** An ended pool is terminated and joined; every rank dies with the process that started
  it (``PR_SET_PDEATHSIG``), so a killed pytest leaves no rank waiting in a collective.

Non-goals: pytest fixtures inside ranks (pass values as arguments), assertion rewriting inside ranks (give an
assertion its message), coverage of rank processes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import faulthandler
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

__all__ = ["RankError", "alive", "run_ranks"]

HOST = "127.0.0.1"
#: Seconds the other ranks get to finish once one has failed, before the pool is ended.
GRACE = 5.0
#: Seconds a new pool gets on top of the call's timeout to start its processes and import torch.
STARTUP = 120.0
_POOLS: dict[int, _RankPool] = {}
_STORE: Any = None  # in a rank: its client of the pool's store


class RankError(AssertionError):
    """A rank raised, or did not finish by the deadline; the message names the rank and shows where it was."""


class _RankPool:
    """``n`` spawned ranks and what the parent needs to end them: the store they meet at, the stack files."""

    def __init__(self, n: int) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.started = False
        self.calls = 0  # this pool's calls so far: each one's ranks meet under its own store key
        self.dir = tempfile.mkdtemp(prefix=f"tmgp-ranks{n}-")
        # hosted here on a port the kernel picks and kept bound: no free-port race
        self.store = dist.TCPStore(HOST, 0, n, True, wait_for_workers=False)
        self.pool: Pool = mp.get_context("spawn").Pool(n, initializer=_start_rank, initargs=(self.dir, n))

    def end(self) -> None:
        self.pool.terminate()  # SIGTERM: a rank dies without running gloo's teardown
        self.pool.join()
        shutil.rmtree(self.dir, ignore_errors=True)

    def pids(self) -> dict[int, int]:
        """The rank each process of the pool is running (or joining as), by the file it writes at each call."""
        found = {}
        for path in Path(self.dir).glob("*.rank"):
            with contextlib.suppress(OSError, ValueError):
                found[int(path.read_text())] = int(path.stem)
        return found

    def stacks(self, ranks: set[int]) -> dict[int, tuple[int, str]]:
        """The pid and Python stack of each process now running one of ``ranks`` (SIGUSR1 -> faulthandler)."""
        pids = {rank: pid for rank, pid in self.pids().items() if rank in ranks}
        for pid in pids.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        return {rank: (pid, _read(Path(self.dir, f"{pid}.stack"))) for rank, pid in pids.items()}


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    fresh: bool = False,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; the results in rank order.

    ``backend="nccl"`` makes the default group NCCL on fresh ranks, rank ``r`` on ``cuda:r`` (the gpu profile).

    Raises :class:`RankError` if a rank raises or the call outlasts ``timeout`` seconds (a new pool's start-up
    apart); skips the test if a rank skipped and none failed.
    """
    import pytest

    __tracebackhide__ = True  # a failure shows the ranks' story, not this loop
    fresh = fresh or backend != "gloo"
    ranks = (
        _RankPool(world_size)
        if fresh
        else _POOLS.get(world_size) or _POOLS.setdefault(world_size, _RankPool(world_size))
    )
    ranks.calls += 1
    seen: set[int] = set()
    calls = [
        ranks.pool.apply_async(_in_rank, (fn, ranks.calls, index, world_size, ranks.store.port, backend, args, kwargs))
        for index in range(world_size)
    ]
    # the clock starts once every rank has reached the call (a new pool first spawns and imports torch)
    started = time.monotonic()
    clock = started if ranks.started else None
    deadline = started + (timeout if ranks.started else STARTUP)
    outcomes: dict[int, tuple[str, Any]] = {}
    while len(outcomes) < world_size and time.monotonic() < deadline:
        if clock is None and len(ranks.pids()) == world_size:
            clock = time.monotonic()
            deadline = min(deadline, clock + timeout) if outcomes else clock + timeout
        for index, call in enumerate(calls):
            if call.ready() and index not in seen:
                seen.add(index)
                try:
                    rank, kind, value = call.get()
                except Exception as error:  # the call could not reach the rank or come back (pickling)
                    rank, kind, value = index, "error", "".join(traceback.format_exception(error))
                outcomes[rank] = (kind, value)
        for rank, pid in ranks.pids().items():  # a rank that died never answers: the pool only replaces it
            if rank not in outcomes and not alive(pid):
                outcomes[rank] = ("error", f"its process {pid} died without an answer (killed, or it exited)\n")
        if any(kind == "error" for kind, _ in outcomes.values()):
            deadline = min(deadline, time.monotonic() + GRACE)  # the others may wait for it forever
        if len(outcomes) < world_size:  # wake as soon as the next answer comes, not after a fixed sleep
            waiting = [call for index, call in enumerate(calls) if index not in seen]
            waiting[0].wait(0.05) if waiting else time.sleep(0.05)
    pending = sorted(set(range(world_size)) - set(outcomes))
    stacks = ranks.stacks(set(pending)) if pending else {}
    failed = pending or any(kind == "error" for kind, _ in outcomes.values())
    if fresh or failed:  # a rank may be left in a collective, or with state a failure left behind
        if _POOLS.get(world_size) is ranks:
            del _POOLS[world_size]
        ranks.end()
    else:
        ranks.started = True
    name = getattr(fn, "__qualname__", repr(fn))
    failures = [
        f"rank {r} of {world_size} failed in {name}:\n{v}" for r, (k, v) in sorted(outcomes.items()) if k == "error"
    ]
    for r in pending:
        pid, stack = stacks.get(r, (None, ""))
        failures.append(
            f"rank {r} of {world_size} (pid {pid}) did not finish {name} in {timeout:g} s; its stack:\n{stack}"
        )
    if failures:
        raise RankError("\n\n".join(failures))
    skips = [f"rank {r}: {v}" for r, (k, v) in sorted(outcomes.items()) if k == "skip"]
    if skips:
        pytest.skip("; ".join(skips))
    return [outcomes[r][1] for r in range(world_size)]


def close_all() -> None:
    """End every warm pool (at exit; a test of the pools themselves may call it)."""
    while _POOLS:
        _POOLS.popitem()[1].end()


atexit.register(close_all)


# --- rank side -------------------------------------------------------------------------------------------------------


def _start_rank(directory: str, n: int) -> None:
    """Pool initializer: die with the parent, and dump this process's stacks to a file on SIGUSR1."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    stack = open(Path(directory, f"{os.getpid()}.stack"), "w")  # noqa: SIM115 - held for the process's life
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    # A pool replaces a dead worker from its handler thread, and PR_SET_PDEATHSIG fires when that thread exits in
    # terminate(): a replacement killed while it waits for work holds the task queue's lock, and terminate() then
    # waits on that lock forever. A dead rank ends its pool anyway, so a replacement never takes work.
    if not any(_claim(Path(directory, f"slot{index}")) for index in range(n)):
        while True:
            signal.pause()
    os.environ["TMGP_RANKS_DIR"] = directory
    # pool processes are daemons, which may not have children: inductor compiles in-process (2.3 starts workers
    # on import, so this must be set before, not patched in a test)
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"


def _in_rank(
    fn: Callable[..., Any],
    call: int,
    index: int,
    world_size: int,
    port: int,
    backend: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[int, str, Any]:
    """Join the group on first use, run ``fn`` as this process's rank, put the patch state back.

    Returns ``(rank, "ok" | "error" | "skip", value)``; never raises (a pool worker dies on a BaseException, and an
    exception may not pickle), so the traceback travels as text.
    """
    import pytest
    import torch.distributed as dist

    from tests._patch_state import reset_patch_state, trust_module_classes

    global _STORE
    marker = Path(os.environ["TMGP_RANKS_DIR"], f"{os.getpid()}.rank")
    if not dist.is_initialized():
        marker.write_text(f"{index}\n")  # the rank it is joining as, should the join hang
        _STORE = store = dist.TCPStore(HOST, port, world_size, False, timeout=datetime.timedelta(seconds=60))
        if backend == "nccl":
            import torch

            torch.cuda.set_device(index)
        dist.init_process_group(
            backend, store=store, rank=index, world_size=world_size, timeout=datetime.timedelta(seconds=600)
        )
    rank = dist.get_rank()
    marker.write_text(f"{rank}\n")
    try:
        # No body starts before every process holds an item: else a quick one could take a second item and run
        # its rank twice while another rank's process sits idle (a pool hands items to whoever is free). Through
        # the store, not gloo, whose barrier re-raises an earlier test's failed work on torch 2.0.
        if _STORE.add(f"tmgp-call{call}", 1) == world_size:
            _STORE.set(f"tmgp-go{call}", "1")
        _STORE.wait([f"tmgp-go{call}"])
        trust_module_classes(fn)
        outcome: tuple[int, str, Any] = (rank, "ok", fn(rank, world_size, *args, **kwargs))
    except pytest.skip.Exception as skip:
        outcome = (rank, "skip", str(skip))
    except BaseException:
        outcome = (rank, "error", traceback.format_exc())
    left = reset_patch_state()  # as a fresh import leaves it, for the next test; what the test left open, or None
    return (rank, "error", f"{left}\n") if left and outcome[1] == "ok" else outcome


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (read from ``/proc``: a killed orphan can stay a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _claim(path: Path) -> bool:
    with contextlib.suppress(FileExistsError):
        return os.close(os.open(path, os.O_CREAT | os.O_EXCL)) is None
    return False


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
