"""A Lightning validation program that logs a ``MetricCollection`` both ways Lightning documents.

Run by ``tests/test_lightning.py`` as ``python -m tests._lightning_collection_job OUT_DIR`` with
``TORCHMETRICS_GRADPATCH_SYNC=fused`` in the environment. It validates with
``Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn")`` for one epoch; each rank feeds its own uneven
batches of a small multiclass problem into three copies of the same collection (accuracy, precision, recall and
F1, one compute group of four stat-score states, and AUROC with ``cat`` list states):

* ``val_metrics``: ``self.log_dict(self.val_metrics.compute())`` in ``on_validation_epoch_end``, then ``reset()``:
  the one exchange for the whole collection;
* ``each_metrics``: ``self.log_dict(self.each_metrics)`` in ``validation_step``: Lightning calls each member's
  ``compute()`` on its own at the epoch's end, and each member syncs separately;
* ``own_metrics``: computed in ``on_validation_epoch_end`` inside ``patched(sync="torchmetrics")``: torchmetrics'
  own sync of the same collection, for its count of collectives.

``val_metrics`` is also computed a second time from the same local states under torchmetrics' own sync (its
members' cached results cleared), the reference its one exchange must match bit for bit.

Collectives are counted with the default process group's sequence number around each ``compute()`` (for
``each_metrics``, around every member's ``compute()`` that Lightning calls). Every rank saves to
``OUT_DIR/rank<r>.pt`` the values ``compute()`` returned, what Lightning logged (``trainer.callback_metrics``), the
counts, and the sync strategy in force.
"""

from __future__ import annotations

import torchmetrics_gradpatch  # first thing in the program, as a user would write it

# isort: split
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torchmetrics import Metric, MetricCollection
from torchmetrics import classification as tc

WORLD_SIZE = 2
CLASSES = 4
BATCH_SIZES = ((3, 4), (5, 2))  # rank r's batches: uneven within a rank and across ranks
PREFIXES = {"val_metrics": "val_", "each_metrics": "each_", "own_metrics": "own_"}


def members() -> dict[str, Metric]:
    """The collection's members, fresh (the reference computes each one alone in one process)."""
    return {
        "acc": tc.MulticlassAccuracy(num_classes=CLASSES),
        "prec": tc.MulticlassPrecision(num_classes=CLASSES),
        "rec": tc.MulticlassRecall(num_classes=CLASSES),
        "f1": tc.MulticlassF1Score(num_classes=CLASSES),
        "auroc": tc.MulticlassAUROC(num_classes=CLASSES, thresholds=None),
    }


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches of (class probabilities, targets); any process can rebuild every rank's."""
    generator = torch.Generator().manual_seed(700 + rank)
    return [
        (torch.randn(n, CLASSES, generator=generator).softmax(-1), torch.randint(0, CLASSES, (n,), generator=generator))
        for n in BATCH_SIZES[rank]
    ]


def calls() -> int:
    """The number of collectives the default process group has issued so far."""
    return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())


class Validate(pl.LightningModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.val_metrics = MetricCollection(members(), prefix=PREFIXES["val_metrics"])
        self.each_metrics = MetricCollection(members(), prefix=PREFIXES["each_metrics"])
        self.own_metrics = MetricCollection(members(), prefix=PREFIXES["own_metrics"])
        self.member_calls: dict[str, list[int]] = {}
        self.saved: dict[str, Any] = {}

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(batches(self.global_rank), batch_size=None)  # this rank's own batches

    def _counted(self, key: str, compute: Callable[[], Any]) -> Callable[[], Any]:
        @functools.wraps(compute)
        def counted() -> Any:
            before = calls()
            try:
                return compute()
            finally:
                self.member_calls.setdefault(key, []).append(calls() - before)

        return counted

    def on_validation_start(self) -> None:
        # in the worker: a Metric's pickled copy drops the instance attribute ``compute`` and wraps its own again
        for key, metric in self.each_metrics.items(keep_base=True, copy_state=False):
            metric.compute = self._counted(str(key), metric.compute)

    def validation_step(self, data: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        preds, target = data
        for metrics in (self.val_metrics, self.each_metrics, self.own_metrics):
            metrics.update(preds, target)
        self.log_dict(self.each_metrics, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        status = torchmetrics_gradpatch.status()
        before = calls()
        values = self.val_metrics.compute()
        collection_calls = calls() - before
        # the same local states synced by torchmetrics' own sync: what the one exchange must give, bit for bit
        for metric in self.val_metrics.values(copy_state=False):
            metric._computed = None
        with torchmetrics_gradpatch.patched(sync="torchmetrics"):
            reference = {key.replace("val_", "ref_", 1): value for key, value in self.val_metrics.compute().items()}
        self.log_dict(values)
        self.val_metrics.reset()
        with torchmetrics_gradpatch.patched(sync="torchmetrics"):
            before = calls()
            own = self.own_metrics.compute()
            own_calls = calls() - before
        self.own_metrics.reset()
        self.saved = {
            "sync": status.sync,
            "sync_chosen_by": status.sync_chosen_by,
            "computed": {**values, **reference, **own},
            "collection_calls": collection_calls,
            "own_calls": own_calls,
        }

    def on_validation_end(self) -> None:
        logged = {key: value.detach().clone() for key, value in self.trainer.callback_metrics.items()}
        saved = {**self.saved, "logged": logged, "member_calls": self.member_calls}
        torch.save(saved, Path(self.out_dir) / f"rank{self.global_rank}.pt")


def main(out_dir: str) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy="ddp_spawn",
        use_distributed_sampler=False,  # each rank feeds its own batches
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(Validate(out_dir), verbose=False)


if __name__ == "__main__":
    main(sys.argv[1])
