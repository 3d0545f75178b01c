"""Locate or create the second environment: native torchmetrics (>= 1.6) on the *same* torch as this one.

The comparison "patched torchmetrics 1.5.x vs native torchmetrics 1.6+" is only fair on one torch build, so
the native environment is made from this interpreter's own torch version (local label included, e.g.
``2.13.0+cpu``) with this interpreter's ``pip``, which reads the machine's pip configuration (find-links,
constraints) exactly as the first environment's install did. uv does not read pip's configuration and may pick
a different build of the same version; hence pip here. torchmetrics_gradpatch is not installed there: native
torchmetrics needs no shim.

Location: ``benchmarks/.envs/tm-native`` (ignored by git), or the interpreter given by
``TMGP_BENCH_NATIVE_PYTHON``. Creating it takes a minute or two (the torch wheel unpacks to ~1 GB); later runs
reuse it while its recorded specification matches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / ".envs" / "tm-native"
NATIVE_SPEC = os.environ.get("TMGP_BENCH_NATIVE_TORCHMETRICS", "torchmetrics>=1.6")


def _python_in(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def probe(python: str | os.PathLike[str]) -> dict[str, str]:
    """torch and torchmetrics versions seen by ``python``."""
    code = (
        "import json, importlib.metadata as m, sys;"
        "print(json.dumps({'python': sys.version.split()[0], 'torch': m.version('torch'),"
        " 'torchmetrics': m.version('torchmetrics')}))"
    )
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def ensure_native_env(torch_version: str, where: Path = DEFAULT_DIR, log=print) -> Path:  # type: ignore[no-untyped-def]
    """Return the python of an environment with ``torch==torch_version`` and native torchmetrics."""
    override = os.environ.get("TMGP_BENCH_NATIVE_PYTHON")
    if override:
        return Path(override)
    python = _python_in(where)
    spec = {"torch": f"torch=={torch_version}", "torchmetrics": NATIVE_SPEC, "python": sys.version.split()[0]}
    marker = where / "tmgp-bench-spec.json"
    if python.exists() and marker.exists() and json.loads(marker.read_text()) == spec:
        return python
    log(f"creating {where} with {spec['torch']} and {spec['torchmetrics']} (one-off, a minute or two)")
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", spec["torch"], spec["torchmetrics"]],
        check=True,
    )
    marker.write_text(json.dumps(spec))
    return python


if __name__ == "__main__":
    import importlib.metadata

    print(ensure_native_env(importlib.metadata.version("torch")))
