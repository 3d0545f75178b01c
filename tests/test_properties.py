"""Property tests of the patched gather against the unpatched one, on real spawned ranks.

Hypothesis runs *inside* every rank (derandomized, no example database), so all ranks draw the same examples
in the same order and issue the same collectives; each example ends with a consensus step, so a failure on one
rank makes every rank fail (and shrink) together. Spawning costs seconds, so one spawn runs many examples: each
test runs on its ranks through ``@pytest.mark.ranks`` (the package's pytest plugin, enabled in conftest.py).
See ``tests/_reliability_ranks.py`` for what is drawn and checked.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version

import torchmetrics_gradpatch as tmgp
from tests import _reliability_ranks as ranks
from tests._profile import sized
from torchmetrics_gradpatch.testing import RankError, spawn_ranks

# On native torchmetrics (>= 1.6) local mode installs nothing: "patched vs unpatched" would compare torchmetrics'
# gather with itself. The global mode installs the trampoline there, so the patched side uses it (every rank
# alike), checked against torchmetrics' own gather with the global mode's expectations.
MODE = "global" if tmgp.status().native else "local"


@pytest.fixture(scope="module")
def empty_gathers_work() -> bool:
    """Whether this torch's gloo survives gathers of all-empty tensors (torchmetrics' own gather, unpatched)."""
    try:
        spawn_ranks(ranks.all_empty_gathers, 2, timeout=60)
    except RankError:
        return False
    return True


def test_newer_torch_gathers_empty_tensors(empty_gathers_work: bool) -> None:
    """The probe must not hide a problem where gloo is known to handle empty gathers."""
    if Version(torch.__version__).release >= (2, 13):
        assert empty_gathers_work


def worlds(timeout: float) -> list[Any]:
    """World sizes 2 and 3, each case run on that many spawned ranks."""
    return [pytest.param(n, marks=pytest.mark.ranks(n, timeout=timeout)) for n in (2, 3)]


def every_rank(value: object) -> list[object]:
    """Every rank's ``value``, in rank order (a collective: every rank calls it)."""
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


@pytest.mark.parametrize("world_size", worlds(150))
def test_patched_gather_properties(world_size: int, empty_gathers_work: bool) -> None:
    seen = ranks.run_properties(50, empty_gathers_work, MODE)
    assert seen["examples"] >= 50
    # the draws must actually cover the interesting cases, on every rank alike
    assert every_rank(seen) == [seen] * world_size
    assert seen["uneven"] and seen["zero_size"] and seen["grad"] and seen["subgroup"]
    # the same spawn also checks that a non-tensor gives the unpatched error inside an initialised group
    assert seen["non_tensor_problems"] == []
    # Only bfloat16 and bool may be missing (older gloo); everything else must have been drawn from.
    assert set(ranks.DTYPES) - set(seen["dtypes"]) <= {"bfloat16", "bool"}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", worlds(800))
def test_patched_gather_properties_many(world_size: int, empty_gathers_work: bool) -> None:
    examples = sized(full=600, ci=120)
    seen = ranks.run_properties(examples, empty_gathers_work, MODE)
    assert seen["examples"] >= examples
    assert every_rank(seen) == [seen] * world_size


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.ranks(3, timeout=300)
def test_the_property_test_catches_a_wrong_local_index() -> None:
    """The check can fail: a gather that uses the global rank instead of the group rank is caught (world 3)."""
    caught = ranks.properties_catch_a_broken_gather(100, MODE)
    assert caught != "not caught"
    assert "subgroup=True" in caught
