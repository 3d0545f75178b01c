"""The collections the benchmarks time: the classification collections the collection benchmark times and the
fused-collection tests check, and the regression collection of the step benchmarks.

Imports only torch and torchmetrics, so ``benchmarks/bench_collection.py`` stands alone and ``tests/`` imports the
very workload it measures from here.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["classification_collection", "scale_batches", "scale_collection", "step_collection"]


def step_collection(**kwargs: Any) -> Any:
    """The step benchmarks' collection: ``MeanSquaredError``, ``MeanAbsoluteError``, ``ExplainedVariance``,
    ``R2Score``, ``PearsonCorrCoef`` and ``SpearmanCorrCoef``, each ``dist_sync_on_step=True`` and ``kwargs``."""
    from torchmetrics import MetricCollection
    from torchmetrics import regression as tr

    kinds = (
        tr.MeanSquaredError,
        tr.MeanAbsoluteError,
        tr.ExplainedVariance,
        tr.R2Score,
        tr.PearsonCorrCoef,
        tr.SpearmanCorrCoef,
    )
    return MetricCollection([kind(dist_sync_on_step=True, **kwargs) for kind in kinds])


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


def scale_collection(num_classes: int = 1000) -> Any:
    """A confusion matrix (``[C, C]`` int64, 8 MB at 1,000 classes) and macro accuracy and F1, which share four
    ``[C]`` stat-score states (a compute group): the states a sync can reduce instead of gathering."""
    from torchmetrics import MetricCollection
    from torchmetrics import classification as tc

    c = num_classes
    return MetricCollection(
        {
            "confmat": tc.MulticlassConfusionMatrix(num_classes=c),
            "acc": tc.MulticlassAccuracy(num_classes=c, average="macro"),
            "f1": tc.MulticlassF1Score(num_classes=c, average="macro"),
        }
    )


def scale_batches(rank: int, num_classes: int = 1000, count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s uneven batches of class indices: ``500 + 100 * rank + 50 * k`` samples in batch ``k``."""
    generator = torch.Generator().manual_seed(4242 + rank)
    out = []
    for k in range(count):
        n = 500 + 100 * rank + 50 * k
        preds = torch.randint(0, num_classes, (n,), generator=generator)
        out.append((preds, torch.randint(0, num_classes, (n,), generator=generator)))
    return out
