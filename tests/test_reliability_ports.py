"""Many ``spawn_ranks`` runs at once: no "address already in use", no crossed rendezvous.

The runner hosts each run's rendezvous store in the parent on port 0 and keeps it bound, so the kernel hands
every run its own port and nothing can take it between choosing and using. These tests run several worlds at
the same time -- from threads of one process, and (slow) from separate interpreters, as two test suites would
-- and check each world's all-reduce saw exactly its own ranks.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import _reliability_ranks as ranks
from tests.harness import spawn_ranks

pytestmark = pytest.mark.harness  # tox's harness environment runs this module

ROOT = Path(__file__).resolve().parent.parent


def _run_worlds(count: int, world_size: int = 2, first_tag: int = 1) -> list[str]:
    """Start ``count`` worlds at once from threads; return a description of every problem."""
    tags = list(range(first_tag, first_tag + count))
    with ThreadPoolExecutor(count) as pool:
        futures = {
            tag: pool.submit(spawn_ranks, ranks.port_check, world_size, args=(tag,), timeout=240) for tag in tags
        }
    problems = []
    for tag, future in futures.items():
        try:
            results = future.result()
        except Exception as err:  # a RankError's text would say "address already in use"
            problems.append(f"world {tag}: {err}")
            continue
        want = float(sum(tag * 1000 + rank for rank in range(world_size)))
        for rank, (got_tag, got_rank, got_world, total) in enumerate(results):
            if (got_tag, got_rank, got_world, total) != (tag, rank, world_size, want):
                problems.append(f"world {tag} rank {rank}: {(got_tag, got_rank, got_world, total)}")
    return problems


def test_three_worlds_at_once_from_threads() -> None:
    assert _run_worlds(3) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_six_worlds_at_once_from_threads() -> None:
    assert _run_worlds(6) == []


_SUITE = """
import sys
sys.path.insert(0, {root!r})
from tests.test_reliability_ports import _run_worlds
problems = _run_worlds(3, first_tag={tag})
print(problems)
sys.exit(1 if problems else 0)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_suites_at_once() -> None:
    """Two interpreters, as two test suites would be, each running three worlds at once (12 ranks in all)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SUITE.format(root=str(ROOT), tag=tag)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for tag in (10, 20)
    ]
    outputs = [proc.communicate(timeout=500)[0] for proc in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output
        assert "address already in use" not in output.lower()
