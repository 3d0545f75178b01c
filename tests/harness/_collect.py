"""Reading the ranks' answers, parent side: results in rank order, or one :class:`RankError` naming the cause.

* After the first failure the others get a short grace to report, and the error names the root cause: a rank
  that died, else the rank whose error was sent first; the others' reports follow.
* At the deadline, the pending ranks are asked for their stacks; the report leads with a rank that is not inside
  a collective (the one its peers wait for) and says where the others wait.
* A value that pickled in the rank but cannot be unpickled here is an error naming the rank and the type.

Invariant: parent side; imports :mod:`._processes` and the standard library.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import signal
import time
from typing import IO, Any

from tests.harness._processes import TERMINATE_GRACE, describe_exit, read_dump

__all__ = ["RankError", "collect"]

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

    __module__ = "tests.harness"  # where tests import it from, and how tracebacks name it

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

    def __reduce__(self) -> tuple[Any, ...]:  # the arguments, not the message (pytest-xdist ships errors pickled)
        return (_rebuilt, (self.rank, self.reason, self.details, self.reports, self.collectives, self.starting))


def _rebuilt(
    rank: int, reason: str, details: str, reports: dict[int, Any], collectives: dict[int, str], starting: bool
) -> RankError:
    return RankError(rank, reason, details, reports, collectives=collectives, starting=starting)


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


#: The longest single wait; the loop re-checks the deadline after each.
_WAIT_SLICE = 3600.0


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
        # in slices: a far deadline (any finite timeout is accepted) would overflow the poll's own limit
        ready = multiprocessing.connection.wait([*waiting.values(), *sentinels], timeout=min(remaining, _WAIT_SLICE))
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
