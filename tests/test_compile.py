"""torch.compile (issue 17): a compiled step gives eager's values and gradients, on every rank, in both modes.

One spawn per world size (2 and 3) runs every case of ``tests/_compile_ranks.py`` eagerly and compiled with the
``eager``, ``aot_eager`` and ``inductor`` backends (``fullgraph=False``); the tests below compare, rank by rank, the
compiled losses and weight gradients with the eager ones (float64, to 1e-12 relative) and check that the backend was
really given graphs. The eager runs are themselves checked against single-process references by
tests/test_global_mode.py and the CLI's checks; here a rank's eager run is the reference for its compiled run.

Where dynamo cannot run at all (torch 2.0 on Python 3.11 refuses it) every test skips with dynamo's own message;
where no C++ compiler is found, the inductor cases skip saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests import _compile_ranks as ranks
from tests._subprocess import ROOT
from torchmetrics_gradpatch.testing import spawn_ranks

WORLD_SIZES = (2, 3)
BACKENDS = ("eager", "aot_eager", "inductor")
RTOL = 1e-12
SPAWN_TIMEOUT = 1200  # inductor compiles for seconds per graph, per process, on a shared 2-core machine
#: "full" (the default): every backend, 2 and 3 ranks, the CLI. "ci": every backend on 2 ranks, the eager one on 3,
#: the CLI (`tox -m ci`'s torch2.15-tm1.5: inductor compiles C++ in every rank, minutes on 2 cores). "quick": the
#: eager backend on 2 ranks, for the compatibility matrix's run of every torch minor and the CI cells that repeat a
#: full cell's torch (tox.ini).
PROFILE = os.environ.get("TMGP_COMPILE_PROFILE", "full")
if PROFILE not in ("full", "ci", "quick"):
    raise ValueError(f"TMGP_COMPILE_PROFILE={PROFILE!r}: use full, ci or quick")
QUICK_REASON = "TMGP_COMPILE_PROFILE=quick: only the eager backend on 2 ranks here (tox.ini says where the full run is)"
CI_REASON = "TMGP_COMPILE_PROFILE=ci: aot_eager and inductor on 2 ranks only (TMGP_COMPILE_PROFILE=full adds 3 ranks)"


def in_profile(world_size: int, backend: str = "eager") -> bool:
    if PROFILE == "full":
        return True
    if PROFILE == "ci":
        return world_size == 2 or backend == "eager"
    return world_size == 2 and backend == "eager"


def _dynamo_refusal() -> str | None:
    """Why torch.compile cannot run here (its own error), or None when a trivial compiled call works."""
    try:
        compiled = torch.compile(lambda x: x * 2, backend="eager")
        if not torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0)):
            return "torch.compile(backend='eager') computed a wrong value for x * 2"
    except Exception as err:
        return f"torch.compile cannot run with torch {torch.__version__} here: {type(err).__name__}: {err}"
    return None


def _cxx_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def backends() -> list[str]:
    refusal = _dynamo_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    usable = [b for b in BACKENDS if b != "inductor" or _cxx_compiler() is not None]
    return usable if PROFILE != "quick" else ["eager"]


@pytest.fixture(scope="module")
def results(backends: list[str]) -> dict[int, list[dict[str, Any]]]:
    return {
        n: spawn_ranks(ranks.run_all, n, args=([b for b in backends if in_profile(n, b)],), timeout=SPAWN_TIMEOUT)
        for n in WORLD_SIZES
        if in_profile(n)
    }


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    scale = max(expected.abs().max().item(), 1e-300)
    return actual.shape == expected.shape and (actual - expected).abs().max().item() <= RTOL * scale


@pytest.mark.timeout(2 * SPAWN_TIMEOUT)  # the first test waits for both spawns
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ranks.MODES)
@pytest.mark.parametrize("case", ranks.CASES)
def test_compiled_step_matches_eager(
    results: dict[int, list[dict[str, Any]]],
    backends: list[str],
    world_size: int,
    backend: str,
    mode: str,
    case: str,
) -> None:
    if not in_profile(world_size, backend):
        pytest.skip(CI_REASON if PROFILE == "ci" else QUICK_REASON)
    if backend not in backends:
        pytest.skip("inductor needs a C++ compiler (none of $CXX, g++, c++, clang++ found on PATH)")
    for out in results[world_size]:
        rank = out["rank"]
        eager, compiled = out["runs"][(case, mode, "eager-reference")], out["runs"][(case, mode, backend)]
        assert eager["error"] is None, f"rank {rank}, eager:\n{eager['error']}"
        assert compiled["error"] is None, f"rank {rank}, {backend}:\n{compiled['error']}"
        assert compiled["graphs"] and sum(compiled["graphs"]) > 0, f"rank {rank}: {backend} was given no graph"
        assert len(compiled["losses"]) == len(eager["losses"]) == ranks.STEPS
        for step in range(ranks.STEPS):
            assert _close(compiled["losses"][step], eager["losses"][step]), (rank, step, "loss")
            assert _close(compiled["grads"][step], eager["grads"][step]), (rank, step, "grad")
            assert eager["grads"][step].abs().max() > 0, (rank, step, "a zero gradient proves nothing")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_modes_really_differ_under_compile(results: dict[int, list[dict[str, Any]]], world_size: int) -> None:
    """The mode reaches the compiled gather: global mode's Metric-loss gradient is world_size x local mode's."""
    if not in_profile(world_size):
        pytest.skip(CI_REASON if PROFILE == "ci" else QUICK_REASON)
    for out in results[world_size]:
        for backend in [b for b in ("eager", "aot_eager") if in_profile(world_size, b)]:
            local = out["runs"][("metric_sum", "local", backend)]["grads"][0]
            glob = out["runs"][("metric_sum", "global", backend)]["grads"][0]
            assert _close(glob, world_size * local), out["rank"]


# --- check --compile --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(SPAWN_TIMEOUT)
@pytest.mark.parametrize("mode", ranks.MODES)
def test_check_compile_runs_the_checks_compiled(backends: list[str], mode: str) -> None:
    """``check --compile eager``: every check's step inside torch.compile, gradients against the references."""
    if PROFILE == "quick":
        pytest.skip(QUICK_REASON)
    proc = subprocess.run(
        [sys.executable, "-m", "torchmetrics_gradpatch", "check", "--compile", "eager", "--mode", mode],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        timeout=SPAWN_TIMEOUT,
        check=False,
    )
    shown = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, shown
    assert "compiled      torch.compile(step, backend='eager')" in proc.stdout, shown
    assert f"gradient mode {mode} (" in proc.stdout, shown
    assert proc.stdout.count(" pass ") == 4 and "all 4 checks passed" in proc.stdout, shown


def test_native_torchmetrics_without_compile_support(results: dict[int, list[dict[str, Any]]]) -> None:
    """docs/design.md's table: on native torchmetrics, without compile_support(), a local-mode Metric loss fails
    under torch.compile on gloo (torchmetrics' own gather is traced); global mode works."""
    outs = results[2]
    if not outs[0]["native"]:
        pytest.skip("torchmetrics < 1.6: the trampoline is installed in local mode anyway")
    for out in outs:
        found = out["without_compile_support"]
        error = found[("metric_sum", "local")]["error"]
        assert error is not None and "allgather" in error, f"rank {out['rank']}: {error}"
        assert found[("metric_sum", "global")]["error"] is None, found[("metric_sum", "global")]["error"]
