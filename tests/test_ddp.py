"""Spawned DDP tests: real processes, gloo on loopback, world sizes 1, 2 and 3 and a subgroup of 2 of 3.

Each world size is spawned once (module-scoped fixture) and runs every case in ``tests/_ddp_ranks.py``;
the tests below assert on what the ranks returned: gathered values against torchmetrics' own unpatched
gather, gradients against analytic values and a single-process float64 reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import _ddp_ranks as ranks
from torchmetrics_gradpatch.testing import spawn_ranks

WORLD_SIZES = (1, 2, 3)
SUBGROUP = [0, 2]


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, Any]]]:
    """Every rank's results, per world size; the 3-rank run also exercises a subgroup of ranks 0 and 2."""
    return {
        world_size: spawn_ranks(ranks.run_all, world_size, args=(SUBGROUP if world_size == 3 else None,), timeout=180)
        for world_size in WORLD_SIZES
    }


def _reference_grads(case: str, world_size: int) -> list[torch.Tensor]:
    """Single-process gradient of the global loss w.r.t. each rank's preds (same data as the ranks)."""
    rows = ranks.rows_for(case)
    preds, targets = zip(*(ranks.inputs(rank, rows[rank]) for rank in range(world_size)), strict=True)
    leaves = [p.clone().requires_grad_() for p in preds]
    mse = ((torch.cat(leaves) - torch.cat(targets)) ** 2).mean()
    loss = 2 * mse if case in ("collection", "compositional") else mse
    loss.backward()
    return [leaf.grad for leaf in leaves]  # type: ignore[misc]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_process_runs_the_rank_it_joined_as(results: dict[int, list[dict[str, Any]]], world_size: int) -> None:
    """The rank-order lesson: entry j of a gather comes from the process that is rank j, and fn ran there."""
    per_rank = results[world_size]
    expected = [(r["pid"], r["rank"]) for r in per_rank]
    assert [r["rank"] for r in per_rank] == list(range(world_size))
    for r in per_rank:
        assert r["gathered_pids"] == expected


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", ranks.GATHER_CASES)
def test_gather_matches_unpatched_and_keeps_local_graph(
    results: dict[int, list[dict[str, Any]]], world_size: int, case: str
) -> None:
    for rank, r in enumerate(results[world_size]):
        _check_gather(r["gather"][case], case, rank)


@pytest.mark.parametrize("case", ("equal", "uneven_rows", "scalar"))
def test_subgroup_uses_the_rank_within_the_group(results: dict[int, list[dict[str, Any]]], case: str) -> None:
    for global_rank in SUBGROUP:
        r = results[3][global_rank]["subgroup"][case]
        assert r["group_rank"] == SUBGROUP.index(global_rank)
        _check_gather(r, case, r["group_rank"])
    assert "subgroup" not in results[3][1]


def _check_gather(r: dict[str, Any], case: str, local: int) -> None:
    patched, reference = r["patched"], r["reference"]
    assert len(patched) == len(reference)
    for j, (got, want) in enumerate(zip(patched, reference, strict=True)):
        assert got.dtype == want.dtype and got.shape == want.shape, (j, got, want)
        assert torch.equal(got, want), (j, got, want)  # bit for bit (these dtypes have no NaN here)
    assert torch.equal(patched[local], r["input"].contiguous())
    assert r["warnings"] == []
    assert r["collectives"] == r["reference_collectives"]
    for j, (got, want) in enumerate(zip(r["global_values"], reference, strict=True)):  # through the trampoline
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), ("global", j)
    if case != "non_contiguous":
        assert r["local_is_input"], "the local entry must be the caller's own tensor"
    else:  # upstream returns result.contiguous(): a copy that is still connected to the caller's graph
        assert not r["local_is_input"]
    if case == "under_no_grad":  # the caller's own leaf comes back as it is; nothing else has a graph
        assert r["requires_grad"] == [j == local for j in range(len(patched))]
        assert r["grad"] is None
    elif case not in ("integer", "no_requires_grad"):
        assert r["requires_grad"] == [j == local for j in range(len(patched))]
        assert torch.equal(r["grad"], torch.full_like(r["input"], float(local + 1)))
    else:
        assert r["requires_grad"] == [False] * len(patched)
        assert r["grad"] is None


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", ranks.METRIC_CASES)
def test_metric_paths_backpropagate_like_single_process(
    results: dict[int, list[dict[str, Any]]], world_size: int, case: str
) -> None:
    """Each rank's gradient is d(global loss)/d(its own preds): the single-process gradient, sliced."""
    reference = _reference_grads(case, world_size)
    values = [r["metric"][case]["value"] for r in results[world_size]]
    for rank, r in enumerate(results[world_size]):
        torch.testing.assert_close(r["metric"][case]["grad"], reference[rank], rtol=1e-12, atol=1e-15)
        assert torch.equal(values[rank], values[0]), "every rank must see the same synced loss"


@pytest.mark.parametrize("world_size", (2, 3))
def test_the_patch_is_what_makes_the_difference(results: dict[int, list[dict[str, Any]]], world_size: int) -> None:
    """Control. Patch off: old torchmetrics loses the graph; native torchmetrics keeps it and gives the reference
    gradient itself. Global mode (installed on every torchmetrics): every rank gets world_size x the reference,
    so on native torchmetrics too the installed code, not torchmetrics' own, produced it."""
    reference = _reference_grads("forward_cat", world_size)
    for rank, r in enumerate(results[world_size]):
        control = r["control"]
        assert r["status_in_force"] and not control["unpatched_installed"] and control["global_installed"]
        if r["native"]:
            assert control["unpatched_keeps_graph"]
            torch.testing.assert_close(control["unpatched_grad"], reference[rank], rtol=1e-12, atol=1e-15)
        else:
            assert not control["unpatched_keeps_graph"] and control["unpatched_grad"] is None
        torch.testing.assert_close(control["global_grad"], world_size * reference[rank], rtol=1e-12, atol=1e-15)
