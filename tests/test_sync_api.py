"""The sync strategy through the public API: ``patch(sync=)``, ``patched(sync=)``, ``TORCHMETRICS_GRADPATCH_SYNC``.

On two real gloo ranks (``run_ranks``), a ``MeanSquaredError(dist_sync_on_step=True)`` loss under
``patched(sync="fused")`` gives, in both gradient modes, torchmetrics' own sync's values and the gradients of the
same loss computed in one process from every rank's data, in exactly two collectives for the group's first fused
sync (counted with the process group's sequence number, as tests/test_fused.py does), and a compiled step gives the
eager one's loss and gradient. In this process: which ``Metric._sync_dist`` is installed in every state of the
switches (restoration is the identity of torchmetrics' own function object), the environment variable, ``status()``
and the command line's spelling rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics import MeanSquaredError, Metric

import torchmetrics_gradpatch as tg
from tests._patch_state import reset_patch_state
from tests._rank_tools import calls
from tests._ranks import run_ranks
from tests._subprocess import ok, run_python
from torchmetrics_gradpatch import _api, _engine, _syncs
from torchmetrics_gradpatch.cli import build_parser

pytestmark = pytest.mark.python

ORIGINAL_SYNC_DIST = _syncs.original_sync_dist()  # torchmetrics' own, also while the patch has replaced it
F64 = torch.float64


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s uneven batch (``3 + rank`` samples), reproducible on every rank."""
    generator = torch.Generator().manual_seed(31 + rank)
    n = 3 + rank
    return torch.randn(n, generator=generator, dtype=F64), torch.randn(n, generator=generator, dtype=F64)


def one_step(sync: str, mode: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """One training step of a synced MSE loss: its value, this rank's gradient, collectives in forward, in backward."""
    preds, target = batch(dist.get_rank())
    preds.requires_grad_()
    metric = MeanSquaredError(dist_sync_on_step=True).set_dtype(F64)
    with tg.patched(mode=mode, sync=sync):
        assert tg.status().sync == sync and (_syncs.installed() == "fused") == (sync == "fused")
        before = calls()
        loss = metric(preds, target)
        forward = calls() - before
    before = calls()
    loss.backward()
    assert preds.grad is not None
    return loss.detach(), preds.grad, forward, calls() - before


def _fused_loss_matches(rank: int, world_size: int, mode: str) -> None:
    before = installed_sync()  # the default: TORCHMETRICS_GRADPATCH_SYNC, else torchmetrics' own
    expected_loss, expected_grad, torchmetrics_calls, _ = one_step("torchmetrics", mode)
    assert installed_sync() == before, (installed_sync(), before)  # the block's exit put the sync back
    loss, grad, forward, backward = one_step("fused", mode)
    assert installed_sync() == before, (installed_sync(), before)
    assert forward == 2, f"the fused sync issued {forward} collectives (torchmetrics' own: {torchmetrics_calls})"
    assert backward == (1 if mode == "global" else 0), backward  # global mode: one backward collective per sync
    assert torch.equal(loss, expected_loss), (loss, expected_loss)  # the same synced states give the same loss
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    # the single-process reference: the mean squared error over every rank's samples, w.r.t. this rank's preds
    batches = [batch(r) for r in range(world_size)]
    everything = [p.clone().requires_grad_() for p, _ in batches]
    reference = ((torch.cat(everything) - torch.cat([t for _, t in batches])) ** 2).mean()
    reference.backward()
    scale = world_size if mode == "global" else 1  # global: every rank's (equal) loss reaches every rank's preds
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, scale * everything[rank].grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["local", "global"])
def test_fused_loss_through_the_api_matches_torchmetrics_and_one_process(mode: str) -> None:
    run_ranks(_fused_loss_matches, 2, mode, timeout=90)


# --- in this process: which _sync_dist is installed ----------------------------------------------------------------


@pytest.fixture
def restored() -> Iterator[None]:
    """Leave the switches as the import set them (the environment's default sync, the import's patch)."""
    yield
    reset_patch_state()


def installed_sync() -> str:
    """What ``Metric._sync_dist`` runs now: "fused", or "torchmetrics" (its own method, or the replacement that runs
    it behind a graph break under torch.compile, installed with the trampoline)."""
    current = Metric.__dict__["_sync_dist"]
    if current is ORIGINAL_SYNC_DIST:
        return "torchmetrics"
    assert current.__wrapped__ is ORIGINAL_SYNC_DIST and _syncs.guarded(), current
    return "fused" if _syncs.installed() == "fused" else "torchmetrics"


def restored_identically() -> bool:
    return Metric.__dict__["_sync_dist"] is ORIGINAL_SYNC_DIST and not _syncs.guarded()


def test_patch_and_blocks_choose_the_sync_and_restore_the_identical_method(
    restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_api.SYNC_ENV, raising=False)
    reset_patch_state()
    assert installed_sync() == "torchmetrics" and tg.status().sync == "torchmetrics"
    tg.patch(sync="fused")
    assert installed_sync() == "fused"
    with tg.patched(sync="torchmetrics"):
        assert installed_sync() == "torchmetrics"
        with tg.patched(sync="fused"), tg.patched(mode="global"):  # a newer block naming no sync leaves it alone
            assert installed_sync() == "fused" and tg.status().sync_chosen_by == "patched(sync=...)"
        assert installed_sync() == "torchmetrics"
    assert installed_sync() == "fused" and tg.status().sync_chosen_by == "patch()"
    tg.patch()  # no sync named: the default, torchmetrics' own
    assert installed_sync() == "torchmetrics"
    # torchmetrics' own sync is behind the replacement (a graph break under torch.compile) with the trampoline
    assert _syncs.guarded() == _engine.installed()
    tg.unpatch()
    with tg.patched(sync="fused"):  # a block alone puts the patch, and the fused sync, in force
        assert installed_sync() == "fused"
    assert installed_sync() == "torchmetrics" and not tg.is_patched() and restored_identically()
    tg.patch(sync="fused")
    reset_patch_state()  # resets the sync too
    assert installed_sync() == "torchmetrics"


def test_a_decorated_function_runs_with_its_sync(restored: None) -> None:
    @tg.patched(sync="fused")
    def inside() -> str:
        return installed_sync()

    tg.unpatch()
    assert inside() == "fused" and restored_identically()


def test_sync_names_are_case_insensitive_everywhere(restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tg.patch(sync=" FUSED ")
    assert installed_sync() == "fused" and tg.status().sync == "fused"
    with tg.patched(sync="TorchMetrics"):
        assert installed_sync() == "torchmetrics"
    for raw, sync in (("Fused", "fused"), (" TORCHMETRICS ", "torchmetrics"), ("", "torchmetrics")):
        monkeypatch.setenv(_api.SYNC_ENV, raw)
        assert _api.sync_requested() == sync
    assert build_parser().parse_args(["check", "--sync", "Fused"]).sync == "fused"
    with pytest.raises(ValueError, match="sync='fast' is not a sync strategy; use one of 'torchmetrics', 'fused'"):
        tg.patch(sync="fast")
    with pytest.raises(ValueError, match="sync=3 is not a sync strategy"):
        tg.patched(sync=3)  # type: ignore[arg-type]
    assert installed_sync() == "fused"  # a refused call changed nothing


def test_the_environment_variable_sets_the_default_sync(restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_api.SYNC_ENV, "Fused")
    reset_patch_state()  # what a fresh import does with the environment
    assert installed_sync() == "fused"
    status = tg.status()
    assert (status.sync, status.default_sync, status.sync_chosen_by) == ("fused", "fused", "import")
    assert status.sync_applied_to[0].startswith("torchmetrics.Metric._sync_dist (runs the 'fused' sync"), status
    assert "sync:             fused: one exchange per Metric sync" in str(status), str(status)
    assert status.as_dict()["sync"] == "fused" and status.as_dict()["sync_applied_to"] == list(status.sync_applied_to)
    tg.patch(sync="torchmetrics")
    assert installed_sync() == "torchmetrics" and tg.status().default_sync == "fused"
    monkeypatch.setenv(_api.SYNC_ENV, "fast")
    with pytest.raises(ValueError, match=r"TORCHMETRICS_GRADPATCH_SYNC='fast' is not a sync strategy; use one of: "):
        _api.sync_requested()


def test_status_when_off_and_unchosen(restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_api.SYNC_ENV, raising=False)
    reset_patch_state()
    tg.unpatch()
    status = tg.status()
    assert (status.sync, status.sync_chosen_by, status.sync_applied_to) == ("torchmetrics", "", ())
    assert restored_identically()
    assert "sync:             torchmetrics: its own collectives per state" in str(status), str(status)


def run_import(code: str, sync: str) -> Any:
    return run_python(code, env={_api.SYNC_ENV: sync}, timeout=120)


def test_the_import_reads_the_variable_and_stays_torch_free() -> None:
    ok(
        "import sys, torchmetrics_gradpatch as tg\n"
        "assert 'torch' not in sys.modules and 'torchmetrics' not in sys.modules, sorted(sys.modules)\n"
        "assert 'FusedSyncError' in tg.__all__ and issubclass(tg.FusedSyncError, RuntimeError)\n"
        "from torchmetrics import Metric\n"
        "assert tg.status().sync == 'fused' and \"'fused'\" in tg.status().sync_applied_to[0], tg.status()\n"
        "assert Metric._sync_dist.__torchmetrics_gradpatch_sync__\n",
        env={_api.SYNC_ENV: "FUSED"},
    )


def test_a_bad_variable_fails_the_import_and_is_exit_2_on_the_command_line() -> None:
    proc = run_import("import torchmetrics_gradpatch", "fast")
    assert proc.returncode == 1 and "ValueError: TORCHMETRICS_GRADPATCH_SYNC='fast' is not a sync" in proc.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "torchmetrics_gradpatch", "status"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), _api.SYNC_ENV: "fast"},
        timeout=120,
        check=False,
    )
    assert cli.returncode == 2, (cli.stdout, cli.stderr)
    assert cli.stderr.strip().splitlines() == [
        "torchmetrics-gradpatch: error: TORCHMETRICS_GRADPATCH_SYNC='fast' is not a sync strategy; use one of: "
        "torchmetrics, fused, in any case (unset means torchmetrics). See docs/fused-sync.md."
    ]


# --- under torch.compile: the fused sync behind one graph break -----------------------------------------------------


def compiled_step(mode: str, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A cat-state MSE loss of a linear model under ``patched(sync="fused")``: the loss and the weight's gradient."""
    from tests._rank_tools import CatSquaredError

    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(77 + rank)
    x, y = (
        torch.randn(3 + rank, 3, generator=generator, dtype=F64),
        torch.randn(3 + rank, generator=generator, dtype=F64),
    )
    w = torch.linspace(-0.7, 0.9, 3, dtype=F64).requires_grad_()
    metric = CatSquaredError(dist_sync_on_step=True).set_dtype(F64)

    def step(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return metric(torch.tanh(x @ w), y)  # type: ignore[no-any-return]

    if backend is not None:
        from torch import _dynamo

        _dynamo.reset()
        step = torch.compile(step, backend=backend, fullgraph=False)
    with tg.patched(mode=mode, sync="fused"):
        loss = step(w, x, y)
        loss.backward()
    assert w.grad is not None
    return loss.detach(), w.grad


def _compiled_matches_eager(rank: int, world_size: int, mode: str) -> None:
    eager_loss, eager_grad = compiled_step(mode, None)
    loss, grad = compiled_step(mode, "eager")
    assert eager_grad.abs().max() > 0, eager_grad
    torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["local", "global"])
def test_the_fused_sync_runs_behind_a_graph_break_under_compile(mode: str) -> None:
    try:  # decided here, before any rank: the ranks run this torch
        torch.compile(lambda t: t * 2, backend="eager")(torch.ones(1))
    except Exception as err:  # torch 2.0 on Python 3.11: dynamo refuses to run at all
        pytest.skip(f"torch.compile cannot run here: {type(err).__name__}: {err}")
    run_ranks(_compiled_matches_eager, 2, mode, timeout=300)
