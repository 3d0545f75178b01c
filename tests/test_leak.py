"""Nothing accumulates across gathers and Metric-loss steps, in either gradient mode, on two real gloo ranks.

A short version of ``benchmarks/bench_soak.py`` (its workload and settled sampling, from
``benchmarks/soak_workload.py``): after a warm-up, the number of ``torch.Tensor`` objects the garbage collector tracks
must not grow at all, and RSS must stay within a generous bound. Holding on to anything a gather returns, or to a
step's graph, adds tensors at every call, so the count catches a leak of any size; the RSS bound only guards
against growth outside Python objects.
"""

from __future__ import annotations

import pytest
import torch
from torchmetrics.utilities.distributed import gather_all_tensors

import torchmetrics_gradpatch as tg
from benchmarks.soak_workload import LossSteps, run_phase, settled_sample, soak_gather_input
from tests._ranks import run_ranks

pytestmark = pytest.mark.system

GATHERS = 240  # samples after 0, 60 (the warm-up), ..., 240 calls
STEPS = 90  # samples after 0, 30 (the warm-up), 60, 90 steps
RSS_BOUND_MIB = 32.0


def assert_flat(samples: list[dict[str, int]], what: str) -> None:
    """From the second sample (after warm-up) on: no more tensors than then, RSS growth under the bound."""
    warm, last = samples[1], samples[-1]
    counts = [s["tensors"] for s in samples[1:]]
    assert max(counts) <= warm["tensors"], f"{what}: live tensors grew after warm-up: {samples}"
    growth = (last["rss_kib"] - warm["rss_kib"]) / 1024
    assert growth < RSS_BOUND_MIB, f"{what}: RSS grew by {growth:.1f} MiB after warm-up: {samples}"


def _no_growth(rank: int, world_size: int) -> None:
    for mode in ("local", "global"):
        with tg.patched(mode):
            probe = gather_all_tensors(soak_gather_input(rank, 2))  # the mode is in force: other entries' graphs
            assert probe[1 - rank].requires_grad == (mode == "global"), mode
            del probe
            gathers = run_phase(lambda i: gather_all_tensors(soak_gather_input(rank, i)), GATHERS, 4, settled_sample)
            assert_flat(gathers, f"{mode} mode, gathers")

            losses = LossSteps(rank)
            first = [p.detach().clone() for p in losses.model.parameters()]
            steps = run_phase(losses.step, STEPS, 3, settled_sample)
            assert_flat(steps, f"{mode} mode, Metric-loss steps")
            # the steps trained the model: the synced loss's backward reached its parameters
            assert all(not torch.equal(a, p) for a, p in zip(first, losses.model.parameters(), strict=True)), mode


def test_no_growth_over_gathers_and_loss_steps() -> None:
    run_ranks(_no_growth, 2, timeout=180)
