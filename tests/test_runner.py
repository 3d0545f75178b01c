"""spawn_ranks' argument checks and its deadline before any rank has started (no process group needed)."""

from __future__ import annotations

import time

import pytest

from tests.harness import RankError, spawn_ranks

pytestmark = pytest.mark.harness  # tox's harness environment runs this module


def _identity() -> int:
    return 1


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_world_size_must_be_a_positive_int(world_size: object) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        spawn_ranks(_identity, world_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [0, -3.0])
def test_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        spawn_ranks(_identity, 1, timeout=timeout)


def test_fn_must_be_picklable() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        spawn_ranks(lambda: 1, 1)


def test_a_deadline_before_the_ranks_start_is_reported_not_crashed() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn_ranks(_identity, 2, timeout=0.2)
    assert info.value.reason == "timed out" and info.value.rank == 0
    assert "rank 1" in info.value.details
    assert time.monotonic() - start < 15, "teardown must not wait for the ranks to finish starting"
