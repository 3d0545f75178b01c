"""Spawned-rank runner: run a function on N real processes, each inside its own gloo process group.

``spawn_ranks(fn, world_size)`` is what this project's DDP tests run on, and is public so users can test
their own metrics the same way. Its guarantees, and why each one is there:

* **Each process joins the group inside the process that runs ``fn``.** Upstream's review of the
  graph-preserving gather found that a harness which sets up ranks in one pool call and runs the test in
  another lets the pool hand rank 0's work to the process that joined as rank 1: sums hide the shuffle, a
  gather whose local entry is special does not. Here process ``r`` joins as rank ``r`` and then calls ``fn``;
  nothing else ever runs in it.
* **No free-port race.** The parent hosts the rendezvous ``TCPStore`` on port 0 and keeps it bound, so the
  kernel picks the port and nobody else can take it between "choose" and "use"; gloo's own connections use
  ephemeral ports. Any number of suites may run at once.
* **Bounded and loud.** The whole run has one deadline. A rank that raises, dies or outlives it makes
  :func:`spawn_ranks` raise :class:`RankError` naming the rank with its traceback (for a hung rank, a
  ``faulthandler`` dump of where each of its threads is stuck), and every process is terminated, then killed,
  and reaped before the error propagates. Each rank also exits by itself if the parent disappears.
* **Fresh interpreters** (the ``spawn`` start method), as torchrun and Lightning's ``ddp_spawn`` give.
  ``fn`` and ``args`` must therefore be picklable: ``fn`` a module-level function of an importable module.

Each rank imports :mod:`torchmetrics_gradpatch` (this module lives in it), so the patch is in force in every
rank exactly as at program start, unless ``TORCHMETRICS_GRADPATCH_AUTOPATCH=0`` is in the environment.
Each rank runs torch with one intra-op thread: ranks share the machine's cores.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["DEFAULT_TIMEOUT", "RankError", "spawn_ranks"]

T = TypeVar("T")

#: Seconds one :func:`spawn_ranks` call may take, start-up included (ranks take seconds to import torch).
DEFAULT_TIMEOUT = 120.0
_HOST = "127.0.0.1"
_TERMINATE_GRACE = 3.0
#: After one rank fails, how long the others may take to report (to tell the first failure from its echoes).
_FAILURE_GRACE = 1.0


class RankError(RuntimeError):
    """A spawned rank raised, died or timed out.

    Attributes:
        rank: the (lowest) failing rank.
        reason: ``"raised"``, ``"died"`` or ``"timed out"``.
        details: the rank's traceback text (or exit status, or stack dump of the hung ranks).
        reports: for each rank whose exception carried a ``rank_report`` attribute, that object as the rank
            sent it (its ``str()`` is the text used in ``details``). The pytest plugin uses it to finish a
            failed assert's message in the pytest process, with pytest's own comparison hooks.
    """

    def __init__(self, rank: int, reason: str, details: str, reports: dict[int, Any] | None = None) -> None:
        self.rank = rank
        self.reason = reason
        self.details = details
        self.reports: dict[int, Any] = dict(reports or {})
        super().__init__(f"rank {rank} {reason}:\n{details}")


def _rendezvous_timeout(timeout: float) -> datetime.timedelta:
    """Timeout for the store and the process group: never shorter than 30 s.

    The run's own deadline is enforced by the parent; a tiny store timeout only breaks the rendezvous (torch
    2.0 rounds it down to 0 s and the parent's own store then fails to connect to itself).
    """
    return datetime.timedelta(seconds=max(timeout, 30.0))


def _watch_parent(parent: int) -> None:
    """Exit this rank if the parent that spawned it is gone (so a killed test run leaves no orphans)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(70)


def _watch_rank(dump_path: str, parent: int) -> Any:
    """In a rank: send fatal-signal and SIGUSR1 stack dumps to ``dump_path``; exit if ``parent`` goes away.

    Returns the open dump file (keep it: faulthandler writes to its descriptor until the process exits).
    """
    dump = open(dump_path, "w")  # noqa: SIM115 - kept open for faulthandler until the process exits
    faulthandler.enable(file=dump, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    return dump


def _join_group(rank: int, world_size: int, port: int, timeout: float) -> None:
    """In a rank: join the gloo default group as ``rank`` through the parent's store on ``port``.

    Ends with a barrier: gloo's ``init_process_group`` can return on one rank while a peer is still connecting
    its pairs, and a rank that then finishes at once (a test that skips on its first line) and exits would make
    that peer fail inside ``init_process_group`` with "Connection closed by peer", a failure of nobody's code.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        _HOST, port, world_size, False, timeout=_rendezvous_timeout(timeout)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_rendezvous_timeout(timeout))
    dist.barrier()


def _failure(error: BaseException) -> tuple[str, Any]:
    """In a rank, inside ``except``: the ``("error", ...)`` message for ``error``.

    An exception may bring its own report (a picklable object whose str() is the text to show).
    """
    report = getattr(error, "rank_report", None)
    return ("error", traceback.format_exc() if report is None else report)


def _send(conn: multiprocessing.connection.Connection, message: tuple[str, Any]) -> bool:
    """In a rank: send ``message`` stamped with the time; a value that does not pickle is sent as an error.

    Returns whether ``message`` itself went out (False: its value did not pickle).
    """
    try:
        payload = pickle.dumps((*message, time.time()))
    except Exception:
        failed = ("error", f"fn's return value cannot be pickled:\n{traceback.format_exc()}", time.time())
        conn.send_bytes(pickle.dumps(failed))
        return False
    conn.send_bytes(payload)
    return True


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    conn: multiprocessing.connection.Connection,
    dump_path: str,
    parent: int,
) -> None:
    """Body of one spawned rank: join the group, run ``fn``, send back ``("ok", value)`` or ``("error", tb)``.

    The message goes out *before* the group is destroyed: a rank that raises must be heard first, before its
    peers' collectives fail with "connection reset" because it went away. Each message carries the time it was
    sent, so the parent can name the rank that failed first.
    """
    _dump = _watch_rank(dump_path, parent)
    joined = False
    try:
        _join_group(rank, world_size, port, timeout)
        joined = True
        message: tuple[str, Any] = ("ok", fn(*args))
    except BaseException as error:  # everything a rank raises is reported to the parent
        message = _failure(error)
    _send(conn, message)
    conn.close()
    if joined:
        import torch.distributed as dist

        dist.destroy_process_group()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code} without returning"


def spawn_ranks(
    fn: Callable[..., T],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT,
) -> list[T]:
    """Run ``fn(*args)`` on ``world_size`` spawned processes, each rank ``r`` of a gloo group on loopback.

    Args:
        fn: a picklable (module-level) function; it runs after ``torch.distributed`` is initialised.
        world_size: number of ranks, at least 1.
        args: positional arguments for ``fn``, the same on every rank (use ``torch.distributed.get_rank()``
            inside ``fn`` to tell ranks apart).
        timeout: seconds for the whole run, start-up included.

    Returns:
        ``fn``'s return values, in rank order.

    Raises:
        RankError: a rank raised (its traceback), died (its exit status and any fatal-signal dump) or the
            deadline passed (a stack dump of every rank that had not returned). All ranks are gone by then.
        ValueError, TypeError: bad ``world_size``, ``timeout`` or an unpicklable ``fn``/``args``.
    """
    _check_arguments(fn, world_size, args, timeout)
    deadline = time.monotonic() + timeout
    store = _host_store(world_size, timeout)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tmgp-ranks-") as tmp:
        dumps = [str(Path(tmp) / f"rank{rank}.txt") for rank in range(world_size)]
        procs: list[multiprocessing.process.BaseProcess] = []
        conns: list[multiprocessing.connection.Connection] = []
        try:
            for rank in range(world_size):
                receiver, sender = context.Pipe(duplex=False)
                proc = context.Process(
                    target=_rank_main,
                    name=f"tmgp-rank{rank}",
                    args=(rank, world_size, store.port, timeout, fn, tuple(args), sender, dumps[rank], os.getpid()),
                )
                proc.start()
                sender.close()
                procs.append(proc)
                conns.append(receiver)
            return _collect(procs, conns, dumps, deadline)
        finally:
            _teardown(procs)
            for conn in conns:
                conn.close()
            del store


def _check_arguments(fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout: float) -> None:
    """Refuse a bad ``world_size`` or ``timeout`` (ValueError) and an unpicklable ``fn``/``args`` (TypeError)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    try:
        pickle.dumps((fn, tuple(args)))
    except Exception as err:
        raise TypeError(
            f"spawn_ranks needs a picklable fn and args (fn must be a module-level function of an importable "
            f"module, not a lambda or a local function): {err}"
        ) from err


def _host_store(world_size: int, timeout: float) -> Any:
    """The rendezvous ``TCPStore``, hosted by the parent on a kernel-chosen port it keeps bound."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        _HOST, 0, world_size, True, timeout=_rendezvous_timeout(timeout), wait_for_workers=False
    )


def _collect(
    procs: list[multiprocessing.process.BaseProcess],
    conns: list[multiprocessing.connection.Connection],
    dumps: list[str],
    deadline: float,
) -> list[Any]:
    """Wait for every rank's message; raise :class:`RankError` on a failure or at the deadline.

    After the first failure the other ranks get a short grace to report too (a peer of a rank that raised
    usually fails a moment later in a collective); the error names the root cause: a rank that died, else the
    rank whose error was sent first. The others' reports follow in the details.
    """
    results: dict[int, Any] = {}
    failures: dict[int, tuple[float, str, str]] = {}  # rank -> (when, reason, details)
    reports: dict[int, Any] = {}  # rank -> the report object a rank sent instead of a traceback text
    waiting = dict(enumerate(conns))
    while waiting:
        remaining = deadline - time.monotonic()
        if failures:
            remaining = min(remaining, _FAILURE_GRACE - (time.time() - min(f[0] for f in failures.values())))
        if remaining <= 0:
            break
        sentinels = {procs[rank].sentinel: rank for rank in waiting}
        ready = multiprocessing.connection.wait([*waiting.values(), *sentinels], timeout=remaining)
        for item in ready:
            rank = sentinels[item] if isinstance(item, int) else conns.index(item)  # type: ignore[arg-type]
            if rank not in waiting:
                continue
            conn = waiting.pop(rank)
            status, value, sent = None, None, time.time()
            if conn.poll():
                with contextlib.suppress(EOFError):
                    status, value, sent = pickle.loads(conn.recv_bytes())
            if status == "ok":
                results[rank] = value
            elif status == "error":
                failures[rank] = (sent, "raised", str(value))
                if not isinstance(value, str):
                    reports[rank] = value
            else:
                procs[rank].join(_TERMINATE_GRACE)
                details = f"process {_describe_exit(procs[rank].exitcode)}\n{_read_dump(dumps[rank], '')}"
                failures[rank] = (time.time(), "died", details.strip())
    if failures:
        # A rank that died is the likely cause (its peers' collectives fail and *raise* because of it); among
        # ranks that raised, the earliest message wins.
        first = min(failures, key=lambda rank: (failures[rank][1] != "died", failures[rank][0]))
        _, reason, details = failures.pop(first)
        later = "".join(
            f"\n\n--- afterwards rank {rank} {why}:\n{text}" for rank, (_, why, text) in sorted(failures.items())
        )
        raise RankError(first, reason, details + later, reports)
    if waiting:
        _raise_timeout(procs, sorted(waiting), dumps)
    return [results[rank] for rank in range(len(procs))]


def _raise_timeout(procs: list[multiprocessing.process.BaseProcess], pending: list[int], dumps: list[str]) -> None:
    """Ask every pending rank for a stack dump, then raise :class:`RankError` for the lowest one."""
    for rank in pending:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(procs[rank].pid, signal.SIGUSR1)  # type: ignore[arg-type]
    time.sleep(0.5)
    parts = []
    for rank in pending:
        dump = _read_dump(dumps[rank], "(no stack dump: the process had not reached fn's module yet)")
        parts.append(f"--- rank {rank}, still running at the deadline; its threads:\n{dump}")
    raise RankError(pending[0], "timed out", "\n".join(parts))


def _read_dump(path: str, missing: str) -> str:
    """A rank's faulthandler output; ``missing`` when the rank never got as far as opening the file."""
    try:
        return Path(path).read_text(errors="replace").strip() or missing
    except FileNotFoundError:
        return missing


def _teardown(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Terminate, then kill, then reap every rank: no process outlives :func:`spawn_ranks`."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + _TERMINATE_GRACE
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
