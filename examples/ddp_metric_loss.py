"""Train a small model under DDP whose loss is a torchmetrics Metric with ``dist_sync_on_step=True``.

    torchrun --standalone --nproc-per-node 2 examples/ddp_metric_loss.py
    torchrun --standalone --nproc-per-node 2 examples/ddp_metric_loss.py --mode global

Each rank has its own batch (of a different size on every rank), the loss is the *global* mean squared error
over all ranks' samples (``MeanSquaredError(dist_sync_on_step=True)`` syncs its states through torchmetrics'
gather), and DDP averages the gradients. At every step the script also computes, in one process and without any
gather, the gradient of the same global loss over the same samples, and checks:

* the DDP gradient equals ``1/world_size`` x that single-process gradient: each rank backpropagates through its
  own samples only (its own entry of the gathered states), the ranks' gradients add up to the single-process
  gradient, and DDP divides their sum by the world size;
  With ``--mode global`` (``torchmetrics_gradpatch.patch(mode="global")``) every rank's copy of the loss sends
  gradient back to every rank's samples, and the DDP gradient equals the single-process gradient itself (scale 1);
* the loss goes down (the mean over the last 5 steps is below half the mean over the first 5).

It prints both and exits non-zero if either fails. On torchmetrics < 1.6 without the patch
(``TORCHMETRICS_GRADPATCH_AUTOPATCH=0``) the first backward fails: the synced loss has no autograd graph.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys

import torchmetrics_gradpatch  # first thing in the program: the patch is in force from here on

# isort: split
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import MeanSquaredError

STEPS = 25
FEATURES = 4
DTYPE = torch.float64  # so "equal" can mean equal up to rounding (1e-12), not up to float32 noise


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: 6 + 2*rank samples of a noisy linear target (any rank can rebuild it)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6 + 2 * rank, FEATURES, generator=generator, dtype=DTYPE)
    true_weights = torch.arange(1.0, FEATURES + 1, dtype=DTYPE)
    y = x @ true_weights + 0.1 * torch.randn(x.shape[0], generator=generator, dtype=DTYPE)
    return x, y


def single_process_gradient(model: torch.nn.Module, step: int, world_size: int) -> list[torch.Tensor]:
    """Gradient of the global loss (mean squared error over every rank's samples), in this process alone."""
    reference = copy.deepcopy(model)
    reference.zero_grad()
    xs, ys = zip(*(batch(step, rank) for rank in range(world_size)), strict=True)
    loss = torch.mean((reference(torch.cat(xs)).squeeze(-1) - torch.cat(ys)) ** 2)
    loss.backward()
    return [p.grad.detach().clone() for p in reference.parameters() if p.grad is not None]


def main(mode: str) -> int:
    if mode == "global":
        torchmetrics_gradpatch.patch(mode="global")  # scale 1 instead of 1/world_size
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *args, **kwargs: None)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 8, dtype=DTYPE), torch.nn.Tanh(), torch.nn.Linear(8, 1, dtype=DTYPE)
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loss_fn = MeanSquaredError(dist_sync_on_step=True).set_dtype(DTYPE)

    scale = 1.0 if mode == "global" else 1.0 / world_size
    status = torchmetrics_gradpatch.status()
    gather = "patched" if status.applied_to else "native" if status.native else "NOT patched"
    versions = f"torch {torch.__version__}, torchmetrics {status.torchmetrics_version}"
    say(f"world size {world_size}, {versions}, gather {gather}, {mode} mode")
    relation = "1, global mode" if mode == "global" else "1/world_size, local mode"
    say(f"checking: DDP gradient == {scale:g} x single-process gradient of the global loss ({relation})")

    losses: list[float] = []
    worst = 0.0
    for step in range(STEPS):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        loss = loss_fn(ddp(x).squeeze(-1), y)  # the global MSE over every rank's samples
        if loss.grad_fn is None:
            print(
                f"rank {rank}: the synced loss has no autograd graph: torchmetrics' gather dropped it. "
                "Import torchmetrics_gradpatch (without TORCHMETRICS_GRADPATCH_AUTOPATCH=0) first.",
                file=sys.stderr,
            )
            return 1
        expected = single_process_gradient(model, step, world_size)  # before the optimizer changes the model
        loss.backward()  # DDP all-reduces (averages) the gradients during this call
        loss_fn.reset()
        got = [p.grad for p in model.parameters() if p.grad is not None]
        error = max(float((g - scale * e).abs().max()) for g, e in zip(got, expected, strict=True))
        worst = max(worst, error)
        losses.append(loss.item())
        if step % 5 == 0 or step == STEPS - 1:
            say(f"step {step:2d}  loss {losses[-1]:8.4f}  max |DDP grad - {scale:g} x single-process grad| {error:.1e}")
        optimizer.step()

    gradients_ok = worst < 1e-10
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5  # batches differ per step: compare averages
    loss_ok = last < 0.5 * first
    say(
        f"gradient: {'OK' if gradients_ok else 'MISMATCH'} (worst difference {worst:.1e} over {STEPS} steps)\n"
        f"loss:     {'OK' if loss_ok else 'DID NOT GO DOWN'} (mean of the first 5 steps {first:.4f}, "
        f"of the last 5 {last:.4f})"
    )
    # Let DDP and the last graph (and the gloo work they hold) go before the group does: torch 2.15 was seen to
    # abort at exit ("terminate called without an active exception") when they outlived it.
    del ddp, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if gradients_ok and loss_ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("local", "global"), default="local", help="gradient mode (default local)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit(f"run me with torchrun: torchrun --standalone --nproc-per-node 2 {sys.argv[0]}")
    sys.exit(main(args.mode))
