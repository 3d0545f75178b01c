"""Run the examples through torchrun, as their docstrings and the README say (tests/test_*example.py)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from packaging.version import Version

from tests._subprocess import ROOT, python_path

TORCH = Version(importlib.metadata.version("torch"))
NEEDS_TORCH_2 = pytest.mark.skipif(Version(TORCH.base_version) < Version("2.0"), reason=f"torch {TORCH} < 2.0")


def torchrun(*args: str, env: dict[str, str] | None = None, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node N ...`` (this interpreter's torchrun), bounded in time."""
    return run_torchrun(["--standalone", "--nproc-per-node", str(nproc), *args], env=env)


def standalone() -> list[str]:
    """``--standalone``; on torch 2.0, whose ``--standalone`` rendezvous on the fixed port 29400 (two suites run side
    by side collide there), the options it stands for with a port the kernel has just found free."""
    if TORCH.release >= (2, 1):
        return ["--standalone"]
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    return [
        "--nnodes",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-id",
        str(uuid.uuid4()),
    ]


def run_torchrun(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``torchrun *args`` with this interpreter's torchrun, from the repository root, bounded in time.

    A ``--standalone`` in ``args`` becomes what :func:`standalone` gives, so a command quoted from the docs runs
    side by side with another suite's on torch 2.0 too.

    torchrun runs in its own session; if it outlives the deadline, the whole session (torchrun, its ranks and
    anything they spawned) is killed before the ``TimeoutExpired`` propagates, so nothing is left behind.
    """
    script = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "torch.distributed.run"]
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = python_path()
    argv = [*command, *(arg for given in args for arg in (standalone() if given == "--standalone" else [given]))]
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
