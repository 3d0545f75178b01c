"""Spawned gloo ranks that meet at a store this process hosts and each run one function, with a deadline.

:func:`run` returns every rank's ``fn(*args)`` in rank order, or raises :class:`RanksError` naming each rank that
raised (its traceback), died (its exit status, any fatal-signal dump) or was still running (its Python stack). No
rank outlives it. Its parts serve ranks kept warm elsewhere; it imports nothing of this package, so it loads alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

HOST, STILL = "127.0.0.1", "was still running"


class RanksError(Exception):
    """``reports``: rank -> (``"raised"``, ``"died"`` or :data:`STILL`, its text), failures first as seen; ``joined``:
    whether every rank had joined the group; ``pids``: the ranks' processes."""

    def __init__(self, reports: dict[int, tuple[str, str]], joined: bool, pids: list[int]) -> None:
        super().__init__("\n".join(f"rank {rank} {how}:\n{text}" for rank, (how, text) in reports.items()))
        self.reports, self.joined, self.pids = reports, joined, pids


def host(world_size: int) -> Any:
    """The store the ranks meet at, on a port the kernel picks and this process keeps bound: no free-port race."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(HOST, 0, world_size, True, wait_for_workers=False)  # type: ignore[attr-defined]
    except RuntimeError as error:  # torch's DistNetworkError
        raise OSError(f"the ranks' store cannot listen on a loopback port ({HOST}): {error}".splitlines()[0]) from None


def prepare(directory: str) -> None:
    """In a rank: die with the parent; dump Python stacks into ``directory`` on SIGUSR1 and on a fatal signal."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux): a parent killed outright ends it
    file = open(_stacks(directory, os.getpid()) + ".part", "w")  # noqa: SIM115 -- faulthandler's for life
    faulthandler.enable(file)
    faulthandler.register(signal.SIGUSR1, file)
    os.rename(file.name, _stacks(directory, os.getpid()))  # the name appears once SIGUSR1 dumps rather than kills


def join(rank: int, world_size: int, store: Any, backend: str = "gloo") -> None:
    """In a rank: join the default group through ``store`` (NCCL: on device ``rank``)."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    dist.barrier()  # gloo may return from init on one rank while a peer still connects


def stacks(directory: str, pids: dict[int, int]) -> dict[int, str]:
    """The Python stacks of the ranks in ``pids`` (rank -> pid), asked for with SIGUSR1."""
    for pid in pids.values():  # one without its stacks file has no handler yet: SIGUSR1 would kill it
        if os.path.exists(_stacks(directory, pid)):
            with contextlib.suppress(OSError):  # it has ended meanwhile
                os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)  # faulthandler writes from its signal handler at once, even while C code holds the GIL
    return {rank: _read(_stacks(directory, pid)) or "(none: the rank was still starting)" for rank, pid in pids.items()}


def run(
    fn: Any, world_size: int, args: Sequence[Any] = (), *, timeout: float, startup: float = 0, backend: str = "gloo"
) -> list[Any]:
    """``fn(*args)`` on every rank within ``timeout`` seconds of the call; with ``startup``, the ranks get that long
    to join and ``timeout`` from then. ``OSError`` if the store cannot listen."""
    store, spawn = host(world_size), multiprocessing.get_context("spawn")
    deadline, results, reports = time.monotonic() + (startup or timeout), {}, {}  # type: ignore[var-annotated]
    with tempfile.TemporaryDirectory(prefix="tmgp-ranks-") as directory:
        rank_args = [(rank, world_size, store.port, directory, fn, tuple(args), backend) for rank in range(world_size)]
        # not daemons: a rank may start processes of its own (inductor's compile workers, which watch their parent)
        procs = [spawn.Process(target=_rank, args=each) for each in rank_args]
        try:
            for proc in procs:
                proc.start()
            while len(results) < world_size and not reports and time.monotonic() < deadline:
                if startup and int(store.add("joined", 0)) == world_size:
                    deadline, startup = time.monotonic() + timeout, 0
                for rank, proc in enumerate(procs):
                    if rank in results:
                        continue
                    if int(store.add(f"done{rank}", 0)):  # a counter: TCPStore.check is torch 2.1 and newer
                        ok, results[rank] = pickle.loads(store.get(f"result{rank}"))
                        if not ok:
                            reports[rank] = ("raised", results[rank])
                    elif proc.exitcode is not None:  # the dump: faulthandler's, of a fatal signal
                        code = proc.exitcode
                        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                        dump = _read(_stacks(directory, proc.pid or 0))
                        reports[rank] = ("died", f"process {rank} terminated with {how}\n{dump}".strip())
                time.sleep(0.05)
            pending = {rank: proc.pid or 0 for rank, proc in enumerate(procs) if rank not in results | reports.keys()}
            if pending:
                reports.update((rank, (STILL, stack)) for rank, stack in stacks(directory, pending).items())
            if reports:
                raise RanksError(reports, int(store.add("joined", 0)) == world_size, [p.pid or 0 for p in procs])
            return [results[rank] for rank in range(world_size)]
        finally:
            for proc in procs:  # SIGKILL, which nothing a rank runs can delay; one reaped is not signalled
                if proc.pid is not None:
                    proc.kill()
                    proc.join()


def _rank(rank: int, world_size: int, port: int, directory: str, fn: Any, args: tuple[Any, ...], backend: str) -> None:
    prepare(directory)
    import torch.distributed as dist

    store = dist.TCPStore(HOST, port, world_size, False)  # type: ignore[attr-defined]
    try:
        join(rank, world_size, store, backend)
        store.add("joined", 1)
        outcome = pickle.dumps((True, fn(*args)))  # a result that does not pickle fails here, as a raise
    except BaseException:
        outcome = pickle.dumps((False, traceback.format_exc()))
    store.set(f"result{rank}", outcome)  # type: ignore[arg-type]
    store.add(f"done{rank}", 1)
    sys.stdout.flush()  # the parent ends this process with SIGKILL
    sys.stderr.flush()
    # Wait to be killed: leaving would tear gloo down, which can hang (torch 2.0 to 2.4) or abort (2.13 to 2.15).
    while True:
        signal.pause()


def _stacks(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}.stack")


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as file:
        return file.read().strip()
    return ""
