"""The soak's workload and its sampling: what ``bench_soak.py`` runs at length and ``tests/test_leak.py`` briefly.

Imports only torch, torchmetrics and the installed package (and nothing of ``benchmarks/`` or ``tests/``), so the
tests can import it as ``benchmarks.soak_workload`` and the benchmarks as ``soak_workload``.

Why the readings wait ("settle"): gloo runs every collective on a worker thread, and a finished ``all_gather``'s
work object holds the tensors it was given (the padded input and every receive buffer). The caller wakes up as soon
as the work is marked done; the worker thread drops its reference a moment later, and a collective issued in that
moment can keep the work alive until its own work goes. So for a short time after any gather, with or without the
patch, the process still holds the gather's buffers, and RSS or a tensor count taken then can include them. Without
a further collective the worker lets go within milliseconds (longer on a loaded machine): :func:`settled_rss_kib`
waits until RSS stops changing.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable

import torch
from torchmetrics import MeanSquaredError

from torchmetrics_gradpatch.cli.checks import CatMeanSquaredError  # check's own cat-state MSE


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
        self.cat = CatMeanSquaredError(dist_sync_on_step=True)
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
        return float(loss.detach())


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


def rss_kib(field: str = "VmRSS") -> int:
    """``field`` of ``/proc/self/status`` in KiB (``VmRSS``: resident now; ``VmHWM``: the high-water mark)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def settled_rss_kib(poll: float = 0.01, stable: int = 8, limit: float = 3.0) -> tuple[int, float]:
    """RSS once it has not changed for ``stable`` polls ``poll`` seconds apart (at most ``limit`` s); and the wait.

    No collective is issued, so gloo's worker threads can drop the finished works (see the module docstring).
    """
    start = time.monotonic()
    last, same = rss_kib(), 0
    while same < stable and time.monotonic() - start < limit:
        time.sleep(poll)
        now = rss_kib()
        same = same + 1 if now == last else 0
        last = now
    return last, time.monotonic() - start


def settled_sample(done: int) -> dict[str, int]:
    """After ``done`` calls: RSS once settled, then the number of ``torch.Tensor`` objects gc tracks."""
    gc.collect()
    rss, _ = settled_rss_kib()
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))
    return {"done": done, "rss_kib": rss, "tensors": tensors}
