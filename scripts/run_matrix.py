"""Run the compatibility matrix and print its table: pass or fail per torch x torchmetrics (x Python) environment.

    python scripts/run_matrix.py                     # every environment of `tox -m matrix`
    python scripts/run_matrix.py -e torch2.4-tm1.5   # some of them (-e again for more)
    python scripts/run_matrix.py --plan              # the environments grouped by torch version, as JSON

Each environment runs as its own ``tox -e ENV``, and its cell is what tox's exit status says: ``pass`` (0),
``FAIL`` (anything else), ``TIMEOUT`` (killed after ``--env-timeout`` seconds: a hang pytest-timeout cannot end),
or ``skipped`` (tox skipped it because its interpreter is missing; tox's own ``--result-json`` says so, and its
exit status is then 1). Progress goes to stderr; the markdown table goes to stdout. Nothing is written to disk.

Why one environment at a time: every torch version uv installs from PyPI brings 2-6 GB of CUDA wheels, and the
whole matrix cached at once needs about 58 GB. Environments run in order of their torch version, each version with
its own uv cache (``UV_CACHE_DIR``), deleted with the environment directories before the next version (``--keep``
keeps them): the peak is one torch version's footprint. ``--plan`` is what .github/workflows/matrix.yml fans out
on, one job per torch version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Env:
    name: str
    torch: str  #: "" for an environment without torch (lint, type)
    torchmetrics: str
    python: str


def tox_command() -> list[str]:
    return [sys.executable, "-m", "tox"] if shutil.which("tox") is None else ["tox"]


#: what ``tox config -k base_python set_env`` says about an environment
_SETTINGS = {
    "torch": r"^\s*TMGP_TORCH=(\S+)",
    "torchmetrics": r"^\s*TMGP_TORCHMETRICS=(\S+)",
    "python": r"^base_python = python(\S+)",
}


def environments(label: str, names: list[str]) -> list[Env]:
    """The selected environments with their torch, torchmetrics and Python versions, from ``tox config``."""
    selector = ["-e", ",".join(names)] if names else ["-m", label]
    out = subprocess.run(
        [*tox_command(), "config", *selector, "-k", "base_python", "set_env"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = []
    for block in re.split(r"^\[testenv:", out, flags=re.M)[1:]:
        setting = {key: re.search(pattern, block, flags=re.M) for key, pattern in _SETTINGS.items()}
        found.append(Env(block.split("]", 1)[0], **{key: m.group(1) if m else "" for key, m in setting.items()}))
    return sorted(found, key=lambda e: (not e.torch, *(Version(v or "0") for v in (e.torch, e.python, e.torchmetrics))))


def plan(label: str) -> list[dict[str, str]]:
    """The label's environments grouped by torch version ("none" for environments without torch)."""
    groups: dict[str, list[str]] = {}
    for env in environments(label, []):
        groups.setdefault(env.torch or "none", []).append(env.name)
    return [{"torch": torch, "envs": ",".join(names)} for torch, names in groups.items()]


def skipped(journal: Path, name: str) -> bool:
    """Whether tox skipped the environment (its interpreter is missing), from tox's own ``--result-json``."""
    try:
        return bool(json.loads(journal.read_text())["testenvs"][name]["result"].get("skipped"))
    except (OSError, ValueError, KeyError):
        return False


def run(env: Env, cache: Path, journal: Path, timeout: float) -> str:
    """``tox -e`` one environment in its own process group; its cell."""
    proc = subprocess.Popen(
        [*tox_command(), "-e", env.name, "--result-json", str(journal)],
        cwd=ROOT, env={**os.environ, "UV_CACHE_DIR": str(cache)}, stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: a timeout or an interrupt leaves no rank behind
    )  # fmt: skip
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "TIMEOUT"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode == 0:
        return "pass"
    return "skipped" if skipped(journal, env.name) else "FAIL"


def table(cells: dict[Env, str]) -> str:
    """A markdown table, one row per torch version and Python, one column per torchmetrics version; the other
    environments (lint, type, compile-full-torch2.15) listed after it."""
    grid = {env: cell for env, cell in cells.items() if re.fullmatch(r"(py[\d.]+-)?torch[\d.]+-tm[\d.]+", env.name)}
    columns = sorted({env.torchmetrics for env in grid}, key=Version)
    rows = sorted({(env.torch, env.python) for env in grid}, key=lambda row: (Version(row[0]), Version(row[1])))
    header = ["| torch | Python | " + " | ".join(f"torchmetrics {tm}" for tm in columns) + " |"]
    lines = [*header, "|---|---|" + "---|" * len(columns)] if grid else []
    for torch, python in rows:
        by_tm = {env.torchmetrics: cell for env, cell in grid.items() if (env.torch, env.python) == (torch, python)}
        lines.append(f"| {torch} | {python} | " + " | ".join(by_tm.get(tm, "") for tm in columns) + " |")
    others = [f"`{env.name}` {cell}" for env, cell in cells.items() if env not in grid]
    if others:
        lines += ["", "Other environments: " + ", ".join(others) + "."]
    return "\n".join(lines).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--label", default="matrix", help="tox label to run (default: matrix)")
    parser.add_argument("-e", "--env", action="append", default=[], help="run these environments instead")
    parser.add_argument("--env-timeout", type=float, default=1800, help="kill an environment after this many s")
    parser.add_argument("--keep", action="store_true", help="keep caches and environments (needs much more disk)")
    parser.add_argument("--plan", action="store_true", help="print the environments by torch version (JSON)")
    args = parser.parse_args()
    if args.plan:
        print(json.dumps(plan(args.label)))
        return 0

    envs = environments(args.label, args.env)
    work = Path(tempfile.mkdtemp(prefix="tmgp-matrix-"))
    print(f"{len(envs)} environments, uv caches under {work}", file=sys.stderr, flush=True)
    cells: dict[Env, str] = {}
    cache_of = ""
    try:
        for env in envs:
            if env.torch != cache_of and not args.keep:  # the previous torch version's cache is no longer needed
                shutil.rmtree(work / f"uv-cache-{cache_of or 'none'}", ignore_errors=True)
            cache_of = env.torch
            started = time.monotonic()
            try:
                cells[env] = run(env, work / f"uv-cache-{env.torch or 'none'}", work / "tox.json", args.env_timeout)
            finally:
                if not args.keep:
                    shutil.rmtree(ROOT / ".tox" / env.name, ignore_errors=True)
            print(f"== {env.name}: {cells[env]} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        if cells:
            print(table(cells))
    return 0 if all(cell in ("pass", "skipped") for cell in cells.values()) and len(cells) == len(envs) else 1


if __name__ == "__main__":
    sys.exit(main())
