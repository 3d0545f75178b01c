"""Spawned-rank runner, parent side: run a function on N real processes, each inside its own gloo group.

``spawn_ranks(fn, world_size)`` is what this project's DDP tests run on, and is public so users can test their own
metrics the same way. Its guarantees (the rank's side is :mod:`._rank`; docs/design.md tells why each is there):

* **Process r joins as rank r, then calls fn**; nothing else ever runs in it.
* **No free-port race**: the parent hosts the rendezvous ``TCPStore`` on port 0 and keeps it bound.
* **Checked before anything starts**: every argument is validated, ``args`` materialised once, before a process
  exists.
* **Bounded and loud**: one deadline for the run; a rank that raises, dies or outlives it makes
  :func:`spawn_ranks` raise :class:`RankError` naming the rank with its traceback (for a hang, the rank that is
  not inside a collective first, with the ``faulthandler`` stacks of every pending rank).
* **Nothing left behind**: each rank leads its own process group, and teardown kills the whole group, so a
  process a rank started goes with it; a rank dies with its parent; stack dumps go to unlinked files.
* **Fresh interpreters** (the ``spawn`` start method): ``fn`` and ``args`` must be picklable.

The harness never imports the patch engine: a rank imports :mod:`torchmetrics_gradpatch` (its parent package),
so the patch is in force there exactly as at program start unless ``TORCHMETRICS_GRADPATCH_AUTOPATCH=0``.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import signal
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any, TypeVar

from torchmetrics_gradpatch.testing import _rank, _reaper

__all__ = ["DEFAULT_TIMEOUT", "RankError", "spawn_ranks"]

T = TypeVar("T")

#: Seconds one :func:`spawn_ranks` call may take, start-up included (ranks take seconds to import torch).
DEFAULT_TIMEOUT = 120.0
TERMINATE_GRACE = 3.0
#: After one rank fails, how long the others may take to report (to tell the first failure from its echoes).
_FAILURE_GRACE = 1.0
_COLLECTIVE = re.compile(r'distributed_c10d\.py", line \d+ in (\w+)')


class RankError(RuntimeError):
    """A spawned rank raised, died or timed out.

    Attributes:
        rank: the failing rank (for a hang: the first rank not inside a collective, else the lowest).
        reason: ``"raised"``, ``"died"`` or ``"timed out"``.
        details: the rank's traceback text (or exit status, or stack dump of the hung ranks).
        reports: for each rank whose exception carried a ``rank_report`` attribute, that object as the rank
            sent it (its ``str()`` is the text used in ``details``).
        collectives: for a hang, each pending rank that waits in a torch.distributed collective, and which.
        starting: whether it happened while a warm pool was starting, before the test ran.
    """

    def __init__(
        self,
        rank: int,
        reason: str,
        details: str,
        reports: dict[int, Any] | None = None,
        *,
        collectives: dict[int, str] | None = None,
        starting: bool = False,
    ) -> None:
        self.rank = rank
        self.reason = reason
        self.details = details
        self.reports: dict[int, Any] = dict(reports or {})
        self.collectives: dict[int, str] = dict(collectives or {})
        self.starting = starting
        during = " while the rank pool was starting" if starting else ""
        super().__init__(f"rank {rank} {reason}{during}:\n{details}")


# --- arguments ------------------------------------------------------------------------------------------------------


def check_world_size(world_size: object) -> int:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def check_timeout(timeout: object, name: str = "timeout") -> float:
    """``timeout`` as a float; ValueError naming ``name`` unless it is a positive finite number (bool refused)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds (finite, not a bool), got {timeout!r}")
    return float(timeout)


def check_arguments(fn: object, world_size: object, args: object, timeout: object) -> tuple[Any, ...]:
    """Validate a run before any process starts; returns ``args`` materialised once, as a tuple.

    Raises ValueError for a bad ``world_size``/``timeout`` and TypeError for a non-callable or unpicklable
    ``fn``, ``args`` that are not an iterable of arguments, or arguments that do not pickle.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable (a module-level function), got {fn!r}")
    check_world_size(world_size)
    check_timeout(timeout)
    if isinstance(args, (str, bytes, Mapping)) or not isinstance(args, Iterable):
        raise TypeError(
            f"args must be an iterable of fn's positional arguments (a tuple or list), got {type(args).__name__} "
            f"{args!r:.80}"
        )
    materialised = tuple(args)
    try:
        pickle.dumps((fn, materialised))
    except Exception as err:
        raise TypeError(
            f"spawn_ranks needs a picklable fn and args (fn must be a module-level function of an importable "
            f"module, not a lambda or a local function): {err}"
        ) from err
    return materialised


# --- processes ------------------------------------------------------------------------------------------------------


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


# --- collecting the answers -----------------------------------------------------------------------------------------


def _receive(rank: int, conn: multiprocessing.connection.Connection) -> tuple[str | None, Any, float]:
    """``(status, value, time sent)`` from a rank's pipe; ``(None, None, now)`` when it closed without a message.

    A value that pickled in the rank but cannot be unpickled here is turned into an error naming its type.
    """
    if not conn.poll():
        return None, None, time.time()
    try:
        status, type_name, sent, blob = pickle.loads(conn.recv_bytes())
    except EOFError:
        return None, None, time.time()
    try:
        return status, pickle.loads(blob), sent
    except Exception as err:
        what = "return value" if status == "ok" else "error report"
        text = (
            f"rank {rank}'s {what} ({type_name}) pickled in the rank but cannot be unpickled in the parent: "
            f"{type(err).__name__}: {err}. Return plain data (numbers, lists, dicts, tensors) or make its module "
            f"importable in the parent."
        )
        return "error", text, sent


def collect(
    procs: list[multiprocessing.process.BaseProcess],
    conns: list[multiprocessing.connection.Connection],
    dumps: list[IO[bytes]],
    deadline: float,
    *,
    starting: bool = False,
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
            status, value, sent = _receive(rank, waiting.pop(rank))
            if status == "ok":
                results[rank] = value
            elif status == "error":
                failures[rank] = (sent, "raised", str(value))
                if not isinstance(value, str):
                    reports[rank] = value
            else:
                procs[rank].join(TERMINATE_GRACE)
                details = f"process {describe_exit(procs[rank].exitcode)}\n{read_dump(dumps[rank], '')}"
                failures[rank] = (time.time(), "died", details.strip())
    if failures:
        # A rank that died is the likely cause (its peers' collectives fail and *raise* because of it); among
        # ranks that raised, the earliest message wins.
        first = min(failures, key=lambda rank: (failures[rank][1] != "died", failures[rank][0]))
        _, reason, details = failures.pop(first)
        later = "".join(
            f"\n\n--- afterwards rank {rank} {why}:\n{text}" for rank, (_, why, text) in sorted(failures.items())
        )
        raise RankError(first, reason, details + later, reports, starting=starting)
    if waiting:
        _raise_timeout(procs, sorted(waiting), dumps, starting)
    return [results[rank] for rank in range(len(procs))]


def _raise_timeout(
    procs: list[multiprocessing.process.BaseProcess], pending: list[int], dumps: list[IO[bytes]], starting: bool
) -> None:
    """Ask every pending rank for a stack dump; raise :class:`RankError` leading with a rank not in a collective.

    A rank that waits in ``all_reduce`` waits for a peer; the peer that is elsewhere (sleeping, looping, stuck
    in the user's code) is the one to look at, so it comes first, and the others say where they wait.
    """
    for rank in pending:
        if procs[rank].pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[rank].pid, signal.SIGUSR1)  # type: ignore[arg-type]
    time.sleep(0.5)
    stacks = {rank: read_dump(dumps[rank], "") for rank in pending}
    collectives = {rank: found.group(1) for rank in pending if (found := _COLLECTIVE.search(stacks[rank]))}
    order = sorted(pending, key=lambda rank: (rank in collectives, rank))
    lines = []
    if collectives and len(collectives) < len(pending):
        elsewhere = ", ".join(f"rank {rank}" for rank in order if rank not in collectives)
        inside = "; ".join(f"rank {rank} waits in {collectives[rank]}" for rank in sorted(collectives))
        lines.append(f"not inside a collective: {elsewhere}; {inside}")
    missing = "(no stack dump: the process had not reached fn's module yet)"
    for rank in order:
        lines.append(f"--- rank {rank}, still running at the deadline; its threads:\n{stacks[rank] or missing}")
    raise RankError(order[0], "timed out", "\n".join(lines), collectives=collectives, starting=starting)


# --- the runner -----------------------------------------------------------------------------------------------------


def start_rank(
    context: Any, target: Callable[..., None], name: str, args: tuple[Any, ...]
) -> multiprocessing.process.BaseProcess:
    proc: multiprocessing.process.BaseProcess = context.Process(target=target, name=name, args=args)
    proc.start()
    return proc


def spawn_ranks(
    fn: Callable[..., T],
    world_size: int = 2,
    *,
    args: Iterable[Any] = (),
    timeout: float = DEFAULT_TIMEOUT,
) -> list[T]:
    """Run ``fn(*args)`` on ``world_size`` spawned processes, each rank ``r`` of a gloo group on loopback.

    Args:
        fn: a picklable (module-level) function; it runs after ``torch.distributed`` is initialised.
        world_size: number of ranks, at least 1.
        args: positional arguments for ``fn`` (any iterable, read once), the same on every rank (use
            ``torch.distributed.get_rank()`` inside ``fn`` to tell ranks apart).
        timeout: seconds for the whole run, start-up included: a positive finite number.

    Returns:
        ``fn``'s return values, in rank order.

    Raises:
        RankError: a rank raised (its traceback), died (its exit status and any fatal-signal dump) or the
            deadline passed (a stack dump of every rank that had not returned). All ranks are gone by then.
        ValueError, TypeError: a bad argument, named, before any process starts.
    """
    materialised = check_arguments(fn, world_size, args, timeout)
    deadline = time.monotonic() + timeout
    store = host_store(world_size, timeout)
    context = multiprocessing.get_context("spawn")
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    dumps: list[IO[bytes]] = []
    _reaper.track(id(procs), lambda: teardown(procs))
    try:
        for rank in range(world_size):
            dumps.append(new_dump())
            receiver, sender = context.Pipe(duplex=False)
            conns.append(receiver)
            try:
                rank_args = (rank, world_size, store.port, timeout, fn, materialised, sender, dump_of(dumps[-1]))
                procs.append(start_rank(context, _rank.rank_main, f"tmgp-rank{rank}", (*rank_args, os.getpid())))
            finally:
                sender.close()
        return collect(procs, conns, dumps, deadline)
    finally:
        teardown(procs)
        _reaper.untrack(id(procs))
        for conn in conns:
            conn.close()
        for dump in dumps:
            dump.close()
        del store
