"""Spawned-rank runner, parent side: run a function on N real processes, each inside its own gloo group.

``spawn_ranks(fn, world_size)`` is what the suite's DDP tests and the ``ranks`` marker run on. Its guarantees (the
rank's side is :mod:`._rank`):

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

The harness imports nothing of the package: a fresh rank has the patch when ``fn``'s module imports the package,
exactly as a program would (``TORCHMETRICS_GRADPATCH_AUTOPATCH=0`` included).
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any, TypeVar

from tests.harness import _rank, _reaper
from tests.harness._collect import RankError, collect
from tests.harness._processes import dump_of, host_store, new_dump, start_rank, teardown

__all__ = ["DEFAULT_TIMEOUT", "RankError", "check_arguments", "check_timeout", "check_world_size", "spawn_ranks"]

T = TypeVar("T")

#: Seconds one :func:`spawn_ranks` call may take, start-up included (ranks take seconds to import torch).
DEFAULT_TIMEOUT = 120.0


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
