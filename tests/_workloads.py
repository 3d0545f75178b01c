"""Workloads the tests check and the benchmarks time: two small MSE metrics (the cat-state one is ``check``'s
own), and the soak's gathers and Metric-loss steps. (The classification collections live in
``benchmarks/workloads.py``, which the collection tests import.)

Shared by ``tests/`` and ``benchmarks/`` and importing neither (only torch, torchmetrics and the package), so the
short soak in ``tests/test_leak.py`` runs exactly what ``benchmarks/bench_soak.py`` measures, and neither tree
imports the other.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import MeanSquaredError, Metric

from torchmetrics_gradpatch.cli.checks import CatMeanSquaredError as CatSquaredError  # check's own cat-state MSE


class SumSquaredError(Metric):
    """MSE with sum states (``dist_reduce_fx="sum"``)."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("sse", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.sse = self.sse + ((preds - target) ** 2).sum()
        self.n = self.n + preds.numel()

    def compute(self) -> torch.Tensor:
        return self.sse / self.n


# --- the soak ----------------------------------------------------------------------------------------------------


def soak_gather_input(rank: int, call: int) -> torch.Tensor:
    """The tensor of gather ``call`` on ``rank``: a scalar, an even or an uneven shape, in turn."""
    kind = call % 3
    if kind == 0:
        shape: tuple[int, ...] = ()
    elif kind == 1:
        shape = (64, 64)
    else:
        shape = (200 + 37 * rank + 11 * (call % 5), 64)
    return torch.randn(shape, requires_grad=True)


class LossSteps:
    """A linear model trained with two synced metrics as its loss: sum states (scalar gathers) and a cat state
    whose per-rank batch sizes differ (uneven gathers); each step backpropagates, steps SGD, resets both."""

    def __init__(self, rank: int) -> None:
        torch.manual_seed(1234 + rank)
        self.rank = rank
        self.model = torch.nn.Linear(16, 1)
        self.mse = MeanSquaredError(dist_sync_on_step=True)
        self.cat = CatSquaredError(dist_sync_on_step=True)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self, step: int) -> float:
        features = torch.randn(8 + 3 * self.rank + step % 4, 16)
        target = torch.randn(features.shape[0])
        preds = self.model(features).squeeze(-1)
        loss = self.mse(preds, target) + self.cat(preds, target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.mse.reset()
        self.cat.reset()
        return float(loss)


def run_phase(
    operation: Callable[[int], object], count: int, samples: int, sample: Callable[[int], dict[str, int]]
) -> list[dict[str, int]]:
    """Call ``operation(i)`` for i in range(count); ``sample(done)`` first and after every count // samples calls."""
    every = max(1, count // samples)
    out = [sample(0)]
    for i in range(count):
        operation(i)
        if (i + 1) % every == 0 or i + 1 == count:
            out.append(sample(i + 1))
    return out


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def settled_sample(done: int) -> dict[str, int]:
    """RSS once it has stopped changing, then the live ``torch.Tensor`` objects, after ``done`` calls.

    The wait matters for the count too: gloo's worker thread drops the tensors of the last finished collective
    a moment after the caller wakes up (benchmarks/_memory.py says why), so a count taken at once can be a few
    tensors high. RSS is polled every 10 ms until 8 readings agree (3 s at most), with no collective issued.
    """
    gc.collect()
    start, last, same = time.monotonic(), _rss_kib(), 0
    while same < 8 and time.monotonic() - start < 3.0:
        time.sleep(0.01)
        now = _rss_kib()
        same = same + 1 if now == last else 0
        last = now
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))
    return {"done": done, "rss_kib": last, "tensors": tensors}
