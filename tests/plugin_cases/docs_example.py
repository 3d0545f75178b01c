import pytest
import torch
import torch.distributed as dist
from torchmetrics import Metric

import torchmetrics_gradpatch  # noqa: F401  (the training code imports it)


class MeanSquaredError(Metric):  # the user's own metric
    full_state_update = False

    def __init__(self) -> None:
        super().__init__(dist_sync_on_step=True)
        self.add_state("sse", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.sse, self.n = self.sse + ((preds - target) ** 2).sum(), self.n + preds.numel()

    def compute(self) -> torch.Tensor:
        return self.sse / self.n


@pytest.mark.ranks(2)
def test_syncs_and_backpropagates() -> None:
    data = torch.arange(6.0, dtype=torch.float64)  # all samples; rank r owns rows 3r..3r+2, targets are 0
    mine = slice(3 * dist.get_rank(), 3 * dist.get_rank() + 3)
    preds = data[mine].clone().requires_grad_()
    loss = MeanSquaredError()(preds, torch.zeros(3))  # synced: the loss over both ranks' samples
    loss.backward()
    reference = data.clone().requires_grad_()  # the same loss in one process
    (reference**2).mean().backward()
    torch.testing.assert_close(loss, (data**2).mean())
    torch.testing.assert_close(preds.grad, reference.grad[mine])
