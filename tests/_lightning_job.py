"""A Lightning training program whose loss is torchmetrics Metrics with ``dist_sync_on_step=True``.

Run by ``tests/test_lightning.py`` as ``python -m tests._lightning_job OUT_DIR`` from the repository root. It trains
a LightningModule with ``Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn")`` for two steps and saves, on
every rank, the parameter gradients seen after the first backward (after DDP has averaged them) to
``OUT_DIR/rank<r>.pt``; the test compares them with a single-process reference.

The module has two independent linear heads on the same inputs, so one run covers both kinds of metric state:
``head_sum``'s loss is ``MeanSquaredError`` (sum states), ``head_cat``'s a mean squared error kept in list (``cat``)
states, and each rank has a different batch size. Each head's gradient depends on its own loss only.

The gradient mode comes from ``TORCHMETRICS_GRADPATCH_MODE`` (``local`` when unset), which the spawned workers
inherit and read when they import the package.
"""

from __future__ import annotations

import torchmetrics_gradpatch  # first thing in the program, as a user would write it

# isort: split
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from torchmetrics import MeanSquaredError

from torchmetrics_gradpatch.cli.checks import CatMeanSquaredError  # the self-check's list-state loss

WORLD_SIZE = 2
BATCH_SIZES = (3, 5)  # rank r's batch size
FEATURES = 3
DTYPE = torch.float64


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch (any process can rebuild every rank's)."""
    generator = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(BATCH_SIZES[rank], FEATURES, generator=generator, dtype=DTYPE)
    return x, torch.randn(BATCH_SIZES[rank], generator=generator, dtype=DTYPE)


def heads() -> dict[str, torch.nn.Linear]:
    """The two heads with fixed initial weights (the reference builds the same ones)."""
    generator = torch.Generator().manual_seed(11)
    made = {}
    for name in ("head_sum", "head_cat"):
        layer = torch.nn.Linear(FEATURES, 1, dtype=DTYPE)
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=DTYPE))
        made[name] = layer
    return made


class TwoHeads(pl.LightningModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        made = heads()
        self.head_sum, self.head_cat = made["head_sum"], made["head_cat"]
        self.loss_sum = MeanSquaredError(dist_sync_on_step=True).set_dtype(DTYPE)
        self.loss_cat = CatMeanSquaredError(dist_sync_on_step=True).set_dtype(DTYPE)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader([batch(self.global_rank)] * 2, batch_size=None)  # this rank's own batch, twice

    def training_step(self, data: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = data
        return self.loss_sum(self.head_sum(x).squeeze(-1), y) + self.loss_cat(self.head_cat(x).squeeze(-1), y)

    def on_after_backward(self) -> None:
        if self.global_step == 0:  # gradients of the first step, already averaged by DDP
            grads = {name: p.grad.detach().clone() for name, p in self.named_parameters() if p.grad is not None}
            status = torchmetrics_gradpatch.status()
            torch.save(
                {"grads": grads, "graph_preserving": status.graph_preserving, "mode": status.mode},
                Path(self.out_dir) / f"rank{self.global_rank}.pt",
            )
        self.loss_sum.reset()
        self.loss_cat.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out_dir: str) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy="ddp_spawn",
        max_steps=2,
        use_distributed_sampler=False,  # each rank feeds its own batch
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(TwoHeads(out_dir))


if __name__ == "__main__":
    main(sys.argv[1])
