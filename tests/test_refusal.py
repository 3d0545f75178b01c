"""Checks of the tox environment itself: it runs the torch and torchmetrics it asked for, and on torch below 2.0
the real ``import torchmetrics_gradpatch`` refuses as the Core issue specifies.

The torch1.13 tox environment runs only this file (the rest of the suite needs a supported torch). Every import of
the package happens in a fresh interpreter, so nothing here depends on import order.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

pytestmark = pytest.mark.python

TORCH = Version(importlib.metadata.version("torch"))
BELOW_MINIMUM = Version(TORCH.base_version) < Version("2.0")


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, check=False
    )


@pytest.mark.parametrize(("distribution", "variable"), [("torch", "TMGP_TORCH"), ("torchmetrics", "TMGP_TORCHMETRICS")])
def test_environment_runs_the_requested_version(distribution: str, variable: str) -> None:
    wanted = os.environ.get(variable)
    if not wanted:
        pytest.skip(f"{variable} not set: not running in a tox matrix environment")
    installed = Version(importlib.metadata.version(distribution))
    assert installed.base_version == Version(wanted).base_version, f"{distribution} {installed}, wanted {wanted}"


REFUSAL = """
import sys
import torch
import torchmetrics, torchmetrics.metric as tm_metric, torchmetrics.utilities.distributed as tm_dist

gather = tm_dist.gather_all_tensors
before = (gather.__code__, gather.__defaults__, dict(gather.__dict__), tm_metric.gather_all_tensors,
          tm_metric.Metric._sync_dist.__defaults__, tm_metric.Metric.sync, list(sys.meta_path))

def state():
    g = tm_dist.gather_all_tensors
    return (g.__code__, g.__defaults__, dict(g.__dict__), tm_metric.gather_all_tensors,
            tm_metric.Metric._sync_dist.__defaults__, tm_metric.Metric.sync, list(sys.meta_path))

def refused():
    try:
        import torchmetrics_gradpatch  # noqa: F401
    except ImportError as err:
        kind = type(err)
        assert kind.__name__ == "UnsupportedVersionError", repr(err)
        assert not issubclass(kind, ModuleNotFoundError), kind.__mro__
        assert not [n for n in sys.modules if n.split(".")[0] == "torchmetrics_gradpatch"], "left in sys.modules"
        return str(err)
    raise SystemExit("import torchmetrics_gradpatch did not refuse")

first, second = refused(), refused()
assert first == second, (first, second)
assert f"torch {torch.__version__}" in first, first
assert "2.0" in first, first
now = state()
assert tm_dist.gather_all_tensors is gather, "gather_all_tensors replaced"
assert all(a is b or a == b for a, b in zip(now, before)), "torchmetrics changed"
print(first)
"""


@pytest.mark.skipif(not BELOW_MINIMUM, reason=f"torch {TORCH} is supported; the refusal is for torch < 2.0")
def test_import_refuses_on_torch_below_2_and_touches_nothing() -> None:
    proc = run(REFUSAL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert "torchmetrics_gradpatch supports torch >= 2.0 only" in proc.stdout


@pytest.mark.skipif(BELOW_MINIMUM, reason=f"torch {TORCH} is below the supported minimum")
def test_import_succeeds_on_supported_torch() -> None:
    proc = run("import torchmetrics_gradpatch as g; s = g.status(); print(g.is_patched())")
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
