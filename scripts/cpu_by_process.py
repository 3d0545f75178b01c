"""Where a command's CPU time goes, process by process: a sampler of ``/proc`` (Linux), and its report.

    python scripts/cpu_by_process.py record OUT.json -- bash .ci/run     # run a command, sample every process
    python scripts/cpu_by_process.py report OUT.json [--top 25]          # what the samples say

``record`` runs the command and, every 0.2 s until it ends, reads each new process's CPU time (user + system) from
``/proc/<pid>/stat``; the first time it sees a process it keeps the start of its command line, its parent and the
``TOX_ENV_NAME`` and ``PYTEST_CURRENT_TEST`` of its environment (a rank or a subprocess inherits the test that was
running when it started), and it notes whether the process has mapped ``libtorch_cpu`` (imported torch).
Processes that live less than one interval are missed (they cost less than 0.2 s each), and ``report`` then
misses their children too. A process's CPU is its own, not its children's, so the records add up without
counting anything twice.

``report`` adds up the records of the command's own processes (found through their parents) per tox
environment and per kind of process (a spawned rank, a pytest session, the CLI, torchrun, an example, the C++
compiler that inductor runs, other Python), and counts the processes that
imported torch: each of them paid for ``import torch`` once. The whole JSON is the artifact; docs/development.md
quotes its report.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

INTERVAL = 0.2
_ENV_KEYS = (b"TOX_ENV_NAME", b"PYTEST_CURRENT_TEST")
_COMPILERS = {"g++", "gcc", "cc1plus", "cc1", "collect2", "ld", "as"}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _first_sight(pid: int, ppid: int) -> dict[str, Any]:
    argv = [part.decode(errors="replace")[:160] for part in _read(f"/proc/{pid}/cmdline").split(b"\0")[:6]]
    env: dict[str, str] = {}
    try:
        for pair in _read(f"/proc/{pid}/environ").split(b"\0"):
            key, _, value = pair.partition(b"=")
            if key in _ENV_KEYS:
                env[key.decode()] = value.decode(errors="replace")
    except OSError:
        pass
    return {
        "pid": pid,
        "ppid": ppid,
        "argv": argv,
        "env": env.get("TOX_ENV_NAME"),
        "test": env.get("PYTEST_CURRENT_TEST"),
        "torch": False,
        "cpu_s": 0.0,
    }


def _stat(pid: int) -> tuple[int, int, int]:
    """A process's parent, CPU time in clock ticks (user + system) and start time, from ``/proc/<pid>/stat``."""
    stat = _read(f"/proc/{pid}/stat").decode()
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _existing() -> set[tuple[int, int]]:
    """The processes running now, as (pid, start time): their CPU is not the command's."""
    found = set()
    for pid in _pids():
        try:
            found.add((pid, _stat(pid)[2]))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _sample(seen: dict[tuple[int, int], dict[str, Any]], before: set[tuple[int, int]], me: int, ticks: int) -> None:
    for pid in _pids():
        if pid == me:
            continue
        try:
            ppid, cpu, start = _stat(pid)
            if (pid, start) in before:
                continue
            rec = seen.get((pid, start))
            if rec is None:
                rec = seen[(pid, start)] = _first_sight(pid, ppid)
            rec["cpu_s"] = cpu / ticks
            if not rec["torch"] and rec["cpu_s"] >= 0.3:
                rec["torch"] = b"libtorch_cpu" in _read(f"/proc/{pid}/maps")
        except (OSError, ValueError, IndexError):
            continue  # the process ended between the listing and the read


def record(out: Path, command: list[str]) -> int:
    ticks = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    before = _existing()  # processes already running (their CPU is not the command's)
    me = os.getpid()
    load_start = [round(v, 2) for v in os.getloadavg()]
    started = time.monotonic()
    proc = subprocess.Popen(command)
    try:
        while True:
            done = proc.poll() is not None
            _sample(seen, before, me, ticks)
            if done:
                break
            time.sleep(INTERVAL)
    except KeyboardInterrupt:  # the command got the same Ctrl-C: let it end, keep what was sampled
        proc.wait()
    records = [rec for rec in seen.values() if rec["argv"][0]]  # kernel threads have no command line
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    result = {
        "command": command,
        "pid": proc.pid,
        "commit": head.stdout.strip() or "unknown",  # of the directory the command ran in
        "exit": proc.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
        "interval_s": INTERVAL,
        "processes": records,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    return proc.returncode


def kind(argv: list[str]) -> str:
    """What a process is, from the start of its command line."""
    joined = " ".join(argv)
    program = Path(argv[0]).name if argv else ""
    if "spawn_main" in joined or "forkserver" in joined:
        return "rank (multiprocessing child)"
    if program == "uv":
        return "uv (installs)"
    if program in _COMPILERS:
        return "C++ compiler (inductor)"
    if "torchrun" in joined or "torch.distributed.run" in joined:
        return "torchrun agent"
    if "examples/" in joined:
        return "example under torchrun"
    if "pytest" in joined:
        return "pytest session"
    if program == "torchmetrics-gradpatch" or argv[1:3] == ["-m", "torchmetrics_gradpatch"]:
        return "CLI"
    if program.startswith("python"):
        return "other Python"
    return "other"


def _descendants(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The command's process and every process below it, found through the parents' pids."""
    procs = data["processes"]
    root = data["pid"]
    children: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for rec in procs:
        children[rec["ppid"]].append(rec)
    found, todo = [], [rec for rec in procs if rec["pid"] == root]
    while todo:
        rec = todo.pop()
        found.append(rec)
        todo.extend(children.get(rec["pid"], []))
    return found


def report(path: Path, top: int) -> None:
    data = json.loads(path.read_text())
    mine = _descendants(data)  # processes of others running meanwhile do not count
    records = [rec for rec in mine if rec["env"]]
    outside = [rec for rec in mine if not rec["env"]]
    total = sum(rec["cpu_s"] for rec in records)
    torch_procs = [rec for rec in records if rec["torch"]]
    print(f"command: {' '.join(data['command'])} (exit {data['exit']}), {data['wall_s']} s wall on {data['cpus']} CPUs")
    print(f"commit: {data['commit']}; load average at start {data['loadavg_start']}, at end {data['loadavg_end']}")
    if "conditions" in data:
        print(f"conditions: {data['conditions']}")
    print(f"CPU time of the tox environments' processes: {total:.0f} s in {len(records)} processes")
    print(f"processes that imported torch: {len(torch_procs)}, {sum(r['cpu_s'] for r in torch_procs):.0f} s of CPU")
    other = sum(rec["cpu_s"] for rec in outside)
    print(f"the command's processes outside any tox environment (tox itself, .ci/run's installs): {other:.0f} s of CPU")
    by_env: dict[str, float] = collections.defaultdict(float)
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    for rec in records:
        by_env[rec["env"]] += rec["cpu_s"]
        row = by_kind[kind(rec["argv"])]
        row[0] += 1
        row[1] += rec["cpu_s"]
        row[2] += rec["torch"]
    print("\nper kind of process: processes, of them imported torch, CPU s")
    for name, (count, cpu, with_torch) in sorted(by_kind.items(), key=lambda item: -item[1][1]):
        print(f"  {name:32s} {count:5d} {with_torch:5d} {cpu:8.1f}")
    print("\nper environment: CPU s")
    for env, cpu in sorted(by_env.items(), key=lambda item: -item[1])[:top]:
        print(f"  {env:32s} {cpu:8.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record", help="run a command and sample its processes")
    rec.add_argument("out", type=Path)
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report", help="summarise a recording")
    rep.add_argument("path", type=Path)
    rep.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if args.what == "record":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("record needs a command after --")
        return record(args.out, command)
    report(args.path, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
