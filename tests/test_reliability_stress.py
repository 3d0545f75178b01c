"""Stress: thousands of patch()/unpatch()/patched() calls from 8 threads while ranks keep gathering.

Each rank starts from torchmetrics as shipped (``TORCHMETRICS_GRADPATCH_AUTOPATCH=0``), records the exact
original state (the gather's ``__code__`` object, its ``__dict__`` and defaults, both torchmetrics module
namespaces, ``Metric._sync_dist``'s default), then toggles from 8 threads while the main thread gathers --
inside ``patched()`` blocks, where the graph must never be lost, and outside them, where the values must be
right whichever state the other threads left. At the end, after ``unpatch()``, the state must be the original,
object for object. Each test runs on its ranks through ``@pytest.mark.ranks`` (the package's pytest plugin).
"""

from __future__ import annotations

import pytest

import torchmetrics_gradpatch as tmgp
from tests import _reliability_ranks as ranks
from tests._profile import sized

NATIVE = tmgp.status().native


@pytest.fixture(params=["local", "global"])
def mode(request: pytest.FixtureRequest) -> str:
    """The mode the threads toggle. Local mode installs nothing on native torchmetrics, so there the "original
    restored" check would compare torchmetrics with itself: skipped, the global mode (which installs) runs."""
    if request.param == "local" and NATIVE:
        pytest.skip(
            "native torchmetrics: local mode installs nothing, so toggling it cannot disturb the original; "
            "the global-mode variant swaps the code and checks the restore"
        )
    return str(request.param)


@pytest.fixture
def without_autopatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks inherit the environment: each starts from torchmetrics as shipped."""
    monkeypatch.setenv("TORCHMETRICS_GRADPATCH_AUTOPATCH", "0")


def _check(result: dict[str, object], gathers: int, min_ops: int) -> None:
    assert result["errors"] == [], result
    assert result["state_differences"] == [], result
    assert result["patched_at_end"] is False
    assert result["ops"] >= min_ops  # type: ignore[operator]
    assert result["installed_seen"] > 0, "no block saw the code swapped: the restore check would be vacuous"  # type: ignore[operator]
    assert result["graphs_kept"] == sum(1 for step in range(gathers) if step % 3 != 2)


@pytest.mark.usefixtures("without_autopatch")
@pytest.mark.ranks(2, timeout=150)
def test_toggling_from_8_threads_while_gathering(mode: str) -> None:
    _check(ranks.run_stress(60, 3000, 8, mode), 60, 3000)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("without_autopatch")
@pytest.mark.ranks(3, timeout=800)
def test_toggling_from_8_threads_while_gathering_long(mode: str) -> None:
    gathers, ops = sized(full=1500, ci=200), sized(full=50000, ci=8000)
    _check(ranks.run_stress(gathers, ops, 8, mode), gathers, ops)
