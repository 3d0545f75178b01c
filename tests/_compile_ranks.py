"""What each spawned rank runs for tests/test_compile.py: the same training steps eagerly and inside torch.compile.

One spawn per world size runs every case (a Metric loss with a sum state, one with an uneven ``cat`` state, and
this package's ``gather_all_tensors`` called directly), in both gradient modes, eagerly and compiled with each
requested backend (``fullgraph=False``), two steps each. The parent compares the compiled values and gradients
with the eager ones of the same rank. Each compiled run goes through a backend wrapper that counts the graphs it
was given, so a run that silently never compiled anything is caught.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import MeanSquaredError, Metric

import torchmetrics_gradpatch
from tests._rank_tools import CatSquaredError
from torchmetrics_gradpatch import gather_all_tensors, patched

F64 = torch.float64
FEATURES = 3
CASES = ("metric_sum", "metric_cat", "gather")
MODES = ("local", "global")
STEPS = 2


def rows(case: str, rank: int, step: int) -> int:
    """Uneven batches on every case (the cat state and the direct gather then take the padded path)."""
    return 3 + rank + step if case != "gather" else 2 * rank + 1


def inputs(case: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + CASES.index(case))
    n = rows(case, rank, step)
    return (
        torch.randn(n, FEATURES, generator=generator, dtype=F64),
        torch.randn(n, generator=generator, dtype=F64),
    )


def weight() -> torch.Tensor:
    return torch.linspace(-0.7, 0.9, FEATURES, dtype=F64)


def make_metric(case: str) -> Metric:
    metric: Metric = (
        MeanSquaredError(dist_sync_on_step=True) if case == "metric_sum" else CatSquaredError(dist_sync_on_step=True)
    )
    return metric.set_dtype(F64)


def make_step(case: str, mode: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A fresh step function (its own code object per case, so dynamo's caches never mix the cases)."""
    if case == "gather":

        def gather_step(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            entries = gather_all_tensors(torch.tanh(x @ w) * y, mode=mode)
            rank = dist.get_rank()
            weighted = sum((index + 1) * (entry**2).sum() for index, entry in enumerate(entries))
            return weighted + (rank + 1) * torch.cat(entries).sum() ** 2  # type: ignore[no-any-return]

        return gather_step
    metric = make_metric(case)

    def metric_step(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return metric(torch.tanh(x @ w), y)  # type: ignore[no-any-return]

    return metric_step


def run_steps(case: str, mode: str, backend: str | None, graphs: list[int]) -> dict[str, Any]:
    """``STEPS`` steps of one case, eager (``backend=None``) or compiled: each step's loss and weight gradient."""
    rank = dist.get_rank()
    step_fn = make_step(case, mode)
    if backend is not None:
        import torch._dynamo

        torch._dynamo.reset()
        from torch._dynamo.backends.registry import lookup_backend

        real = lookup_backend(backend)

        def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            graphs.append(len(gm.graph.nodes))
            return real(gm, example_inputs)

        step_fn = torch.compile(step_fn, backend=counting, fullgraph=False)
    out: dict[str, Any] = {"losses": [], "grads": [], "error": None}
    start = time.perf_counter()
    try:
        with patched(mode=mode):
            for step in range(STEPS):
                w = weight().requires_grad_(True)
                x, y = inputs(case, rank, step)
                loss = step_fn(w, x, y)
                loss.backward()
                assert w.grad is not None
                out["losses"].append(loss.detach().clone())
                out["grads"].append(w.grad.detach().clone())
    except Exception as err:  # reported per case; the parent shows it
        out["error"] = "".join(traceback.format_exception(type(err), err, err.__traceback__))[-3000:]
    out["seconds"] = time.perf_counter() - start
    return out


def run_all(backends: list[str]) -> dict[str, Any]:
    """Every case in both modes, eager then compiled with each backend. On native torchmetrics the trampoline is
    installed in local mode too (``compile_support()``), as the docs tell users to do for ``torch.compile``."""
    native = torchmetrics_gradpatch.status().native
    out: dict[str, Any] = {"rank": dist.get_rank(), "native": native, "torch": torch.__version__, "runs": {}}
    if native:  # what docs/design.md says works without compile_support() there, then with it
        out["without_compile_support"] = {}
        for case, mode in (("metric_sum", "local"), ("metric_sum", "global")):
            with torch.enable_grad():  # torchmetrics' own failing forward can leave grad mode off: restored on exit
                out["without_compile_support"][(case, mode)] = run_steps(case, mode, "eager", [])
                out["without_compile_support"][(case, mode)]["grad_mode_after"] = torch.is_grad_enabled()
        torchmetrics_gradpatch.compile_support()
    for case in CASES:
        for mode in MODES:
            out["runs"][(case, mode, "eager-reference")] = run_steps(case, mode, None, [])
            for backend in backends:
                graphs: list[int] = []
                result = run_steps(case, mode, backend, graphs)
                result["graphs"] = graphs
                out["runs"][(case, mode, backend)] = result
    return out
