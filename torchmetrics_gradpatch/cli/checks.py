"""The self-checks behind ``torchmetrics-gradpatch check``: what each rank runs, and the reference it must match.

Each check builds deterministic inputs (the same on every process, so the parent can rebuild them), runs one
path into torchmetrics' gather on every rank and backpropagates. The parent then recomputes, in one process and
without any gather, the gradient each rank must receive: the gradient of the *same global loss* with respect to
that rank's own tensors, the other ranks' contributions held constant (torchmetrics 1.6.0 semantics: each rank
backpropagates through its own entry of the gathered list only), times the world size in global mode (every
rank's copy of the loss sends gradient back to it).

* ``gather_equal`` / ``gather_uneven``: ``torchmetrics.utilities.distributed.gather_all_tensors`` called
  directly, on tensors of one shape and on tensors with a different number of rows per rank. The loss weighs
  each gathered entry by its index, so an entry put back at the wrong index fails the check.
* ``metric_sum``: ``torchmetrics.MeanSquaredError(dist_sync_on_step=True)`` (sum states) used as the loss of a
  linear model, with a different batch size on each rank.
* ``metric_cat``: a list-state (``dist_reduce_fx="cat"``) mean squared error used the same way.

Everything here imports torch and torchmetrics: it is loaded by the ``check`` command and by the spawned ranks
only (rank functions must live in an importable module for the ``spawn`` start method).
"""

from __future__ import annotations

import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torchmetrics import MeanSquaredError, Metric
from torchmetrics.utilities.data import dim_zero_cat

CHECKS: dict[str, str] = {
    "gather_equal": "gather, equal shapes",
    "gather_uneven": "gather, uneven shapes",
    "metric_sum": "Metric loss, sum state (MeanSquaredError)",
    "metric_cat": "Metric loss, cat state, uneven batches",
}

_DTYPE = torch.float64
_FEATURES = 3


@dataclass
class Outcome:
    """What one rank saw for one check: its gradients (or the error it hit) and how long the check took."""

    grads: list[torch.Tensor] | None
    error: str | None
    seconds: float


class CatMeanSquaredError(Metric):
    """Mean squared error kept as a list (``cat``) state, so every rank's errors travel through the gather.

    Per-rank batch sizes may differ, so the uneven path runs. The tests use this very class (the one home of the
    cat-state metric that ``check`` and the test suite share).
    """

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


# --- deterministic inputs, identical in the parent and in every rank ----------------------------------------


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gather_input(name: str, rank: int) -> torch.Tensor:
    rows = 2 if name == "gather_equal" else 2 * rank + 1
    return torch.randn(rows, _FEATURES, generator=_generator(100 + rank), dtype=_DTYPE)


def _gather_loss(entries: list[torch.Tensor]) -> torch.Tensor:
    """A loss that depends on every entry and on its index (an entry at the wrong index changes it)."""
    weighted = sum((index + 1) * (entry**2).sum() for index, entry in enumerate(entries))
    total = torch.cat([entry.reshape(-1) for entry in entries]).sum()
    return weighted + total**2


def _batch_size(name: str, rank: int) -> int:
    return 4 + rank if name == "metric_sum" else 3 + 2 * rank


def _batch(name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = _generator(200 + rank)
    x = torch.randn(_batch_size(name, rank), _FEATURES, generator=generator, dtype=_DTYPE)
    y = torch.randn(_batch_size(name, rank), generator=generator, dtype=_DTYPE)
    return x, y


def _model() -> torch.nn.Linear:
    model = torch.nn.Linear(_FEATURES, 1, dtype=_DTYPE)
    generator = _generator(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=_DTYPE))
    return model


def _metric(name: str) -> Metric:
    metric: Metric = (
        MeanSquaredError(dist_sync_on_step=True)
        if name == "metric_sum"
        else CatMeanSquaredError(dist_sync_on_step=True)
    )
    return metric.set_dtype(_DTYPE)


# --- what each rank runs ----------------------------------------------------------------------------------------


def _compiled(fn: Any, backend: str | None) -> Any:
    """``fn`` itself, or ``torch.compile(fn, backend=backend)`` (``fullgraph=False``: the gather is a graph break)."""
    if backend is None:
        return fn
    import torch._dynamo

    torch._dynamo.reset()  # each check compiles its own function, never a cache entry of another check
    return torch.compile(fn, backend=backend)


def _run_one(name: str, rank: int, backend: str | None = None) -> list[torch.Tensor]:
    if name.startswith("gather"):
        from torchmetrics.utilities import distributed

        x = _gather_input(name, rank).requires_grad_(True)

        def gather_step(x: torch.Tensor) -> torch.Tensor:
            return _gather_loss(distributed.gather_all_tensors(x))

        torch.autograd.backward(_compiled(gather_step, backend)(x))
        assert x.grad is not None
        return [x.grad]
    model = _model()
    metric = _metric(name)
    x, y = _batch(name, rank)

    def metric_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return metric(model(x).squeeze(-1), y)  # type: ignore[no-any-return]

    torch.autograd.backward(_compiled(metric_step, backend)(x, y))
    return [parameter.grad.detach().clone() for parameter in model.parameters() if parameter.grad is not None]


def _run_all(rank: int, backend: str | None) -> dict[str, Outcome]:
    import torch.distributed as dist

    outcomes: dict[str, Outcome] = {}
    for name in CHECKS:
        dist.barrier()  # start each check together, so its time is the check's and not a neighbour's lag
        start = time.perf_counter()
        try:
            # A check that failed inside torch.compile can leave grad mode off (dynamo's unwinding of a Metric's
            # forward); each check starts with it on, so one failure cannot fail the checks after it.
            with torch.enable_grad():
                grads: list[torch.Tensor] | None = _run_one(name, rank, backend)
            error = None
        except Exception as err:  # reported per check; a failing check must not hide the others
            grads, error = None, "".join(traceback.format_exception_only(type(err), err)).strip()
        outcomes[name] = Outcome(grads, error, time.perf_counter() - start)
    return outcomes


def rank_main(
    mode: str | None = None, backend: str | None = None, with_compile_support: bool = False, sync: str | None = None
) -> tuple[dict[str, Any], dict[str, Outcome]]:
    """Run every check on this rank; return this process's ``status()`` and one :class:`Outcome` per check.

    ``mode`` (``"local"`` or ``"global"``) runs the checks inside ``patched(mode=mode)``; ``None`` runs them with
    whatever the import set up (``TORCHMETRICS_GRADPATCH_AUTOPATCH``, ``TORCHMETRICS_GRADPATCH_MODE``); ``sync``
    (``"torchmetrics"`` or ``"fused"``) likewise runs them inside ``patched(sync=sync)``.
    ``backend`` runs each check's step inside ``torch.compile(step, backend=backend)``. The checks run as the
    user's program stands: :func:`~torchmetrics_gradpatch.compile_support` is called only when
    ``with_compile_support`` asks for it (the CLI does, in a second run, to tell whether a program needs it).
    """
    import contextlib

    import torch.distributed as dist

    from torchmetrics_gradpatch._api import compile_support
    from torchmetrics_gradpatch._blocks import patched
    from torchmetrics_gradpatch._status import status

    if with_compile_support:
        compile_support()
    # torchmetrics < 1.6 on torch >= 2.8 warns at every uneven gather (tests/test_engine.py shows it); that noise
    # would bury the table when the checks run unpatched. The patched gather does not warn.
    warnings.filterwarnings("ignore", message="Using a non-tuple sequence", category=UserWarning)
    block = patched(mode=mode, sync=sync) if mode is not None or sync is not None else contextlib.nullcontext()
    with block:
        outcomes = _run_all(dist.get_rank(), backend)
        state = status().as_dict()
    return state, outcomes


# --- what the parent computes -------------------------------------------------------------------------------------


def reference(name: str, rank: int, world_size: int, mode: str = "local") -> list[torch.Tensor]:
    """Single-process gradient of the global loss with respect to ``rank``'s own tensors (others held fixed).

    That is what each rank receives in local mode (torchmetrics 1.6 semantics). In global mode every rank's copy
    of the same loss sends its gradient back to ``rank``'s tensors, so ``rank`` receives ``world_size`` times it.
    """
    scale = float(world_size) if mode == "global" else 1.0
    if name.startswith("gather"):
        entries = [_gather_input(name, q) for q in range(world_size)]
        entries[rank].requires_grad_(True)
        torch.autograd.backward(_gather_loss(entries))
        grad = entries[rank].grad
        assert grad is not None
        return [scale * grad]
    model = _model()
    preds, targets = [], []
    for q in range(world_size):
        x, y = _batch(name, q)
        out = model(x).squeeze(-1)
        preds.append(out if q == rank else out.detach())
        targets.append(y)
    torch.autograd.backward(torch.mean((torch.cat(preds) - torch.cat(targets)) ** 2))
    return [scale * parameter.grad for parameter in model.parameters() if parameter.grad is not None]


def matches(got: list[torch.Tensor] | None, want: list[torch.Tensor]) -> bool:
    """Whether a rank's gradients equal the reference (float64; rounding differences only)."""
    return (
        got is not None
        and len(got) == len(want)
        and all(
            g.shape == w.shape and torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got, want, strict=True)
        )
    )


def failure(name: str, outcomes: list[Outcome], world_size: int, mode: str) -> str | None:
    """Why check ``name`` failed (the first failing rank and its error, or its gradient's mismatch), or ``None``.

    ``outcomes`` holds one :class:`Outcome` per rank, in rank order.
    """
    for rank, outcome in enumerate(outcomes):
        if outcome.error is not None:
            return f"rank {rank}: {outcome.error.splitlines()[-1]}"
        if not matches(outcome.grads, reference(name, rank, world_size, mode)):
            return f"rank {rank}: gradient differs from the single-process reference"
    return None


def compile_backends() -> list[str]:
    """Every backend name ``torch.compile`` accepts here (debug and experimental ones included)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))
