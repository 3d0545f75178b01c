"""Warm rank pool: keep the ``n`` processes of a world size alive across tests, each inside its gloo group.

A fresh :func:`~torchmetrics_gradpatch.testing.spawn_ranks` costs about a second and a half per 2-rank test on
two cores, almost all of it ``import torch`` in each new interpreter. The pool pays that once per world size per
pytest process and then runs each test in the same processes (``@pytest.mark.ranks(n, reuse=True)`` or the ini
option ``ranks_reuse = true``). How it is built, and why:

* **Process r is rank r, and only rank r's work goes to it.** Each worker joins the group as rank ``r`` once and
  then receives every test on its own pipe. torchmetrics' own suite joins ranks in one ``Pool.starmap`` and runs
  the test in another, so the pool may hand rank 0's work to the process that joined as rank 1 (upstream's
  lesson from PR #2754); torch's ``MultiProcContinuousTest`` and DeepSpeed's ``reuse_dist_env`` keep one queue
  per rank, as here.
* **Everything spawn_ranks guarantees still holds, with the same code.** The parent hosts the store on a
  kernel-chosen port, the test has one deadline (the pool's start-up included when the test starts it), and the
  replies are read by ``testing._collect``: a rank that raises is named with its traceback, one that dies with
  its exit status, one still running at the deadline with the stack of each of its threads. Each worker exits by
  itself when the pytest process goes away, ignores Ctrl-C (the pytest process decides), and the pool is torn
  down (terminate, kill, reap) at the end of the session, on any exception in the pytest process (Ctrl-C), and
  after any test in which a rank raised, died or hung.
* **Fresh processes after anything doubtful.** torch's ``MultiProcContinuousTest`` keeps its processes after a
  failure and skips the rest of the class ("poison pill"); DeepSpeed's ``reuse_dist_env`` keeps its pool (one of
  its own tests notes a hang with it at world size 4). Here a test that fails or times out on any rank (whatever
  makes a rank's call raise) retires the pool: its ranks may be stuck in or out of step in a collective, and only
  new processes are surely clean. So does a passing test that leaves something the worker cannot undo (see
  below); the next test starts a new pool.
* **Each test sees what a fresh spawn would show it.** Before each test a worker takes the pytest process's
  ``os.environ``, working directory and ``sys.path`` at that moment (so ``monkeypatch.setenv`` and
  ``monkeypatch.chdir`` reach the ranks as with a spawn), puts the torch, Python and NumPy random generators back
  to their state at pool start, and sets torch's default dtype, grad mode, deterministic-algorithms flag,
  anomaly detection and thread count, the ``warnings`` filters, and this package's patch state (patched or not,
  default mode, from ``TORCHMETRICS_GRADPATCH_AUTOPATCH``/``_MODE`` as at import) as they were at start. After
  the test it forgets the modules the test imported from outside the installed packages and the standard
  library (the test module, conftests, your project's modules), so the next test imports them afresh, and
  restores ``sys.meta_path``.
* **What cannot be undone retires the pool instead:** the default group destroyed or replaced, new process
  groups (``new_group``), a thread the test started and left running, a ``patched()`` block left open.
* **What stays, documented** (docs/testing-your-metrics.md): the state of installed packages the test changed
  (module globals of torch, torchmetrics, numpy...; an installed module imported during a test stays imported),
  signal handlers, the umask, resource limits, open files, and ``atexit`` handlers.

One pool per world size, per pytest process: under pytest-xdist each worker has its own pools.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import shutil
import signal
import site
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torchmetrics_gradpatch.testing import _spawn as testing
from torchmetrics_gradpatch.testing._spawn import DEFAULT_TIMEOUT

T = TypeVar("T")

#: Sent as a worker's reply to the pool's start: the worker joined its group and waits for tests.
_READY = "ready"
#: The store's and the group's own timeout (seconds). It must outlast any test the pool will run, whatever its
#: marker's timeout; each test's deadline is kept by the pytest process, which retires the pool when it passes.
_GROUP_TIMEOUT = 3600.0
#: Seconds an idle worker gets to exit by itself once its pipe is closed, before it is terminated.
_IDLE_EXIT = 0.5


class RankPool:
    """``world_size`` warm ranks; :meth:`run` is :func:`~torchmetrics_gradpatch.testing.spawn_ranks` in them.

    Attributes:
        world_size: the number of ranks.
        retired: why the last pool was torn down (``None`` while none was): a failed test, what a passing test
            left behind, or the end of the session.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.retired: str | None = None
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._dumps: list[str] = []
        self._store: Any = None
        self._tmp: str | None = None

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids, in rank order (empty when no pool is running)."""
        return [proc.pid for proc in self._procs if proc.pid is not None]

    def run(self, fn: Callable[..., T], args: Sequence[Any] = (), timeout: float = DEFAULT_TIMEOUT) -> list[T]:
        """Run ``fn(*args)`` on every rank, starting the workers first if none are running.

        Same contract as :func:`~torchmetrics_gradpatch.testing.spawn_ranks` (``timeout`` covers the start when
        this call starts the pool); on any exception the workers are gone before it propagates.
        """
        testing._check_arguments(fn, self.world_size, args, timeout)
        deadline = time.monotonic() + timeout
        try:
            if any(not proc.is_alive() for proc in self._procs):
                self._retire("a worker had exited between tests")
            if not self._procs:
                self._start(timeout, deadline)
            context = (dict(os.environ), os.getcwd(), list(sys.path))
            payload = pickle.dumps((context, pickle.dumps((fn, tuple(args)))))
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a worker that died is reported by _collect
                    conn.send_bytes(payload)
            replies = testing._collect(self._procs, self._conns, self._dumps, deadline)
        except testing.RankError as error:
            self._retire(f"rank {error.rank} {error.reason}")
            raise
        except BaseException:
            self._retire("the pytest process was interrupted")
            raise
        leftovers = sorted({f"rank {rank}: {left}" for rank, (_, left) in enumerate(replies) if left})
        if leftovers:
            self._retire("; ".join(leftovers))
        return [value for value, _ in replies]

    def close(self) -> None:
        """Stop the workers (they exit when their pipe closes), then terminate, kill and reap what is left."""
        self._retire("closed")

    def _start(self, timeout: float, deadline: float) -> None:
        self._store = testing._host_store(self.world_size, max(timeout, _GROUP_TIMEOUT))
        self._tmp = tempfile.mkdtemp(prefix="tmgp-pool-")
        self._dumps = [str(Path(self._tmp) / f"rank{rank}.txt") for rank in range(self.world_size)]
        context = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            mine, theirs = context.Pipe(duplex=True)
            proc = context.Process(
                target=_worker_main,
                name=f"tmgp-pool-rank{rank}",
                args=(
                    rank,
                    self.world_size,
                    self._store.port,
                    max(timeout, _GROUP_TIMEOUT),
                    theirs,
                    self._dumps[rank],
                    os.getpid(),
                ),
            )
            self._procs.append(proc)
            self._conns.append(mine)
            proc.start()
            theirs.close()
        testing._collect(self._procs, self._conns, self._dumps, deadline)  # every worker says _READY

    def _retire(self, why: str) -> None:
        if not self._procs and self._store is None:
            return
        self.retired = why
        for conn in self._conns:
            conn.close()  # an idle worker exits at once; a busy or hung one is terminated below
        end = time.monotonic() + _IDLE_EXIT
        for proc in self._procs:
            proc.join(max(0.0, end - time.monotonic()))
        testing._teardown(self._procs)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._procs, self._conns, self._dumps, self._store, self._tmp = [], [], [], None, None


_pools: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    """This process's pool for ``world_size`` (created, not yet started, on first use)."""
    return _pools.setdefault(world_size, RankPool(world_size))


def run_pooled(
    fn: Callable[..., T], world_size: int = 2, *, args: Sequence[Any] = (), timeout: float = DEFAULT_TIMEOUT
) -> list[T]:
    """:func:`~torchmetrics_gradpatch.testing.spawn_ranks`, run in this process's warm pool for ``world_size``."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return pool(world_size).run(fn, args, timeout)


def close_all() -> None:
    """Stop every pool of this process (the plugin calls it at the end of the session; also run at exit)."""
    for each in list(_pools.values()):
        each.close()
    _pools.clear()


atexit.register(close_all)


# --- a worker -------------------------------------------------------------------------------------------------------


def _installed_roots() -> tuple[str, ...]:
    """Where installed packages and the standard library live: modules from there stay imported between tests."""
    paths = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages())
    with contextlib.suppress(AttributeError):
        paths.add(site.getusersitepackages())
    return tuple(str(Path(path).resolve()) + os.sep for path in paths if path)


@dataclass
class _Baseline:
    """A worker's state right after it joined its group, put back before each test and checked after it."""

    modules: frozenset[str]
    meta_path: list[Any]
    threads: frozenset[threading.Thread]
    warning_filters: list[Any]
    torch_rng: Any
    python_rng: Any
    numpy_rng: Any
    torch_flags: tuple[Any, bool, bool, bool]
    group: Any
    groups: int
    roots: tuple[str, ...]

    @classmethod
    def capture(cls) -> _Baseline:
        import torch

        numpy = sys.modules.get("numpy")
        return cls(
            modules=frozenset(sys.modules),
            meta_path=list(sys.meta_path),
            threads=frozenset(threading.enumerate()),
            warning_filters=list(warnings.filters),
            torch_rng=torch.get_rng_state(),
            python_rng=random.getstate(),
            numpy_rng=None if numpy is None else numpy.random.get_state(),
            torch_flags=_torch_flags(),
            group=_default_group(),
            groups=_group_count(),
            roots=_installed_roots(),
        )

    def apply(self, environ: dict[str, str], cwd: str, path: list[str]) -> None:
        """Before a test: the pytest process's environment, directory and path; this worker's start state."""
        import importlib

        import torch

        from torchmetrics_gradpatch import _api, _engine

        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
        importlib.invalidate_caches()  # files the pytest process wrote since the last test
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        dtype, grad, deterministic, anomaly = self.torch_flags
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic)
        torch.autograd.set_detect_anomaly(anomaly)
        torch.set_num_threads(1)
        warnings.filters[:] = self.warning_filters  # type: ignore[index]  # typeshed: Sequence; it is a list
        getattr(warnings, "_filters_mutated", lambda: None)()  # drop the "already shown once" caches
        # as a fresh import of this package would leave it, read from this test's environment
        _engine.set_default_mode(_api.mode_requested())
        _engine.set_manual(_api.autopatch_requested())

    def clean_up(self) -> str | None:
        """After a passing test: forget its modules; say what it left that only new processes can undo."""
        from torchmetrics_gradpatch import _engine

        sys.meta_path[:] = self.meta_path
        added = sys.modules.keys() - self.modules
        for name in [name for name in added if self._forget(name, added)]:
            del sys.modules[name]
        self.modules = frozenset(sys.modules)  # what stays is checked once, not after every test
        if _default_group() is not self.group:
            return "the test destroyed or replaced the default process group"
        if _group_count() != self.groups:
            return "the test created process groups (new_group)"
        if _engine.snapshot().blocks:
            return "the test left a torchmetrics_gradpatch.patched() block open"
        running = [thread.name for thread in threading.enumerate() if thread not in self.threads]
        if running:
            return f"the test left threads running: {', '.join(sorted(running))}"
        return None

    def _forget(self, name: str, added: set[str]) -> bool:
        """Whether module ``name``, imported during the test, goes: the user's code, in a package added with it.

        A new submodule of a package loaded before the test stays (the package holds it as an attribute; a
        second copy would break identity), and so does anything installed or from the standard library.
        """
        if name.partition(".")[0] not in added or name.startswith("torchmetrics_gradpatch"):
            return False
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            return False
        return not str(Path(file).resolve()).startswith(self.roots)


def _torch_flags() -> tuple[Any, bool, bool, bool]:
    import torch

    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_anomaly_enabled(),
    )


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def _group_count() -> int:
    """How many process groups this rank holds (-1 where this torch does not say)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    return len(world.pg_map) if world is not None else -1


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    conn: multiprocessing.connection.Connection,
    dump_path: str,
    parent: int,
) -> None:
    """Body of a pool worker: join the group as ``rank``, say ``_READY``, then run each test sent to it.

    A test arrives as ``(context, pickled (fn, args))``: the context (environment, directory, ``sys.path``) is
    applied before ``fn`` is unpickled, so ``fn`` may live in a module only that path can import. The reply is
    ``("ok", (value, leftover))`` with ``leftover`` what the test left that needs new processes (or ``None``),
    or a failure as :func:`~torchmetrics_gradpatch.testing.spawn_ranks`' ranks send it. The pipe's end (the pool
    closing) ends the worker.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the pytest process's to handle
    dump = testing._watch_rank(dump_path, parent)
    try:
        testing._join_group(rank, world_size, port, timeout)
        baseline = _Baseline.capture()
    except BaseException as error:
        testing._send(conn, testing._failure(error))
        return
    testing._send(conn, ("ok", (_READY, None)))
    while True:
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # no destroy_process_group: the group dies with the process, and cannot hang it
        dump.seek(0)
        dump.truncate()  # a hang's stack dump shows this test only
        try:
            context, inner = pickle.loads(blob)
            baseline.apply(*context)
            fn, args = pickle.loads(inner)
            value = fn(*args)
            message: tuple[str, Any] = ("ok", (value, baseline.clean_up()))
        except BaseException as error:  # reported like spawn_ranks' ranks; the pool retires these workers
            message = testing._failure(error)
        testing._send(conn, message)
