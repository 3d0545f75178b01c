"""Property tests of the patched gather against the unpatched one, on real spawned ranks.

Hypothesis runs *inside* every rank (derandomized, no example database), so all ranks draw the same examples
in the same order and issue the same collectives; each example ends with a consensus step, so a failure on one
rank makes every rank fail (and shrink) together. Spawning costs seconds, so one spawn runs many examples.
See ``tests/_reliability_ranks.py`` for what is drawn and checked.
"""

from __future__ import annotations

import pytest

from tests import _reliability_ranks as ranks
from torchmetrics_gradpatch.testing import spawn_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_patched_gather_properties(world_size: int) -> None:
    seen = spawn_ranks(ranks.run_properties, world_size, args=(50,), timeout=150)
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
def test_patched_gather_properties_many(world_size: int) -> None:
    seen = spawn_ranks(ranks.run_properties, world_size, args=(600,), timeout=800)
    assert seen[0]["examples"] >= 600
    assert all(s == seen[0] for s in seen)


@pytest.mark.slow
def test_the_property_test_catches_a_wrong_local_index() -> None:
    """The check can fail: a gather that uses the global rank instead of the group rank is caught (world 3)."""
    caught = spawn_ranks(ranks.properties_catch_a_broken_gather, 3, args=(100,), timeout=300)
    assert all(message != "not caught" for message in caught), caught
    assert "subgroup=True" in caught[0]
