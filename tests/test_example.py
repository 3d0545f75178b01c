"""``examples/ddp_metric_loss.py`` runs through torchrun, exactly as the README says, so it cannot rot.

The first test reads the ``torchrun ... examples/ddp_metric_loss.py`` command from README.md's code blocks and
runs those arguments, so a change to the README's command is tested as written (on torch 2.0 its ``--standalone``
runs as the options it stands for on a free port: see ``tests._torchrun.standalone``).
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex

import pytest
from packaging.version import Version

from tests._subprocess import ROOT
from tests._torchrun import NEEDS_TORCH_2, run_torchrun, show, torchrun

NATIVE = Version("1.6.0") <= Version(importlib.metadata.version("torchmetrics"))
EXAMPLE = ROOT / "examples" / "ddp_metric_loss.py"

pytestmark = [NEEDS_TORCH_2, pytest.mark.system]


def readme_command() -> list[str]:
    """The arguments after ``torchrun`` in the README's command for the first example (one line, in a fence)."""
    fenced = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    lines = [line for block in fenced for line in block.splitlines() if line.startswith("torchrun ")]
    (line,) = [line for line in lines if "examples/ddp_metric_loss.py" in line]
    return shlex.split(line.split("#", 1)[0])[1:]


def test_the_readme_gives_the_example_command() -> None:
    command = readme_command()
    assert command[-1] == "examples/ddp_metric_loss.py" and "--nproc-per-node" in command, command


def test_example_gradient_is_the_single_process_gradient_over_world_size() -> None:
    proc = run_torchrun(readme_command())  # as the README says
    assert proc.returncode == 0, show(proc)
    assert "DDP gradient == 0.5 x single-process gradient" in proc.stdout, show(proc)
    assert "gradient: OK" in proc.stdout and "loss:     OK" in proc.stdout, show(proc)
    assert "Warning" not in proc.stderr, show(proc)


def test_example_in_global_mode_gets_the_single_process_gradient() -> None:
    proc = torchrun("examples/ddp_metric_loss.py", "--mode", "global")
    assert proc.returncode == 0, show(proc)
    assert "gather patched, global mode" in proc.stdout, show(proc)
    assert "DDP gradient == 1 x single-process gradient" in proc.stdout, show(proc)
    assert "gradient: OK" in proc.stdout and "loss:     OK" in proc.stdout, show(proc)


@pytest.mark.skipif(NATIVE, reason="torchmetrics >= 1.6 keeps the graph natively: the example passes unpatched")
def test_example_fails_loudly_without_the_patch() -> None:
    proc = torchrun("examples/ddp_metric_loss.py", env={"TORCHMETRICS_GRADPATCH_AUTOPATCH": "0"})
    assert proc.returncode != 0, show(proc)
    assert "the synced loss has no autograd graph" in proc.stderr, show(proc)
