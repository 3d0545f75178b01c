"""What several test modules share: two small float64 MSE metrics, a collective recorder, and the error a call
raises with the patch off and on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

#: The collectives :func:`record_collectives` watches (those missing from a torch version are skipped).
COLLECTIVES = ("barrier", "all_gather", "all_to_all_single", "all_to_all", "all_reduce", "reduce_scatter", "broadcast")


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


class CatSquaredError(Metric):
    """MSE with a list state (``dist_reduce_fx="cat"``): per-rank lengths differ, so the uneven path runs."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("errors", default=[], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.errors.append((preds - target) ** 2)

    def compute(self) -> torch.Tensor:
        return dim_zero_cat(self.errors).mean()


@contextmanager
def record_collectives() -> Iterator[list[str]]:
    """Record, in order, every collective the code inside issues: its name, and for ``all_gather`` the shapes."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def recorder(name: str) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            shapes = [tuple(t.shape) for t in args[0]] if name == "all_gather" else None
            calls.append(name if shapes is None else f"{name}{shapes}")
            return originals[name](*args, **kwargs)

        return record

    for name in originals:
        setattr(dist, name, recorder(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def synced_state_loss(case: str, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Update a metric with grad on, sync it by ``case`` and return the loss read from its synced states.

    ``case`` ends in ``sum`` or ``cat`` (the metric) and starts with ``sync_dist_default`` (``_sync_dist()`` with
    the default argument bound when ``Metric`` was created) or ``sync`` (``Metric.sync()``, which looks the gather
    up in ``torchmetrics.metric``'s namespace).
    """
    metric: Metric = SumSquaredError() if case.endswith("sum") else CatSquaredError()
    metric._enable_grad = True  # what forward does, so update() records a graph
    metric.update(preds, target)
    if case.startswith("sync_dist_default"):
        metric._sync_dist()
    else:
        metric.sync()
    if isinstance(metric, SumSquaredError):
        return metric.sse / metric.n
    errors = metric.errors
    return (errors if isinstance(errors, torch.Tensor) else dim_zero_cat(errors)).mean()


def errors_off_and_on(call: Callable[[], object]) -> list[tuple[type[BaseException] | None, str]]:
    """The error ``call()`` raises with the patch off, then on (``(None, "no error")`` if it returns).

    Used to show bad input fails exactly as with unpatched torchmetrics. The patch state is restored after.
    """
    import torchmetrics_gradpatch as tmgp

    was_patched = tmgp.is_patched()
    found: list[tuple[type[BaseException] | None, str]] = []
    try:
        for on in (False, True):
            tmgp.patch() if on else tmgp.unpatch()
            try:
                call()
            except Exception as err:
                found.append((type(err), str(err)))
            else:
                found.append((None, "no error"))
    finally:
        tmgp.patch() if was_patched else tmgp.unpatch()
    return found
