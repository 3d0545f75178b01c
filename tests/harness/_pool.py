"""Warm rank pool, parent side: keep the ``n`` ranks of a world size alive across tests, each in its gloo group.

A fresh :func:`~tests.harness.spawn_ranks` costs about a second and a half per 2-rank test, almost
all of it ``import torch``; the pool pays it once per world size per pytest process (``ranks(n, reuse=True)`` or
the ``ranks_reuse`` ini option). The worker's side, and what each test sees, is :mod:`._worker`.

* **Process r is rank r**, and only rank r's work goes to it (one pipe per rank).
* **spawn_ranks' guarantees, with its code** (:mod:`._processes`, :mod:`._collect`): the store on a kernel-chosen
  port, the replies read by ``collect``, ranks in their own process groups, killed whole.
* **Start-up is not a test's time**: a pool starts under its own bound (:data:`STARTUP_TIMEOUT`), reported as
  start-up when it fails; the test's ``timeout`` starts once every worker is ready.
* **Fresh processes after anything doubtful**: a test that fails or times out on any rank, or leaves what a
  worker cannot undo, retires the pool; so do the session's end, an interrupt and a failed start. A failed
  start raises its own cause and leaves no process behind.

One pool per world size, per pytest process: under pytest-xdist each worker has its own pools.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterable
from typing import IO, Any, TypeVar

from tests.harness import _processes, _reaper, _spawn, _worker
from tests.harness._collect import RankError, collect
from tests.harness._spawn import DEFAULT_TIMEOUT

T = TypeVar("T")

#: Seconds a pool may take to start (each worker imports torch and joins its group), apart from any test's timeout.
STARTUP_TIMEOUT = DEFAULT_TIMEOUT
#: The store's and the group's own timeout (seconds). It must outlast any test the pool will run, whatever its
#: marker's timeout; each test's deadline is kept by the pytest process, which retires the pool when it passes.
_GROUP_TIMEOUT = 3600.0
#: Seconds an idle worker gets to exit by itself once its pipe is closed, before it is terminated.
_IDLE_EXIT = 0.5


class RankPool:
    """``world_size`` warm ranks; :meth:`run` is :func:`~tests.harness.spawn_ranks` in them.

    Attributes:
        world_size: the number of ranks.
        retired: why the last pool was torn down (``None`` while none was): a failed test, what a passing test
            left behind, or the end of the session.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = _spawn.check_world_size(world_size)
        self.retired: str | None = None
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._dumps: list[IO[bytes]] = []
        self._store: Any = None

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids, in rank order (empty when no pool is running)."""
        return [proc.pid for proc in self._procs if proc.pid is not None]

    def run(self, fn: Callable[..., T], args: Iterable[Any] = (), timeout: float = DEFAULT_TIMEOUT) -> list[T]:
        """Run ``fn(*args)`` on every rank, starting the workers first if none are running.

        Same contract as :func:`~tests.harness.spawn_ranks`, except that ``timeout`` starts once
        the pool is up (its start has :data:`STARTUP_TIMEOUT`); on any exception the workers are gone before it
        propagates.
        """
        materialised = _spawn.check_arguments(fn, self.world_size, args, timeout)
        try:
            if any(not proc.is_alive() for proc in self._procs):
                self._retire("a worker had exited between tests")
            if not self._procs:
                self._start()
            deadline = time.monotonic() + timeout
            context = (dict(os.environ), os.getcwd(), list(sys.path))
            payload = pickle.dumps((context, pickle.dumps((fn, materialised))))
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a worker that died is reported by collect
                    conn.send_bytes(payload)
            replies = collect(self._procs, self._conns, self._dumps, deadline)
        except RankError as error:
            self._retire(f"rank {error.rank} {error.reason}" + (" at start-up" if error.starting else ""))
            raise
        except BaseException:
            self._retire("the pytest process was interrupted, or the pool could not start")
            raise
        leftovers = sorted({f"rank {rank}: {left}" for rank, (_, left) in enumerate(replies) if left})
        if leftovers:
            self._retire("; ".join(leftovers))
        return [value for value, _ in replies]

    def close(self) -> None:
        """Stop the workers (they exit when their pipe closes), then terminate, kill and reap what is left."""
        self._retire("closed")

    def _start(self) -> None:
        """Start every worker and wait until each has joined its group; on any failure its own error, nothing left."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        _reaper.track(id(self), self._kill)
        self._store = _processes.host_store(self.world_size, _GROUP_TIMEOUT)
        context = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            self._dumps.append(_processes.new_dump())
            mine, theirs = context.Pipe(duplex=True)
            self._conns.append(mine)
            try:
                args = (
                    rank,
                    self.world_size,
                    self._store.port,
                    _GROUP_TIMEOUT,
                    theirs,
                    _processes.dump_of(self._dumps[-1]),
                )
                name = f"tmgp-pool-rank{rank}"
                self._procs.append(_processes.start_rank(context, _worker.worker_main, name, (*args, os.getpid())))
            finally:
                theirs.close()
        collect(self._procs, self._conns, self._dumps, deadline, starting=True)  # every worker says READY

    def _kill(self) -> None:
        _processes.teardown(self._procs)

    def _retire(self, why: str) -> None:
        _reaper.untrack(id(self))
        if not self._procs and not self._conns and not self._dumps and self._store is None:
            return
        self.retired = why
        for conn in self._conns:
            conn.close()  # an idle worker exits at once; a busy or hung one is terminated below
        end = time.monotonic() + _IDLE_EXIT
        for proc in self._procs:
            proc.join(max(0.0, end - time.monotonic()))
        _processes.teardown(self._procs)
        for dump in self._dumps:
            dump.close()
        self._procs, self._conns, self._dumps, self._store = [], [], [], None


_pools: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    """This process's pool for ``world_size`` (created, not yet started, on first use)."""
    return _pools.setdefault(world_size, RankPool(world_size))


def run_pooled(
    fn: Callable[..., T], world_size: int = 2, *, args: Iterable[Any] = (), timeout: float = DEFAULT_TIMEOUT
) -> list[T]:
    """:func:`~tests.harness.spawn_ranks`, run in this process's warm pool for ``world_size``."""
    return pool(_spawn.check_world_size(world_size)).run(fn, args, timeout)


def close_all() -> None:
    """Stop every pool of this process (the plugin calls it at the end of the session; also run at exit)."""
    for each in list(_pools.values()):
        with contextlib.suppress(Exception):  # one pool's trouble must not keep the others running
            each.close()
    _pools.clear()


atexit.register(close_all)
