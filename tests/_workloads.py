"""Two small MSE metrics several tests share: sum states, and the ``cat``-state one that ``check`` runs itself.

The classification collections live in ``benchmarks/workloads.py`` and the soak's workload in
``benchmarks/soak_workload.py``; the tests import them from there, so they run exactly what the benchmarks time.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric

from torchmetrics_gradpatch.cli.checks import CatMeanSquaredError as CatSquaredError  # check's own cat-state MSE

__all__ = ["CatSquaredError", "SumSquaredError"]


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
