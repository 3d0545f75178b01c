"""What runs inside a spawned rank before and around the user's function; nothing of the parent side.

A rank (of :func:`~tests.harness.spawn_ranks` or of the warm pool) starts with :func:`enter`: it
leads its own process group, so the parent can kill it together with every process it started; it gets SIGKILL
from the kernel the moment the parent dies (a parent-death signal, which fires whatever the rank is doing, a C
loop holding the GIL included); and its faulthandler writes fatal-signal and SIGUSR1 stack dumps into a file the
parent handed it by descriptor. It then joins the gloo group (:func:`join_group`) and sends one message per run
through its pipe (:func:`send`): ``("ok", value)`` or ``("error", traceback text or report)``.

Invariant: this module imports only the standard library (and torch inside functions), never the parent side
(``_spawn``, ``_pool``, ``plugin``), as pytest-xdist's ``remote.py`` depends on nothing of xdist.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import IO, Any

__all__ = ["DumpFile", "clear_dump", "enter", "failure", "join_group", "rank_main", "rendezvous_timeout", "send"]

HOST = "127.0.0.1"
#: prctl(2) option: the signal this process gets when the thread that created it exits.
_PR_SET_PDEATHSIG = 1
#: A rank's exit status when it finds its parent already gone at start.
ORPHANED = 70


class DumpFile:
    """An open file handed from the parent to a rank by descriptor (unlinked: nothing to clean up on disk).

    It pickles only while multiprocessing spawns a process (as a pipe's ends do): the descriptor is passed to
    the child, which gets an open file object back from :meth:`open`.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        from multiprocessing import reduction

        return (_rebuild_dump, (reduction.DupFd(self.fd),))


def _rebuild_dump(dup: Any) -> DumpFile:
    return DumpFile(dup.detach())


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies; exit now if it already has.

    The getppid() check after prctl closes the race with a parent that died before the call. Where prctl is
    missing (not Linux), a thread polls instead: it cannot stop a rank that holds the GIL in C code.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent:
        os._exit(ORPHANED)
    if not armed:
        threading.Thread(target=_poll_parent, args=(parent,), daemon=True).start()


def _poll_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(ORPHANED)


def enter(dump: DumpFile, parent: int) -> IO[str]:
    """First thing in a rank: own process group, death with ``parent``, stack dumps to ``dump``.

    Returns the dump file (keep it: faulthandler writes to its descriptor until the process exits).
    """
    with contextlib.suppress(PermissionError):  # already a group leader (cannot happen under spawn)
        os.setsid()
    _die_with_parent(parent)
    out = os.fdopen(dump.fd, "w")
    faulthandler.enable(file=out, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
    return out


def clear_dump(out: IO[str]) -> None:
    """Empty the dump file (a pool worker's dump then shows the current test only)."""
    out.flush()
    os.ftruncate(out.fileno(), 0)
    os.lseek(out.fileno(), 0, os.SEEK_SET)


def rendezvous_timeout(timeout: float) -> datetime.timedelta:
    """Timeout for the store and the process group: never shorter than 30 s.

    The run's own deadline is enforced by the parent; a tiny store timeout only breaks the rendezvous (torch
    2.0 rounds it down to 0 s and the parent's own store then fails to connect to itself).
    """
    return datetime.timedelta(seconds=max(timeout, 30.0))


def join_group(rank: int, world_size: int, port: int, timeout: float) -> None:
    """Join the gloo default group as ``rank`` through the parent's store on ``port``.

    Ends with a barrier: gloo's ``init_process_group`` can return on one rank while a peer is still connecting
    its pairs, and a rank that then finishes at once (a test that skips on its first line) and exits would make
    that peer fail inside ``init_process_group`` with "Connection closed by peer", a failure of nobody's code.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        HOST, port, world_size, False, timeout=rendezvous_timeout(timeout)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=rendezvous_timeout(timeout))
    dist.barrier()


def failure(error: BaseException) -> tuple[str, Any]:
    """Inside ``except``: the ``("error", ...)`` message for ``error``.

    An exception may bring its own report (a picklable object whose str() is the text to show).
    """
    report = getattr(error, "rank_report", None)
    return ("error", traceback.format_exc() if report is None else report)


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def send(conn: multiprocessing.connection.Connection, message: tuple[str, Any]) -> bool:
    """Send ``message`` as ``(status, type name, time sent, pickled value)``; False if the value did not pickle.

    The value is pickled apart from the envelope, so the parent always reads the status and the type even when
    it cannot unpickle the value (a class only the rank can import); a value that does not pickle here is sent
    as an error instead.
    """
    status, value = message
    try:
        blob = pickle.dumps(value)
    except Exception:
        text = f"fn's return value ({_type_name(value)}) cannot be pickled:\n{traceback.format_exc()}"
        conn.send_bytes(pickle.dumps(("error", "builtins.str", time.time(), pickle.dumps(text))))
        return False
    conn.send_bytes(pickle.dumps((status, _type_name(value), time.time(), blob)))
    return True


def rank_main(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    conn: multiprocessing.connection.Connection,
    dump: DumpFile,
    parent: int,
) -> None:
    """Body of one spawned rank: join the group, run ``fn``, send back ``("ok", value)`` or ``("error", tb)``.

    The message goes out *before* the group is destroyed: a rank that raises must be heard first, before its
    peers' collectives fail with "connection reset" because it went away. Each message carries the time it was
    sent, so the parent can name the rank that failed first.
    """
    _dump = enter(dump, parent)
    joined = False
    try:
        join_group(rank, world_size, port, timeout)
        joined = True
        message: tuple[str, Any] = ("ok", fn(*args))
    except BaseException as error:  # everything a rank raises is reported to the parent
        message = failure(error)
    send(conn, message)
    conn.close()
    if joined:
        import torch.distributed as dist

        dist.destroy_process_group()
