"""Rank functions for the runner's own fault and port tests (tests/test_faults.py, test_reliability_ports.py).

They run inside ranks spawned by :func:`tests.harness.spawn_ranks` (the runner is what those
tests check), so they must be module-level in an importable module. The property and stress bodies live beside
their tests (tests/test_properties.py, tests/test_reliability_stress.py).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------------------------------------------
# Faults and ports
# --------------------------------------------------------------------------------------------------------------


class DeliberateError(Exception):
    """Raised on purpose by :func:`raise_on`."""


def raise_on(bad_rank: int, message: str) -> int:
    rank = dist.get_rank()
    if rank == bad_rank:
        raise DeliberateError(message)
    dist.barrier()  # the others wait in a collective the bad rank never joins
    return rank


def raise_on_alone(bad_rank: int, message: str) -> int:
    """The bad rank raises while the others are *not* inside a collective (they sleep, then return)."""
    rank = dist.get_rank()
    if rank == bad_rank:
        raise DeliberateError(message)
    time.sleep(5.0)
    return rank


def exit_on(bad_rank: int, code: int) -> int:
    rank = dist.get_rank()
    if rank == bad_rank:
        os._exit(code)
    dist.barrier()
    return rank


def exit_on_alone(bad_rank: int, code: int) -> int:
    """The bad rank exits while the others are *not* inside a collective (they sleep, then return)."""
    rank = dist.get_rank()
    if rank == bad_rank:
        os._exit(code)
    time.sleep(5.0)
    return rank


def kill_self_on(bad_rank: int) -> int:
    import signal

    rank = dist.get_rank()
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(5.0)  # not in a collective: see the xfail tests in test_faults.py for why
    return rank


def hang_on(bad_rank: int) -> int:
    rank = dist.get_rank()
    if rank == bad_rank:
        hang_here_forever()
    dist.barrier()
    return rank


def hang_here_forever() -> None:
    while True:
        time.sleep(0.2)


def port_check(tag: int) -> tuple[int, int, int, float]:
    """A real collective, so a crossed rendezvous (two runs sharing a port) would show up as a wrong sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(tag * 1000 + rank)])
    dist.all_reduce(value)
    return tag, rank, world, float(value)
