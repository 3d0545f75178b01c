"""Lightning integration: a LightningModule trained with ``Trainer(devices=2, strategy="ddp_spawn")`` on CPU.

The training program (``tests/_lightning_job.py``) does ``import torchmetrics_gradpatch`` at its top and uses
torchmetrics Metrics with ``dist_sync_on_step=True`` as its loss: a sum-state ``MeanSquaredError`` and a list-state
(``cat``) mean squared error, with batches of 3 and 5 samples on the two ranks. It runs in its own interpreter, as
a user's program would, and saves the parameter gradients each rank sees after the first backward. They must equal
``1/world_size`` x the single-process gradient of the same global losses: each rank backpropagates through its own
samples only, and DDP averages the ranks' gradients. In global mode (``TORCHMETRICS_GRADPATCH_MODE=global``) every
rank's copy of the loss sends gradient back to every rank's samples, and the gradients equal the single-process
gradient itself.

A second program (``tests/_lightning_collection_job.py``) runs a validation epoch on the same Trainer with
``TORCHMETRICS_GRADPATCH_SYNC=fused``: each rank feeds its own uneven batches of a small multiclass problem into a
``MetricCollection`` (accuracy, precision, recall and F1 in one compute group, and AUROC with ``cat`` states)
logged the two ways Lightning documents. ``self.log_dict(collection.compute())`` in ``on_validation_epoch_end``
must cost at most three collectives (the one exchange); ``self.log_dict(collection)``, whose members Lightning
computes one by one, and torchmetrics' own sync of the same collection must cost more. The one exchange's values
must be bit for bit what torchmetrics' own sync gives from the same local states, and what Lightning logged. They
are not compared with a single process: in this validation loop a collection's local compute-group states, read
before any sync, differ from run to run, with this package imported or not (a rank's first batch now and then
counts twice), so a single-process reference would fail without saying anything about the sync. Collectives are counted
with the default process group's sequence number.

Skipped when Lightning is not installed; ``tox -e lightning`` installs it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from tests._subprocess import suite_path

TORCH = Version(importlib.metadata.version("torch"))

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None,
        reason="Lightning is not installed (pip install lightning, or run `tox -e lightning`)",
    ),
    pytest.mark.skipif(Version(TORCH.base_version) < Version("2.0"), reason=f"torch {TORCH} < 2.0"),
]


def run_job(module: str, out_dir: Path, **env: str) -> None:
    """Run the training program ``module`` in its own interpreter, as a user would, bounded; fail with its output."""
    proc = subprocess.run(
        [sys.executable, "-m", module, str(out_dir)],
        capture_output=True,
        text=True,
        cwd=suite_path(),  # `-m` puts the working directory first: the suite, not the checkout's package
        env={**os.environ, **env},
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def reference_gradients() -> dict[str, object]:
    """Single-process gradients of each head's global loss (mean squared error over both ranks' samples)."""
    import torch

    from tests import _lightning_job as job

    made = job.heads()
    xs, ys = zip(*(job.batch(rank) for rank in range(job.WORLD_SIZE)), strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    grads: dict[str, object] = {}
    for name, head in made.items():
        torch.autograd.backward(torch.mean((head(x).squeeze(-1) - y) ** 2))
        for parameter_name, parameter in head.named_parameters():
            grads[f"{name}.{parameter_name}"] = parameter.grad
    return grads


@pytest.mark.parametrize(("mode", "scale"), [("local", 0.5), ("global", 1.0)])
def test_lightning_ddp_gradients_against_single_process_gradients(tmp_path: Path, mode: str, scale: float) -> None:
    """Local mode: ``1/world_size`` x the single-process gradient; global mode: the single-process gradient."""
    import torch

    run_job("tests._lightning_job", tmp_path, TORCHMETRICS_GRADPATCH_MODE=mode)
    expected = reference_gradients()
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["graph_preserving"], f"rank {rank}: the patch was not in force"
        assert saved["mode"] == mode, saved["mode"]
        grads = saved["grads"]
        assert sorted(grads) == sorted(expected), (sorted(grads), sorted(expected))
        for name, want in expected.items():
            assert isinstance(want, torch.Tensor)
            torch.testing.assert_close(grads[name], scale * want, rtol=1e-10, atol=1e-12, msg=f"rank {rank}, {name}")


def test_lightning_log_dict_of_collection_compute_is_one_exchange(tmp_path: Path) -> None:
    """``log_dict(collection.compute())``: at most three collectives; per member, or torchmetrics' sync: more."""
    import torch

    run_job("tests._lightning_collection_job", tmp_path, TORCHMETRICS_GRADPATCH_SYNC="fused")
    from tests._lightning_collection_job import members

    expected = members()
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert (saved["sync"], saved["sync_chosen_by"]) == ("fused", "import"), saved
        logged, computed = saved["logged"], saved["computed"]
        for key in expected:
            # bit for bit what torchmetrics' own sync gives from the same local states, and what Lightning logged
            torch.testing.assert_close(computed[f"val_{key}"], computed[f"ref_{key}"], rtol=0, atol=0)
            torch.testing.assert_close(logged[f"val_{key}"], computed[f"val_{key}"], rtol=0, atol=0)
        counts = saved["collection_calls"], saved["own_calls"], saved["member_calls"]
        assert 1 <= saved["collection_calls"] <= 3, counts
        assert saved["own_calls"] > 3, counts
        member_calls = saved["member_calls"]
        assert sorted(member_calls) == sorted(expected), counts
        # one exchange each, the per-member fused sync: two collectives, or one where its payload fits the group's
        # inline capacity (an exchange of the same group before it)
        assert all(1 <= calls[0] <= 2 for calls in member_calls.values()), counts
        assert sum(sum(calls) for calls in member_calls.values()) > 3, counts
