"""Run tox environments one after another in bounded disk, recording what happened to each.

    python scripts/run_matrix.py              # every environment of `tox -m matrix`
    python scripts/run_matrix.py -m ci        # another label
    python scripts/run_matrix.py -e torch2.4-tm1.5 -e lint
    python scripts/run_matrix.py --plan       # the label's environments grouped by torch version, as JSON
    python scripts/run_matrix.py --merge DIR [DIR ...] --label matrix   # results of parallel runs -> results/raw

Why: every torch version that uv installs from PyPI brings its CUDA wheels (2-6 GB in uv's cache); the whole
matrix cached at once needs about 58 GB. Here environments run in order of their torch version, sharing one uv
cache (``UV_CACHE_DIR``) per torch version; when the next environment needs another torch, the previous cache and
environment directories are deleted. The peak is then one torch version's footprint.

Per environment it writes ``results/raw/<env>.run.json``: tox's exit code, the stage that failed ("install" when
an install command failed: the cell is "not installable"), wall time and peak disk (uv cache plus environment
directory, sampled every 2 s). The test outcome itself is in ``results/raw/<env>.json`` (written by the pytest
hook in tests/conftest.py). ``results/raw/run.json`` describes the whole run. Then ``scripts/compat_table.py``
turns these into the compatibility table.

Parallel runs (.github/workflows/matrix.yml): ``--plan`` prints the label's environments grouped by torch version
(``[{"torch": "2.4.1", "envs": "torch2.4-tm1.5,..."}, ...]``), one job runs each group with ``-e``, and
``--merge`` copies the jobs' ``results/raw`` files into one ``results/raw`` with a ``run.json`` that describes
them together: every environment, started at the earliest job's start, the longest job's wall time (the jobs ran
side by side; the sum is kept as ``jobs_wall_min_total``) and the largest peak disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "results" / "raw"


def tox_command() -> list[str]:
    return [sys.executable, "-m", "tox"] if shutil.which("tox") is None else ["tox"]


def environments(label: str | None, names: list[str]) -> list[tuple[str, str]]:
    """(env name, torch version or "") for the selected environments, from `tox config`."""
    selector = ["-e", ",".join(names)] if names else ["-m", label or "matrix"]
    out = subprocess.run(
        [*tox_command(), "config", *selector, "-k", "set_env", "deps"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found: list[tuple[str, str]] = []
    for block in re.split(r"^\[testenv:", out, flags=re.M)[1:]:
        name = block.split("]", 1)[0]
        torch = re.search(r"TMGP_TORCH=(\S+)", block) or re.search(r"^\s*torch==(\S+)", block, flags=re.M)
        found.append((name, torch.group(1) if torch else ""))
    return found


def plan(label: str) -> list[dict[str, str]]:
    """The label's environments grouped by torch version ("none" for environments without torch), in version order."""
    groups: dict[str, list[str]] = {}
    for env, torch in environments(label, []):
        groups.setdefault(torch or "none", []).append(env)
    order = sorted(groups, key=lambda torch: (torch == "none", Version("0" if torch == "none" else torch)))
    return [{"torch": torch, "envs": ",".join(groups[torch])} for torch in order]


def git_commit() -> str | None:
    """The commit the environments ran on (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


def merge(dirs: list[Path], label: str | None) -> dict[str, object]:
    """Copy the result files of parallel runs (each a results/raw directory with its run.json) into RAW."""
    runs = []
    for directory in dirs:
        run_file = directory / "run.json"
        if not run_file.exists():
            raise SystemExit(f"{directory} has no run.json: not a results/raw directory of scripts/run_matrix.py")
        runs.append(json.loads(run_file.read_text()))
    RAW.mkdir(parents=True, exist_ok=True)
    for stale in RAW.glob("*.json"):
        stale.unlink()
    for directory in dirs:
        for result in directory.glob("*.json"):
            if result.name != "run.json":
                shutil.copy2(result, RAW / result.name)
    commits = sorted({str(run["commit"]) for run in runs if run.get("commit")})
    summary: dict[str, object] = {
        "command": f"python scripts/run_matrix.py in {len(runs)} parallel jobs (--plan, one -e group per job)",
        "label": label,
        "started_at": min(str(run["started_at"]) for run in runs),
        "finished": all(run.get("finished") for run in runs),
        "wall_min": max(float(run["wall_min"]) for run in runs),
        "jobs_wall_min_total": round(sum(float(run["wall_min"]) for run in runs), 1),
        "peak_disk_gb": max(float(run["peak_disk_gb"]) for run in runs),
        **(
            {"loadavg_start": runs[0]["loadavg_start"], "loadavg_end": runs[-1]["loadavg_end"]}
            if all("loadavg_start" in run for run in runs)
            else {}
        ),
        "environments": [env for run in runs for env in run["environments"]],
        "completed": [env for run in runs for env in run["completed"]],
        "host": runs[0].get("host", {}),
        "commit": commits[0] if len(commits) == 1 else commits,
        "jobs": len(runs),
    }
    (RAW / "run.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def du_kb(*paths: Path) -> int:
    """Disk use of ``paths`` together (hard links counted once), in KiB."""
    existing = [str(p) for p in paths if p.exists()]
    if not existing:
        return 0
    out = subprocess.run(["du", "-sk", *existing], capture_output=True, text=True, check=False).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if line.strip())


class PeakSampler(threading.Thread):
    def __init__(self, *paths: Path) -> None:
        super().__init__(daemon=True)
        self.paths, self.peak_kb, self._done = paths, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak_kb = max(self.peak_kb, du_kb(*self.paths))
            self._done.wait(2)

    def stop(self) -> int:
        self._done.set()
        self.join()
        self.peak_kb = max(self.peak_kb, du_kb(*self.paths))
        return self.peak_kb


def skipped(journal: Path, env: str) -> bool:
    """Whether tox skipped the environment (its interpreter is missing), from tox's --result-json."""
    try:
        return bool(json.loads(journal.read_text())["testenvs"][env]["result"].get("skipped"))
    except (OSError, ValueError, KeyError):
        return False


def failed_stage(journal: Path, env: str) -> str | None:
    """Which stage failed, from tox's --result-json: "install" (setup commands) or "test"; None if unknown."""
    try:
        data = json.loads(journal.read_text())["testenvs"][env]
    except (OSError, ValueError, KeyError):
        return None
    for stage in ("setup", "test"):
        if any(entry.get("retcode", 0) != 0 for entry in data.get(stage, [])):
            return "install" if stage == "setup" else "test"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--label", default="matrix", help="tox label to run (default: matrix)")
    parser.add_argument("-e", "--env", action="append", default=[], help="run these environments instead")
    parser.add_argument("--env-timeout", type=float, default=1800, help="kill an environment after this many s")
    parser.add_argument("--keep", action="store_true", help="keep caches and environments (needs much more disk)")
    parser.add_argument("--plan", action="store_true", help="print the label's environments by torch version (JSON)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR", help="merge parallel runs' results into RAW")
    args = parser.parse_args()
    if args.plan:
        print(json.dumps(plan(args.label)))
        return 0
    if args.merge:
        print(json.dumps(merge(args.merge, args.label), indent=2))
        return 0

    # grouped by torch version (one uv cache each); environments without torch last
    envs = sorted(environments(args.label, args.env), key=lambda item: (not item[1], Version(item[1] or "0")))
    RAW.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tmgp-matrix-"))
    started, wall0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.monotonic()
    run_peak, cache, cache_torch, failures = 0, None, None, 0
    command = "python scripts/run_matrix.py " + " ".join(sys.argv[1:])
    print(f"{len(envs)} environments, uv caches under {work}", flush=True)
    done: list[str] = []
    commit = git_commit()
    load_start = os.getloadavg()

    def write_summary(finished: bool) -> dict[str, object]:
        summary = {
            "command": command.strip(),
            "label": None if args.env else args.label,
            "started_at": started,
            "finished": finished,
            "wall_min": round((time.monotonic() - wall0) / 60, 1),
            "peak_disk_gb": round(run_peak / 2**20, 2),
            "loadavg_start": load_start,  # the page quotes duration and disk only with the load they ran under
            "loadavg_end": os.getloadavg(),
            "environments": [env for env, _ in envs],
            "completed": list(done),
            "commit": commit,
            "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
        }
        (RAW / "run.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    finished = False
    try:
        for env, torch in envs:
            if cache is None or torch != cache_torch:
                if cache is not None and not args.keep:
                    shutil.rmtree(cache, ignore_errors=True)
                cache, cache_torch = work / f"uv-cache-{torch or 'none'}", torch
            env_dir = ROOT / ".tox" / env
            for stale in (RAW / f"{env}.json", RAW / f"{env}.run.json"):
                stale.unlink(missing_ok=True)
            journal = work / f"{env}.tox.json"
            sampler = PeakSampler(cache, env_dir, ROOT / ".tox" / ".pkg")
            sampler.start()
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [*tox_command(), "-e", env, "--result-json", str(journal)],
                cwd=ROOT, env={**os.environ, "UV_CACHE_DIR": str(cache)}, stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, so an interrupted run leaves no rank behind
            )  # fmt: skip
            hung = False
            try:
                proc.wait(timeout=args.env_timeout)
            except subprocess.TimeoutExpired:  # a deadlock pytest-timeout cannot interrupt (e.g. inside C code)
                hung = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            wall = time.monotonic() - t0
            peak = sampler.stop()
            run_peak = max(run_peak, peak)
            skip = skipped(journal, env)  # tox exits 1 when every selected environment was skipped
            returncode = 0 if skip else proc.returncode
            stage = "timeout" if hung else failed_stage(journal, env) if returncode else None
            record = {
                "env": env,
                "tox_exit": returncode,
                "skipped": skip,
                "failed_stage": stage,
                "wall_s": round(wall, 1),
                "peak_disk_gb": round(peak / 2**20, 2),
            }
            (RAW / f"{env}.run.json").write_text(json.dumps(record, indent=2) + "\n")
            failures += returncode != 0
            state = "skipped" if skip else stage or "ok"
            print(f"== {env}: exit {returncode} ({state}), {wall:.0f} s, peak {peak / 2**20:.1f} GB", flush=True)
            if not args.keep:
                shutil.rmtree(env_dir, ignore_errors=True)
            done.append(env)
            write_summary(finished=False)
        finished = True
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if len(done) < len(envs):  # interrupted: the environment that was running
                shutil.rmtree(ROOT / ".tox" / envs[len(done)][0], ignore_errors=True)
        print(json.dumps(write_summary(finished), indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
