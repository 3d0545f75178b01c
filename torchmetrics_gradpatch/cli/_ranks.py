"""The ``check`` command's ranks: run a function on N spawned gloo ranks on loopback, bounded and loud.

:func:`run` starts the ranks with ``torch.multiprocessing.start_processes`` and gives what the command needs:

* **a deadline**: at ``timeout`` the ranks still running dump their stacks (faulthandler, on SIGUSR1) and go;
* **a clear failure**: :class:`RankError` names the rank and says whether it raised (its traceback), died (its
  exit status and any fatal-signal dump), timed out (every pending rank's stacks) or could not start;
* **nothing left behind**: each rank leads its own process group, which is killed whole (a process the rank
  started goes with it), on success, failure, Ctrl-C or SIGTERM; a rank dies with its parent (prctl on Linux);
  its files live in one temporary directory, removed at the end.

The rendezvous store is hosted here on a port the kernel chooses and kept bound, so there is no free-port race; a
store that cannot listen raises torch's own error, for the command to call "cannot run here".
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["RankError", "run"]

HOST = "127.0.0.1"
#: Seconds a rank gets to exit by itself (after its result is in, or after SIGTERM) before it is killed.
_GRACE = 3.0
#: Seconds the ranks get to write their stacks after SIGUSR1.
_DUMP_WAIT = 0.5
_POLL = 0.1
_PR_SET_PDEATHSIG = 1


class RankError(Exception):
    """A rank raised, died, timed out or could not start.

    Attributes:
        rank: the failing rank (for a timeout, the lowest pending one).
        reason: ``"raised"``, ``"died"``, ``"timed out"`` or ``"could not start"``.
        details: its traceback, exit status and dump, or the pending ranks' stacks.
        started: whether every rank had joined the group (the function was running) when it happened.
    """

    def __init__(self, rank: int, reason: str, details: str, *, started: bool = False) -> None:
        super().__init__(f"rank {rank} {reason}:\n{details}")
        self.rank = rank
        self.reason = reason
        self.details = details
        self.started = started


def _file(workdir: str, rank: int, kind: str) -> Path:
    return Path(workdir) / f"rank{rank}.{kind}"


# --- in the rank ----------------------------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL from the kernel when the parent dies, even in C code holding the GIL (Linux); elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    world_size: int,
    port: int,
    timeout: float,
    workdir: str,
    parent: int,
) -> None:
    """One rank: own process group, stack dumps to a file, join the group, run ``fn``, leave its result."""
    with contextlib.suppress(PermissionError):
        os.setsid()
    _die_with_parent(parent)
    dump = _file(workdir, rank, "dump").open("w")  # open until the process ends: faulthandler writes to it
    faulthandler.enable(file=dump, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    import torch.distributed as dist

    # never below 30 s: torch 2.0 rounds a short store timeout down to 0 s; the deadline is kept by the parent
    limit = datetime.timedelta(seconds=max(timeout, 30.0))
    store = dist.TCPStore(HOST, port, world_size, False, timeout=limit)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=limit)
    dist.barrier()  # gloo may return from init on one rank while a peer still connects
    _file(workdir, rank, "joined").touch()
    value = fn(*args)
    partial = _file(workdir, rank, "partial")
    partial.write_bytes(pickle.dumps(value))
    partial.replace(_file(workdir, rank, "result"))  # whole or absent
    dist.destroy_process_group()


# --- in the parent --------------------------------------------------------------------------------------------------


class _Terminated(BaseException):
    """SIGTERM arrived while ranks ran: unwind, so they are torn down, then die of SIGTERM."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield  # someone else handles SIGTERM here
        return

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _signal_group(pid: int | None, signum: int) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signum)  # the rank leads its own group
    except (ProcessLookupError, PermissionError):  # group gone, or the rank had not called setsid yet
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _teardown(procs: Sequence[Any]) -> None:
    """Terminate, wait, kill and reap every rank with its whole process group."""
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    end = time.monotonic() + _GRACE
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.join()


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"process was killed by {signal.Signals(-code).name}"
    return f"process exited with code {code} without returning"


def _dump(workdir: str, rank: int) -> str:
    path = _file(workdir, rank, "dump")
    return path.read_text(errors="replace").strip() if path.is_file() else ""


def _timed_out(procs: Sequence[Any], pending: list[int], workdir: str, world_size: int) -> RankError:
    """Ask every pending rank for its stacks; the failure, leading with the lowest pending rank."""
    for rank in pending:
        if procs[rank].pid is not None and _file(workdir, rank, "dump").is_file():  # else SIGUSR1 would kill it
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(_DUMP_WAIT)
    missing = "(no stack dump: the rank had not started)"
    parts = [
        f"--- rank {rank}, still running at the deadline; its threads:\n{_dump(workdir, rank) or missing}"
        for rank in pending
    ]
    started = all(_file(workdir, rank, "joined").is_file() for rank in range(world_size))
    return RankError(pending[0], "timed out", "\n".join(parts), started=started)


def _failed(error: Exception, procs: Sequence[Any], workdir: str, error_files: Sequence[str]) -> RankError:
    """The failure torch's join reported, with what the other ranks had raised by then."""
    rank = int(error.error_index)  # type: ignore[attr-defined]
    raised = isinstance(error, _mp().ProcessRaisedException)
    if raised:
        details = str(error).split("terminated with the following error:\n", 1)[-1].strip()
    else:
        details = f"{_exit_status(procs[rank].exitcode)}\n{_dump(workdir, rank)}".strip()
    for other, path in enumerate(error_files):
        if other != rank and os.path.isfile(path):
            with open(path, "rb") as file, contextlib.suppress(Exception):
                details += f"\n\n--- afterwards rank {other} raised:\n{pickle.load(file)}"
    started = all(_file(workdir, each, "joined").is_file() for each in range(len(procs)))
    return RankError(rank, "raised" if raised else "died", details, started=started)


def _error_files(context: Any) -> Sequence[str]:
    """The files torch's ranks write their exceptions to (torch >= 2.2; older torch passes them through queues,
    and then only the rank torch's join reports has its traceback shown)."""
    return getattr(context, "error_files", ())


def _mp() -> Any:
    import torch.multiprocessing

    return torch.multiprocessing


def run(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks of a gloo group; its return values in rank order.

    ``fn`` and ``args`` must pickle (``fn`` a module-level function). Raises :class:`RankError`, with every rank
    gone; a store that cannot listen on loopback raises torch's error before any rank starts.
    """
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    limit = datetime.timedelta(seconds=max(timeout, 30.0))
    store = dist.TCPStore(HOST, 0, world_size, True, timeout=limit, wait_for_workers=False)  # type: ignore[attr-defined]
    workdir = tempfile.mkdtemp(prefix="tmgp-check-")
    context: Any = None
    try:
        with _sigterm_unwinds():
            try:
                rank_args = (fn, tuple(args), world_size, store.port, timeout, workdir, os.getpid())
                context = _mp().start_processes(_rank_main, rank_args, world_size, join=False, start_method="spawn")
            except OSError as err:
                raise RankError(0, "could not start", f"{type(err).__name__}: {err}") from None
            return _wait(context, world_size, workdir, deadline)
    finally:
        if context is not None:
            _teardown(context.processes)
            for path in _error_files(context):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        shutil.rmtree(workdir, ignore_errors=True)
        del store


def _wait(context: Any, world_size: int, workdir: str, deadline: float) -> list[Any]:
    """Poll until every rank has left its result (then they may exit), a rank fails, or the deadline passes."""
    procs = context.processes
    results: dict[int, Any] = {}
    while True:
        for rank in range(world_size):
            path = _file(workdir, rank, "result")
            if rank not in results and path.is_file():
                results[rank] = pickle.loads(path.read_bytes())
        if len(results) == world_size:
            return [results[rank] for rank in range(world_size)]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pending = [rank for rank in range(world_size) if rank not in results]
            raise _timed_out(procs, pending, workdir, world_size)
        try:
            finished = context.join(timeout=min(_POLL, remaining))
        except (_mp().ProcessRaisedException, _mp().ProcessExitedException) as error:
            raise _failed(error, procs, workdir, _error_files(context)) from None
        if finished:  # every rank exited 0: one without a result ended early (os._exit, a swallowed Ctrl-C)
            for rank in range(world_size):
                path = _file(workdir, rank, "result")
                if rank not in results and not path.is_file():
                    raise RankError(rank, "died", _exit_status(procs[rank].exitcode), started=True)
