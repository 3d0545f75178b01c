"""``examples/ddp_metric_loss.py`` runs through torchrun, exactly as the README says, so it cannot rot.

The first test reads the ``torchrun ... examples/ddp_metric_loss.py`` command from README.md's code blocks and
runs those arguments, so a change to the README's command is tested as written.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from tests._subprocess import ROOT

TORCH = Version(importlib.metadata.version("torch"))
NATIVE = Version("1.6.0") <= Version(importlib.metadata.version("torchmetrics"))
EXAMPLE = ROOT / "examples" / "ddp_metric_loss.py"

pytestmark = pytest.mark.skipif(Version(TORCH.base_version) < Version("2.0"), reason=f"torch {TORCH} < 2.0")


def readme_command() -> list[str]:
    """The arguments after ``torchrun`` in the README's command for the first example (one line, in a fence)."""
    fenced = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    lines = [line for block in fenced for line in block.splitlines() if line.startswith("torchrun ")]
    (line,) = [line for line in lines if "examples/ddp_metric_loss.py" in line]
    return shlex.split(line.split("#", 1)[0])[1:]


def torchrun(*args: str, env: dict[str, str] | None = None, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node N ...`` (this interpreter's torchrun), bounded in time."""
    return run_torchrun(["--standalone", "--nproc-per-node", str(nproc), *args], env=env)


def run_torchrun(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``torchrun *args`` with this interpreter's torchrun, from the repository root, bounded in time.

    torchrun runs in its own session; if it outlives the deadline, the whole session (torchrun, its ranks and
    anything they spawned) is killed before the ``TimeoutExpired`` propagates, so nothing is left behind.
    """
    script = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "torch.distributed.run"]
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    argv = [*command, *args]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT, start_new_session=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def show(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"


def test_the_readme_gives_the_example_command() -> None:
    command = readme_command()
    assert command[-1] == "examples/ddp_metric_loss.py" and "--nproc-per-node" in command, command


def test_example_gradient_is_the_single_process_gradient_over_world_size() -> None:
    proc = run_torchrun(readme_command())  # exactly as the README says
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
