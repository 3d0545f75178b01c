"""The ranks as processes, parent side: the store they meet at, their dump files, their start and their end.

* The rendezvous ``TCPStore`` is hosted by the parent on a kernel-chosen port it keeps bound: no free-port race.
* A rank's stack dumps go to an unlinked file handed over by descriptor: nothing to remove from disk.
* :func:`teardown` signals each rank's whole process group (each rank leads one, see :mod:`._rank`), so a process
  a rank started goes with it: terminate, a grace, kill, reap.

Invariant: parent side; imports :mod:`._rank` (for the dump file's hand-over) and the standard library.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any

from tests.harness import _rank

__all__ = [
    "TERMINATE_GRACE",
    "describe_exit",
    "dump_of",
    "host_store",
    "new_dump",
    "read_dump",
    "start_rank",
    "teardown",
]

TERMINATE_GRACE = 3.0


def host_store(world_size: int, timeout: float) -> Any:
    """The rendezvous ``TCPStore``, hosted by the parent on a kernel-chosen port it keeps bound."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        _rank.HOST, 0, world_size, True, timeout=_rank.rendezvous_timeout(timeout), wait_for_workers=False
    )


def new_dump() -> IO[bytes]:
    """An unlinked file for one rank's stack dumps: handed to the rank by descriptor, gone when closed."""
    return tempfile.TemporaryFile(prefix="tmgp-dump-")


def dump_of(file: IO[bytes]) -> _rank.DumpFile:
    return _rank.DumpFile(file.fileno())


def read_dump(file: IO[bytes], missing: str) -> str:
    """A rank's faulthandler output; ``missing`` when the rank never wrote one."""
    size = os.fstat(file.fileno()).st_size
    text = os.pread(file.fileno(), size, 0).decode(errors="replace").strip() if size else ""
    return text or missing


def start_rank(
    context: Any, target: Callable[..., None], name: str, args: tuple[Any, ...]
) -> multiprocessing.process.BaseProcess:
    proc: multiprocessing.process.BaseProcess = context.Process(target=target, name=name, args=args)
    proc.start()
    return proc


def teardown(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Terminate, then kill, then reap every rank with its whole process group: nothing outlives the run.

    Each rank's group is signalled even when the rank itself has exited: a process it started may remain.
    """
    started = [proc for proc in procs if proc.pid is not None]
    for proc in started:
        _signal_group(proc, signal.SIGTERM)
    end = time.monotonic() + TERMINATE_GRACE
    for proc in started:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in started:
        _signal_group(proc, signal.SIGKILL)
        proc.join()


def _signal_group(proc: multiprocessing.process.BaseProcess, signum: int) -> None:
    assert proc.pid is not None
    try:
        os.killpg(proc.pid, signum)  # the rank leads its own group (os.setsid at its start)
    except (ProcessLookupError, PermissionError):  # group gone, or the rank had not called setsid yet
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code} without returning"
