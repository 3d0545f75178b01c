"""The self-checks behind ``check``: what each rank runs, and the single-process reference it must match.

Each check runs one path into torchmetrics' gather on every rank and backpropagates; the reference is the gradient
of the same global loss, computed in one process, with respect to the rank's own tensors with the other ranks' held
constant (torchmetrics 1.6 semantics), times the world size in global mode. ``gather_equal`` / ``gather_uneven``
call ``gather_all_tensors`` on one shape and on a different number of rows per rank (the loss weighs each entry by
its index, so one put back at the wrong index fails); ``metric_sum`` and ``metric_cat`` use ``MeanSquaredError``
(sum states) and :class:`CatMeanSquaredError` (a ``cat`` list state) with ``dist_sync_on_step=True`` as the loss
of a linear model, with a different batch size on each rank. This module imports torch and torchmetrics.
"""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torchmetrics import MeanSquaredError, Metric
from torchmetrics.utilities import distributed
from torchmetrics.utilities.data import dim_zero_cat

from torchmetrics_gradpatch._api import compile_support
from torchmetrics_gradpatch._blocks import patched
from torchmetrics_gradpatch._status import status

CHECKS = {
    "gather_equal": "gather, equal shapes",
    "gather_uneven": "gather, uneven shapes",
    "metric_sum": "Metric loss, sum state (MeanSquaredError)",
    "metric_cat": "Metric loss, cat state, uneven batches",
}
_DTYPE = torch.float64  # so the gradients can be compared to rounding, not to float32 noise


class Outcome(NamedTuple):
    """What one rank saw for one check: its gradients, or the error it hit, and the seconds it took."""

    grads: list[torch.Tensor] | None
    error: str | None
    seconds: float


class CatMeanSquaredError(Metric):
    """Mean squared error kept as a ``cat`` list state, so every rank's errors travel through the gather."""

    is_differentiable = True
    higher_is_better = False
    full_state_update = False
    errors: list[torch.Tensor]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("errors", default=[], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.errors.append((preds - target) ** 2)

    def compute(self) -> torch.Tensor:
        return dim_zero_cat(self.errors).mean()


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=_DTYPE)


def _inputs(name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``x`` and ``y``: a different number of rows on every rank, except for ``gather_equal``."""
    rows = {"gather_equal": 2, "gather_uneven": 2 * rank + 1, "metric_sum": 4 + rank, "metric_cat": 3 + 2 * rank}
    return _randn(100 + rank, rows[name], 3), _randn(200 + rank, rows[name])


def _model() -> torch.nn.Linear:
    model = torch.nn.Linear(3, 1, dtype=_DTYPE)
    with torch.no_grad():
        model.weight.copy_(_randn(7, 1, 3))
        model.bias.copy_(_randn(8, 1))
    return model


def _gather_loss(entries: list[torch.Tensor]) -> torch.Tensor:
    weighted = sum((index + 1) * (entry**2).sum() for index, entry in enumerate(entries))
    return weighted + torch.cat([entry.reshape(-1) for entry in entries]).sum() ** 2


def _grads(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [leaf.grad for leaf in leaves if leaf.grad is not None]


def _step(name: str, rank: int, backend: str | None) -> list[torch.Tensor]:
    """One check on this rank: the gradients of its own leaves (its gathered tensor, or the model's parameters)."""
    x, y = _inputs(name, rank)
    if name.startswith("gather"):
        leaves = [x.requires_grad_(True)]

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return _gather_loss(distributed.gather_all_tensors(x))

    else:
        model = _model()
        metric = (MeanSquaredError if name == "metric_sum" else CatMeanSquaredError)(dist_sync_on_step=True)
        metric.set_dtype(_DTYPE)
        leaves = list(model.parameters())

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return metric(model(x).squeeze(-1), y)  # type: ignore[no-any-return]

    if backend is not None:
        from torch import _dynamo

        _dynamo.reset()  # each check compiles its own step, never a cache entry of another check
        step = torch.compile(step, backend=backend)  # fullgraph=False: the sync is a graph break
    torch.autograd.backward(step(x, y))
    return _grads(leaves)


def rank_main(
    mode: str | None, sync: str | None, backend: str | None, with_compile_support: bool
) -> tuple[dict[str, Any], dict[str, Outcome]]:
    """Every check on this rank; this process's ``status()`` and one :class:`Outcome` per check.

    The checks run inside ``patched(mode=mode, sync=sync)``, or as the import set them up when both are ``None``;
    ``backend`` runs each step inside ``torch.compile``. :func:`~torchmetrics_gradpatch.compile_support` is called
    only when ``with_compile_support`` asks (the command does, in a second run, to say whether a program needs it).
    """
    if with_compile_support:
        compile_support()
    # torchmetrics < 1.6 on torch >= 2.8 warns at every uneven gather of its own: noise that would bury the table
    warnings.filterwarnings("ignore", message="Using a non-tuple sequence", category=UserWarning)
    outcomes = {}
    with patched(mode=mode, sync=sync) if mode or sync else contextlib.nullcontext():
        for name in CHECKS:
            dist.barrier()  # start each check together, so its time is its own and not a neighbour's lag
            start = time.perf_counter()
            try:
                # a check that failed inside torch.compile can leave grad mode off: each one starts with it on
                with torch.enable_grad():
                    grads, error = _step(name, dist.get_rank(), backend), None
            except Exception as err:  # reported per check: a failing check must not hide the others
                grads, error = None, "".join(traceback.format_exception_only(type(err), err)).strip()
            outcomes[name] = Outcome(grads, error, time.perf_counter() - start)
        return status().as_dict(), outcomes


def reference(name: str, rank: int, world_size: int, mode: str = "local") -> list[torch.Tensor]:
    """The gradient ``rank`` must receive: the global loss's, in one process, with the other ranks' held fixed."""
    inputs = [_inputs(name, q) for q in range(world_size)]
    if name.startswith("gather"):
        entries = [x.requires_grad_(q == rank) for q, (x, _) in enumerate(inputs)]
        leaves, loss = [entries[rank]], _gather_loss(entries)
    else:
        model = _model()
        preds = [model(x).squeeze(-1) for x, _ in inputs]
        preds = [pred if q == rank else pred.detach() for q, pred in enumerate(preds)]
        leaves, loss = list(model.parameters()), torch.mean((torch.cat(preds) - torch.cat([y for _, y in inputs])) ** 2)
    torch.autograd.backward(loss)
    return [grad * (world_size if mode == "global" else 1) for grad in _grads(leaves)]


def matches(got: list[torch.Tensor] | None, want: list[torch.Tensor]) -> bool:
    """Whether a rank's gradients equal the reference (float64: rounding differences only)."""
    if got is None or len(got) != len(want):
        return False
    return all(g.shape == w.shape and g.allclose(w, rtol=1e-9, atol=1e-12) for g, w in zip(got, want, strict=True))


def failure(name: str, results: list[tuple[dict[str, Any], dict[str, Outcome]]]) -> str | None:
    """Why check ``name`` failed on the ranks (each one's ``rank_main`` result, in rank order), or ``None``."""
    for rank, (state, outcomes) in enumerate(results):
        grads, error, _ = outcomes[name]
        if error is not None:
            return f"rank {rank}: {error.splitlines()[-1]}"
        if not matches(grads, reference(name, rank, len(results), state["mode"])):
            return f"rank {rank}: gradient differs from the single-process reference"
    return None
