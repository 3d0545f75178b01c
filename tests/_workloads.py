"""Workloads several tests share: two small MSE metrics (the cat-state one is ``check``'s own) and the ten-member
classification collection. The soak's workload lives in ``benchmarks/soak_workload.py``, which the leak test
imports, so it runs exactly what ``benchmarks/bench_soak.py`` measures."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric


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


def classification_collection(num_classes: int) -> Any:
    """Ten members: five share the ``[num_classes]`` stat-score states, two a confusion matrix, two the ``cat``
    lists of scores and targets; the calibration error has ``cat`` lists of its own."""
    from torchmetrics import MetricCollection
    from torchmetrics import classification as tc

    c = num_classes
    return MetricCollection(
        {
            "acc": tc.MulticlassAccuracy(num_classes=c, average="macro"),
            "prec": tc.MulticlassPrecision(num_classes=c, average="macro"),
            "rec": tc.MulticlassRecall(num_classes=c, average="macro"),
            "f1": tc.MulticlassF1Score(num_classes=c, average="macro"),
            "spec": tc.MulticlassSpecificity(num_classes=c, average="macro"),
            "confmat": tc.MulticlassConfusionMatrix(num_classes=c),
            "kappa": tc.MulticlassCohenKappa(num_classes=c),
            "auroc": tc.MulticlassAUROC(num_classes=c, thresholds=None),
            "ap": tc.MulticlassAveragePrecision(num_classes=c, thresholds=None),
            "ece": tc.MulticlassCalibrationError(num_classes=c),
        }
    )
