"""Property tests of the patched gather against the unpatched one, on real spawned ranks.

Hypothesis runs *inside* every rank (derandomized, no example database), so all ranks draw the same examples
in the same order and issue the same collectives; each example ends with a consensus step, so a failure on one
rank makes every rank fail (and shrink) together. Spawning costs seconds, so one spawn runs many examples.
See ``tests/_reliability_ranks.py`` for what is drawn and checked.
"""

from __future__ import annotations

import pytest
import torch
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


@pytest.mark.parametrize("world_size", [2, 3])
def test_patched_gather_properties(world_size: int, empty_gathers_work: bool) -> None:
    seen = spawn_ranks(ranks.run_properties, world_size, args=(50, empty_gathers_work, MODE), timeout=150)
    assert seen[0]["examples"] >= 50
    # the draws must actually cover the interesting cases, on every rank alike
    assert all(s == seen[0] for s in seen)
    assert seen[0]["uneven"] and seen[0]["zero_size"] and seen[0]["grad"] and seen[0]["subgroup"]
    # the same spawn also checks that a non-tensor gives the unpatched error inside an initialised group
    assert seen[0]["non_tensor_problems"] == []
    # Only bfloat16 and bool may be missing (older gloo); everything else must have been drawn from.
    assert set(ranks.DTYPES) - set(seen[0]["dtypes"]) <= {"bfloat16", "bool"}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 3])
def test_patched_gather_properties_many(world_size: int, empty_gathers_work: bool) -> None:
    examples = sized(full=600, ci=120)
    seen = spawn_ranks(ranks.run_properties, world_size, args=(examples, empty_gathers_work, MODE), timeout=800)
    assert seen[0]["examples"] >= examples
    assert all(s == seen[0] for s in seen)


@pytest.mark.slow
def test_the_property_test_catches_a_wrong_local_index() -> None:
    """The check can fail: a gather that uses the global rank instead of the group rank is caught (world 3)."""
    caught = spawn_ranks(ranks.properties_catch_a_broken_gather, 3, args=(100, MODE), timeout=300)
    assert all(message != "not caught" for message in caught), caught
    assert "subgroup=True" in caught[0]
