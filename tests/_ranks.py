"""Run a function on real gloo ranks: torchmetrics' pool pattern, with a deadline.

``run_ranks(fn, n, *args)`` calls ``fn(rank, n, *args)`` on ``n`` spawned processes that form a gloo group and
returns the results in rank order. ``fn`` is a module-level function (it is pickled by name), usually beside the
test that calls it, as in torchmetrics' own DDP tests. The pytest process only waits: it never holds a process
group (gloo's teardown on torch 2.0 to 2.4 can deadlock holding the GIL, past every in-process timeout).

* **Warm ranks.** Pools are kept per world size for the session. A process joins the default group on its first
  call, and ``fn`` always gets ``dist.get_rank()`` (a pool may hand any process any item: the rank-order lesson of
  torchmetrics' review). After each call the rank's patch state is put back. ``fresh=True`` runs on new ranks
  started by the package's launcher (``torchmetrics_gradpatch.cli.ranks.run``) and ended after the call, for tests
  whose subject is process start-up or a rank that dies.
* **A deadline.** At ``timeout`` seconds the ranks still running dump their Python stacks (faulthandler, which
  needs no GIL) and are ended; :class:`RankError` names each rank that hung, with its stack. A rank that raises
  fails the call with its traceback; on warm ranks the others get a few seconds to finish before the pool is ended.
* **Nothing left behind.** An ended pool is terminated and joined; every rank dies with the process that started
  it (``PR_SET_PDEATHSIG``), so a killed pytest leaves no rank waiting in a collective.

What is the launcher's and what is this module's: the store the ranks meet at, a rank's set-up (its death with the
parent, its stacks on SIGUSR1), joining the group, asking for stacks, and every cold run are the launcher's; the
pools, which process runs which rank, the per-call start barrier, the patch-state reset and pytest's skips are here.

Non-goals: pytest fixtures inside ranks (pass values as arguments), assertion rewriting inside ranks (give an
assertion its message), coverage of rank processes.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
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
        import torch.multiprocessing as mp

        from torchmetrics_gradpatch.cli import ranks

        self.started = False
        self.calls = 0  # this pool's calls so far: each one's ranks meet under its own store key
        self.dir = tempfile.mkdtemp(prefix=f"tmgp-ranks{n}-")
        self.store = ranks.host(n)
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

    def stacks(self, wanted: set[int]) -> dict[int, tuple[int, str]]:
        """The pid and Python stack of each process now running one of the ranks ``wanted``."""
        from torchmetrics_gradpatch.cli import ranks

        pids = {rank: pid for rank, pid in self.pids().items() if rank in wanted}
        return {rank: (pids[rank], stack) for rank, stack in ranks.stacks(self.dir, pids).items()}


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
    if fresh or backend != "gloo":
        outcomes, stacks = _cold(fn, world_size, args, kwargs, timeout, backend)
    else:
        outcomes, stacks = _warm(fn, world_size, args, kwargs, timeout)
    name = getattr(fn, "__qualname__", repr(fn))
    failures = [
        f"rank {r} of {world_size} failed in {name}:\n{v}" for r, (k, v) in sorted(outcomes.items()) if k == "error"
    ]
    for r, (pid, stack) in sorted(stacks.items()):
        failures.append(
            f"rank {r} of {world_size} (pid {pid}) did not finish {name} in {timeout:g} s; its stack:\n{stack}"
        )
    if failures:
        raise RankError("\n\n".join(failures))
    skips = [f"rank {r}: {v}" for r, (k, v) in sorted(outcomes.items()) if k == "skip"]
    if skips:
        pytest.skip("; ".join(skips))
    return [outcomes[r][1] for r in range(world_size)]


def _warm(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
) -> tuple[dict[int, tuple[str, Any]], dict[int, tuple[int | None, str]]]:
    """``fn`` on the warm pool of ``world_size`` ranks: each rank's outcome, and the pid and stack of each that did
    not finish. A failed call ends its pool."""
    ranks = _POOLS.get(world_size) or _POOLS.setdefault(world_size, _RankPool(world_size))
    ranks.calls += 1
    seen: set[int] = set()
    calls = [
        ranks.pool.apply_async(_in_rank, (fn, ranks.calls, index, world_size, ranks.store.port, args, kwargs))
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
    pending = set(range(world_size)) - set(outcomes)
    found = ranks.stacks(pending) if pending else {}
    stacks = {rank: found.get(rank, (None, "")) for rank in pending}  # a rank without a process: none to ask
    if pending or any(kind == "error" for kind, _ in outcomes.values()):  # a rank may be left in a collective
        if _POOLS.get(world_size) is ranks:
            del _POOLS[world_size]
        ranks.end()
    else:
        ranks.started = True
    return outcomes, stacks


def _cold(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    backend: str,
) -> tuple[dict[int, tuple[str, Any]], dict[int, tuple[int | None, str]]]:
    """``fn`` on new ranks from the package's launcher, as :func:`_warm` reports it; none is left afterwards."""
    from torchmetrics_gradpatch.cli import ranks

    try:
        found = ranks.run(_cold_rank, world_size, (fn, args, kwargs), timeout=timeout, startup=STARTUP, backend=backend)
    except ranks.RanksError as error:
        reports = error.reports.items()
        stuck = {rank: (error.pids[rank], text) for rank, (how, text) in reports if how == ranks.STILL}
        return {rank: ("error", f"{text}\n") for rank, (how, text) in reports if how != ranks.STILL}, stuck
    return dict(enumerate(found)), {}


def close_all() -> None:
    """End every warm pool (at exit; a test of the pools themselves may call it)."""
    while _POOLS:
        _POOLS.popitem()[1].end()


atexit.register(close_all)


# --- rank side -------------------------------------------------------------------------------------------------------


def _start_rank(directory: str, n: int) -> None:
    """Pool initializer: the launcher's rank set-up (die with the parent, stacks on SIGUSR1), then take a slot."""
    from torchmetrics_gradpatch.cli import ranks

    ranks.prepare(directory)
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
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[int, str, Any]:
    """Join the group on first use (through the launcher), run ``fn`` as this process's rank (:func:`_body`).

    Returns ``(rank, "ok" | "error" | "skip", value)``; never raises (a pool worker dies on a BaseException, and an
    exception may not pickle), so the traceback travels as text.
    """
    import torch.distributed as dist

    from torchmetrics_gradpatch.cli import ranks

    global _STORE
    marker = Path(os.environ["TMGP_RANKS_DIR"], f"{os.getpid()}.rank")
    if not dist.is_initialized():
        marker.write_text(f"{index}\n")  # the rank it is joining as, should the join hang
        _STORE = dist.TCPStore(ranks.HOST, port, world_size, False, timeout=datetime.timedelta(seconds=60))
        ranks.join(index, world_size, _STORE)
    rank = dist.get_rank()
    marker.write_text(f"{rank}\n")
    try:
        # No body starts before every process holds an item: else a quick one could take a second item and run
        # its rank twice while another rank's process sits idle (a pool hands items to whoever is free). Through
        # the store, not gloo, whose barrier re-raises an earlier test's failed work on torch 2.0.
        if _STORE.add(f"tmgp-call{call}", 1) == world_size:
            _STORE.set(f"tmgp-go{call}", "1")
        _STORE.wait([f"tmgp-go{call}"])
        return (rank, *_body(fn, rank, world_size, args, kwargs))
    except BaseException:
        return (rank, "error", traceback.format_exc())


def _cold_rank(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """A cold run's body, on a rank the launcher has joined to the group; a raise goes to the launcher."""
    import torch.distributed as dist

    return _body(fn, dist.get_rank(), dist.get_world_size(), args, kwargs)


def _body(
    fn: Callable[..., Any], rank: int, world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, Any]:
    """``fn`` as ``rank``, then the patch state put back: ``("ok", value)``, ``("skip", why)`` or ``("error", what
    the test left open)``; what ``fn`` raises, raises."""
    import pytest

    from tests._patch_state import reset_patch_state, trust_module_classes

    try:
        trust_module_classes(fn)
        outcome: tuple[str, Any] = ("ok", fn(rank, world_size, *args, **kwargs))
    except pytest.skip.Exception as skip:
        outcome = ("skip", str(skip))
    finally:
        left = reset_patch_state()  # as a fresh import leaves it, for the next test; what the test left open, or None
    return ("error", f"{left}\n") if left and outcome[0] == "ok" else outcome


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
