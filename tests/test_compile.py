"""torch.compile: a compiled step gives eager's values and gradients, on every rank, in both modes.

Every case (a Metric loss with a sum state, one with an uneven ``cat`` state, and this package's
``gather_all_tensors`` called directly) is a test on warm ranks (2 and 3, ``run_ranks``): each rank runs the same two
training steps eagerly and compiled with the ``eager``, ``aot_eager`` or ``inductor`` backend (``fullgraph=False``)
and compares its compiled losses and weight gradients with its eager ones (float64, to 1e-12 relative). Each
compiled run goes through a backend wrapper that counts the graphs it was given, so a run that silently never
compiled anything is caught. The eager runs are themselves checked against single-process references by
tests/test_global_mode.py and the CLI's checks.

Where dynamo cannot run at all (torch 2.0 on Python 3.11 refuses it) every test skips with dynamo's own message;
where no C++ compiler is found, the inductor cases skip saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics import MeanSquaredError, Metric

import torchmetrics_gradpatch
from tests._rank_tools import dynamo_refusal
from tests._ranks import run_ranks
from tests._subprocess import cli, python_path, show
from tests._workloads import CatSquaredError
from torchmetrics_gradpatch import gather_all_tensors, patched

pytestmark = pytest.mark.compile

BACKENDS = ("eager", "aot_eager", "inductor")
RTOL = 1e-12
TIMEOUT = 600  # inductor compiles C++ for seconds per graph, per process, on a shared 2-core machine
#: "quick" (the default): the eager backend on 2 ranks, what every torch environment of tox.ini and a plain
#: `pytest` run. "ci": inductor on 2 ranks and the CLI in local mode (tox's compile-torch2.15; inductor runs the
#: graphs through AOTAutograd as aot_eager does, and compiles C++ in every rank). "full": every backend on 2 and 3
#: ranks, the CLI in both modes (tox's compile-full-torch2.15, in the matrix).
PROFILE = os.environ.get("TMGP_COMPILE_PROFILE", "quick")
if PROFILE not in ("full", "ci", "quick"):
    raise ValueError(f"TMGP_COMPILE_PROFILE={PROFILE!r}: use full, ci or quick")
QUICK_REASON = "TMGP_COMPILE_PROFILE=quick: only the eager backend on 2 ranks (set it to ci or full for more)"
CI_REASON = "TMGP_COMPILE_PROFILE=ci: inductor on 2 ranks only (TMGP_COMPILE_PROFILE=full runs every backend)"


def in_profile(world_size: int, backend: str = "eager") -> bool:
    if PROFILE == "full":
        return True
    return world_size == 2 and backend == ("inductor" if PROFILE == "ci" else "eager")


def _cxx_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def backends() -> list[str]:
    """The backends that can run here (in the pytest process: a test that cannot run skips before any rank)."""
    refusal = dynamo_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    usable = [b for b in BACKENDS if b != "inductor" or _cxx_compiler() is not None]
    return usable if PROFILE != "quick" else ["eager"]


@pytest.fixture
def backend_here(backends: list[str], world_size: int, backend: str) -> str:
    """``backend``, or a skip saying why it does not run in this profile or on this machine."""
    if not in_profile(world_size, backend):
        pytest.skip(CI_REASON if PROFILE == "ci" else QUICK_REASON)
    if backend not in backends:
        pytest.skip("inductor needs a C++ compiler (none of $CXX, g++, c++, clang++ found on PATH)")
    return backend


# --- the steps, eager and compiled -------------------------------------------------------------------------------

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


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    scale = max(expected.abs().max().item(), 1e-300)
    return actual.shape == expected.shape and (actual - expected).abs().max().item() <= RTOL * scale


def _compile_support_where_native() -> bool:
    """On native torchmetrics the trampoline is installed in local mode too (``compile_support()``), as the docs
    tell users to do for ``torch.compile``; the caller undoes it (warm ranks keep it otherwise)."""
    native = torchmetrics_gradpatch.status().native
    if native:
        torchmetrics_gradpatch.compile_support()
    return native


def _compiled_step_matches_eager(rank: int, world_size: int, backend: str, mode: str, case: str) -> None:
    native = _compile_support_where_native()
    try:
        eager = run_steps(case, mode, None, [])
        graphs: list[int] = []
        compiled = run_steps(case, mode, backend, graphs)
    finally:
        if native:
            torchmetrics_gradpatch.compile_support(False)
    assert eager["error"] is None, f"rank {rank}, eager:\n{eager['error']}"
    assert compiled["error"] is None, f"rank {rank}, {backend}:\n{compiled['error']}"
    assert graphs and sum(graphs) > 0, f"rank {rank}: {backend} was given no graph"
    assert len(compiled["losses"]) == len(eager["losses"]) == STEPS
    for step in range(STEPS):
        assert _close(compiled["losses"][step], eager["losses"][step]), (rank, step, "loss")
        assert _close(compiled["grads"][step], eager["grads"][step]), (rank, step, "grad")
        assert eager["grads"][step].abs().max() > 0, (rank, step, "a zero gradient proves nothing")


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3], ids=["2ranks", "3ranks"])
def test_compiled_step_matches_eager(world_size: int, backend: str, mode: str, case: str, backend_here: str) -> None:
    run_ranks(_compiled_step_matches_eager, world_size, backend_here, mode, case, timeout=TIMEOUT)


def _modes_really_differ(rank: int, world_size: int, backend: str) -> None:
    native = _compile_support_where_native()
    try:
        local = run_steps("metric_sum", "local", backend, [])
        glob = run_steps("metric_sum", "global", backend, [])
    finally:
        if native:
            torchmetrics_gradpatch.compile_support(False)
    assert local["error"] is None and glob["error"] is None, (local["error"], glob["error"])
    assert _close(glob["grads"][0], world_size * local["grads"][0]), (rank, glob["grads"][0], local["grads"][0])


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("world_size", [2, 3], ids=["2ranks", "3ranks"])
def test_modes_really_differ_under_compile(world_size: int, backend: str, backend_here: str) -> None:
    """The mode reaches the compiled gather: global mode's Metric-loss gradient is world_size x local mode's."""
    run_ranks(_modes_really_differ, world_size, backend_here, timeout=TIMEOUT)


def _native_without_compile_support(rank: int, world_size: int) -> None:
    torchmetrics_gradpatch.compile_support(False)  # warm ranks: whatever an earlier test left
    found = {}
    for mode in ("local", "global"):
        with torch.enable_grad():  # torchmetrics' own failing forward can leave grad mode off: restored on exit
            found[mode] = run_steps("metric_sum", mode, "eager", [])
    error = found["local"]["error"]
    assert error is not None and "allgather" in error, f"rank {rank}: {error}"
    assert found["global"]["error"] is None, found["global"]["error"]


@pytest.mark.timeout(2 * TIMEOUT)
def test_native_torchmetrics_without_compile_support(backends: list[str]) -> None:
    """docs/design.md's table: on native torchmetrics, without compile_support(), a local-mode Metric loss fails
    under torch.compile on gloo (torchmetrics' own gather is traced); global mode works."""
    if not torchmetrics_gradpatch.status().native:
        pytest.skip("torchmetrics < 1.6: the trampoline is installed in local mode anyway")
    run_ranks(_native_without_compile_support, 2, timeout=TIMEOUT)


# --- check --compile --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("mode", MODES)
def test_check_compile_runs_the_checks_compiled(backends: list[str], mode: str) -> None:
    """``check --compile eager``: every check's step inside torch.compile, gradients against the references."""
    if PROFILE == "quick":
        pytest.skip(QUICK_REASON)
    if PROFILE == "ci" and mode == "global":  # the compiled steps above run both modes
        pytest.skip("TMGP_COMPILE_PROFILE=ci: check --compile in local mode only (full runs both)")
    proc = subprocess.run(
        [sys.executable, "-m", "torchmetrics_gradpatch", "check", "--compile", "eager", "--mode", mode],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": python_path()},
        timeout=TIMEOUT,
        check=False,
    )
    shown = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, shown
    assert "compiled      torch.compile(step, backend='eager')" in proc.stdout, shown
    assert f"gradient mode {mode} (" in proc.stdout, shown
    assert proc.stdout.count(" pass ") == 4 and "all 4 checks passed" in proc.stdout, shown
    if not torchmetrics_gradpatch.status().native:  # the trampoline is in force anyway: nothing to say of it
        assert "compile_support" not in proc.stdout, shown


# --- check --compile on native torchmetrics: compile_support() is never switched on silently ------------------------


@pytest.mark.skipif(
    not torchmetrics_gradpatch.status().native,
    reason="torchmetrics < 1.6: the trampoline is installed in local mode anyway, so check --compile has nothing to "
    "say about compile_support() (tests/test_compile.py's check runs assert that it says nothing)",
)
def test_check_compile_says_whether_a_compiled_metric_loss_needs_compile_support() -> None:
    refusal = dynamo_refusal()
    if refusal:
        pytest.skip(refusal)
    proc = cli("check", "--compile", timeout=900)
    assert proc.returncode == 0, show(proc)
    assert "compiled      torch.compile(step, backend='eager')" in proc.stdout, show(proc)
    assert "all 4 checks passed" in proc.stdout, show(proc)
    # torchmetrics >= 1.6: its own gather is traced, and gloo refuses the sum state's 0-d tensors (docs/design.md)
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("Metric loss, sum state"))
    assert row.rstrip().endswith("with compile_support() only"), show(proc)
    assert "needs compile_support()" in proc.stdout and "allgather" in proc.stdout, show(proc)
