"""Build the release artifacts and check them as a user and a downstream packager would meet them.

    python scripts/check_dist.py --torch 2.15.0 --torchmetrics 1.5.2     (tox -e wheel-smoke runs this)

1. ``python -m build`` makes the sdist, then the wheel *from the unpacked sdist* (so the sdist is proven to build).
2. ``twine check --strict`` on both.
3. The sdist carries every file git tracks (``tests/``, ``tox.ini``, ``LICENSE``, ``docs/`` ...), so a packager can
   run the tests from it; the wheel carries the package, ``py.typed`` and the license, and its metadata version
   and license expression are the ones written in the sources.
4. A fresh virtual environment (``uv venv``) gets the wheel, torch and torchmetrics and nothing else. From an empty
   working directory and without ``PYTHONPATH`` (so no project source can be imported), it runs
   ``python -m torchmetrics_gradpatch --version``, ``status --json`` and ``check``, and the console script's
   ``--version``, and checks that the package was imported from that environment.

Needs ``build``, ``twine`` and ``uv`` (the wheel-smoke tox environment installs them). Exit status 0 when every
step passes; the first failure is reported with the command's output.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "torchmetrics_gradpatch"
DIST_NAME = "torchmetrics_gradpatch"  # normalised distribution name in artifact file names
#: tracked files a downstream packager does not need (the sdist is not a git checkout)
NOT_IN_SDIST = (".gitignore",)
#: run records (git-ignored, never shipped: MANIFEST.in prunes them)
RECORDS = ("results/", "benchmarks/.envs/")


def shipped(name: str) -> bool:
    """Whether a file belongs in the sdist (MANIFEST.in's rules, restated for the check)."""
    return name not in NOT_IN_SDIST and not name.startswith(RECORDS)


class CheckError(Exception):
    """A step failed; the message says which and shows its output."""


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise CheckError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def source_version() -> str:
    """``__version__`` as written in the package's ``__init__.py``: the one place the version lives."""
    tree = ast.parse((ROOT / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", None) == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise CheckError(f'{PACKAGE}/__init__.py has no `__version__ = "..."` string literal')


def tracked_files() -> list[str] | None:
    """Files git tracks (None outside a git checkout, e.g. in an unpacked sdist: then the check is skipped)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [name for name in out.split("\0") if name and (ROOT / name).is_file()]


def check_sdist(sdist: Path, version: str) -> None:
    with tarfile.open(sdist) as archive:
        prefix = f"{DIST_NAME}-{version}/"
        members = {m.name.removeprefix(prefix) for m in archive.getmembers() if m.isfile()}
    required = {"LICENSE", "README.md", "CHANGELOG.md", "tox.ini", "pyproject.toml", "tests/conftest.py"}
    tracked = tracked_files()
    if tracked is not None:
        required |= {name for name in tracked if shipped(name)}
    missing = sorted(required - members)
    if missing:
        raise CheckError(f"the sdist lacks {len(missing)} file(s) (add them to MANIFEST.in): {', '.join(missing)}")
    stray = sorted(m for m in members if "__pycache__" in m or not shipped(m))
    if stray:
        raise CheckError(f"the sdist carries build leftovers or run records: {', '.join(stray)}")
    print(f"sdist: {len(members)} files, every tracked file included" if tracked else f"sdist: {len(members)} files")


def check_wheel(wheel: Path, version: str) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"{DIST_NAME}-{version}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
    for needed in (f"{PACKAGE}/__init__.py", f"{PACKAGE}/py.typed", f"{info}/licenses/LICENSE"):
        if needed not in names:
            raise CheckError(f"the wheel lacks {needed}")
    if stray := sorted(n for n in names if not n.startswith((f"{PACKAGE}/", f"{info}/"))):
        raise CheckError(f"the wheel installs more than the package: {', '.join(stray)}")
    headers = dict(line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines() if ": " in line)
    if headers.get("Version") != version:
        raise CheckError(f"wheel metadata says version {headers.get('Version')}, the sources say {version}")
    if headers.get("License-Expression") != "Apache-2.0":
        raise CheckError(f"wheel metadata License-Expression is {headers.get('License-Expression')!r}")
    print(f"wheel: {len(names)} files, version {version}, License-Expression Apache-2.0")


def smoke(wheel: Path, version: str, torch: str, torchmetrics: str, work: Path) -> None:
    """Install the wheel into a fresh venv and run the CLI there, away from the sources."""
    uv = shutil.which("uv")
    if uv is None:
        raise CheckError("uv is not on PATH (the wheel-smoke tox environment installs it)")
    venv = work / "fresh-venv"
    shutil.rmtree(venv, ignore_errors=True)
    run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
    python = venv / "bin" / "python"
    run([uv, "pip", "install", "--quiet", "--python", str(python), str(wheel), f"torch=={torch}",
         f"torchmetrics=={torchmetrics}"])  # fmt: skip
    here = work / "empty-cwd"
    here.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    imported = run([str(python), "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"], cwd=here, env=env).strip()
    if not Path(imported).resolve().is_relative_to(venv.resolve()):
        raise CheckError(f"{PACKAGE} was imported from {imported}, not from the fresh environment {venv}")
    print(f"imported from {imported}")
    expected = f"torchmetrics-gradpatch {version}"
    for cmd in ([str(python), "-m", PACKAGE, "--version"], [str(venv / "bin" / "torchmetrics-gradpatch"), "--version"]):
        got = run(cmd, cwd=here, env=env).strip()
        if got != expected:
            raise CheckError(f"{' '.join(cmd)} printed {got!r}, expected {expected!r}")
        print(got)
    status = json.loads(run([str(python), "-m", PACKAGE, "status", "--json"], cwd=here, env=env))
    print(json.dumps(status, indent=2))
    print(run([str(python), "-m", PACKAGE, "check"], cwd=here, env=env, timeout=600))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", required=True, help="torch version for the fresh environment")
    parser.add_argument("--torchmetrics", required=True, help="torchmetrics version for the fresh environment")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one, removed after)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tmgp-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        version = source_version()
        dist = work / "dist"
        shutil.rmtree(dist, ignore_errors=True)
        installer = ["--installer", "uv"] if shutil.which("uv") else []
        run([sys.executable, "-m", "build", *installer, "--outdir", str(dist), str(ROOT)])
        sdist = dist / f"{DIST_NAME}-{version}.tar.gz"
        wheel = dist / f"{DIST_NAME}-{version}-py3-none-any.whl"
        for artifact in (sdist, wheel):
            if not artifact.is_file():
                raise CheckError(f"python -m build did not make {artifact.name} (made: {sorted(os.listdir(dist))})")
        print(run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)]))
        check_sdist(sdist, version)
        check_wheel(wheel, version)
        smoke(wheel, version, args.torch, args.torchmetrics, work)
    except CheckError as failure:
        print(f"check_dist: FAILED: {failure}", file=sys.stderr)
        return 1
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"check_dist: sdist and wheel of {version} pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
