"""Faults: a rank that raises, exits, is killed or hangs makes ``spawn_ranks`` fail in time, loudly, cleanly.

"Cleanly" is checked against the operating system, not the runner's bookkeeping: after each failure no
process spawned by this test process is left (``/proc`` is read for descendants; multiprocessing's shared
``resource_tracker`` helper, which lives as long as the parent by design, is not a rank and is ignored).
Errors that do not depend on ranks -- an uninitialised process group, a non-tensor input -- must be exactly
the errors the unpatched torchmetrics gather raises. Fresh ranks by design: how ranks fail and end is what is tested.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import torchmetrics_gradpatch as tmgp
from tests import _reliability_ranks as ranks
from tests._rank_tools import error_of, errors_off_and_on
from tests.harness import RankError, spawn_ranks

pytestmark = pytest.mark.harness  # tox's harness environment runs this module

# Generous for a 2-core machine shared with other suites: spawning 2 ranks that import torch takes ~3 s idle.
TIMEOUT = 40.0
#: How long after the timeout the error may come: the stack dump (0.5 s) plus terminate/kill grace (3 s each).
GRACE = 10.0


def _descendants(pid: int) -> set[int]:
    """Live descendants of ``pid`` (from /proc), without multiprocessing's resource tracker and zombies."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if state == "Z" or "resource_tracker" in cmdline:
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@pytest.fixture
def no_leftover_processes():  # type: ignore[no-untyped-def]
    before = _descendants(os.getpid())
    yield
    deadline = time.monotonic() + 2.0
    while (left := _descendants(os.getpid()) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


def _fails(fn, *args: object, world_size: int = 2, timeout: float = TIMEOUT) -> tuple[RankError, float]:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        spawn_ranks(fn, world_size, args=args, timeout=timeout)
    return caught.value, time.monotonic() - start


@pytest.mark.usefixtures("no_leftover_processes")
def test_rank_that_raises_reports_its_traceback() -> None:
    error, elapsed = _fails(ranks.raise_on_alone, 1, "boom from rank one")
    assert (error.rank, error.reason) == (1, "raised")
    assert "DeliberateError: boom from rank one" in error.details
    assert "raise_on_alone" in error.details and "Traceback" in error.details  # the rank's own traceback
    assert elapsed < TIMEOUT


@pytest.mark.usefixtures("no_leftover_processes")
def test_rank_that_raises_while_peers_wait_in_a_collective_is_named() -> None:
    error, elapsed = _fails(ranks.raise_on, 1, "boom from rank one")
    assert elapsed < TIMEOUT
    assert error.reason == "raised"
    assert (error.rank, "DeliberateError: boom from rank one" in error.details) == (1, True)


@pytest.mark.usefixtures("no_leftover_processes")
def test_rank_that_exits_is_reported_as_died() -> None:
    error, elapsed = _fails(ranks.exit_on_alone, 0, 7)
    assert (error.rank, error.reason) == (0, "died")
    assert "exited with code 7" in error.details
    assert elapsed < TIMEOUT


@pytest.mark.usefixtures("no_leftover_processes")
def test_rank_that_exits_while_peers_wait_in_a_collective_is_named() -> None:
    error, elapsed = _fails(ranks.exit_on, 0, 7)
    assert elapsed < TIMEOUT
    assert (error.rank, error.reason) == (0, "died")


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_rank_killed_by_a_signal_is_reported_as_died() -> None:
    error, elapsed = _fails(ranks.kill_self_on, 1, world_size=3)
    assert (error.rank, error.reason) == (1, "died")
    assert "SIGKILL" in error.details
    assert elapsed < TIMEOUT


@pytest.mark.usefixtures("no_leftover_processes")
def test_rank_that_hangs_times_out_with_its_stack() -> None:
    timeout = 15.0
    error, elapsed = _fails(ranks.hang_on, 1, timeout=timeout)
    assert error.reason == "timed out"
    assert error.rank in (0, 1)  # rank 0 waits in the barrier rank 1 never joins: both are still running
    assert "hang_here_forever" in error.details  # the faulthandler dump shows where rank 1 is stuck
    assert timeout <= elapsed < timeout + GRACE


@pytest.mark.parametrize(
    "tensor", [torch.tensor(1.0), torch.ones(3), torch.ones(2, 0)], ids=["scalar", "vector", "empty"]
)
def test_uninitialised_process_group_gives_the_unpatched_error(tensor: torch.Tensor) -> None:
    from torchmetrics.utilities.distributed import gather_all_tensors

    assert not torch.distributed.is_initialized()
    tensor.requires_grad_(tensor.is_floating_point())
    unpatched, *patched = errors_off_and_on(lambda: gather_all_tensors(tensor))
    assert unpatched[0] is not None and patched and all(error == unpatched for error in patched)
    # the package's own gather, called directly, raises the same too, in either mode
    for mode in ("local", "global"):
        assert error_of(lambda: tmgp.gather_all_tensors(tensor, mode=mode)) == unpatched  # noqa: B023


@pytest.mark.parametrize("value", [1.5, [1.0, 2.0], None, "x", (torch.ones(1),)], ids=repr)
def test_non_tensor_gives_the_unpatched_error(value: object) -> None:
    from torchmetrics.utilities.distributed import gather_all_tensors

    unpatched, *patched = errors_off_and_on(lambda: gather_all_tensors(value))
    assert unpatched[0] is not None and patched and all(error == unpatched for error in patched)


# In an initialised group the same comparison runs inside test_properties.py's spawn (saves a spawn here).
