"""What starting a gloo rank costs when it imports torch itself (spawn) against forking it from a server that
imported torch once (forkserver with torch preloaded), as ratios in one run.

    python benchmarks/bench_rank_start.py [--rounds 10] [--world-size 2] [--json out.json] [--text out.txt]

Each round starts one world of ``--world-size`` ranks with each start method, in A B / B A order from round to
round. A rank joins a gloo group (through a TCP store the parent hosts on a kernel-chosen port), passes a
barrier, reports the CPU time its own process used (user + system, so a spawned rank counts its interpreter's
start and ``import torch``, a forked one only what it did after the fork), leaves the group and exits. Reported
per method: the wall time from the first start to the last exit, and the CPU per rank; and the ratios
forkserver / spawn of their medians. The forkserver's own start (one ``import torch``, paid once per parent
process) is reported apart: the CPU of a fresh interpreter that imports torch and torch.distributed.

This is what :func:`torchmetrics_gradpatch.testing.spawn_ranks` and the warm pool would gain per start from a
preloaded server; docs/development.md says why they spawn.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: this checkout's benchmarks package importable
    sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from benchmarks._provenance import commit, load
from benchmarks._stats import spread

METHODS = ("spawn", "forkserver")


def _rank(rank: int, world_size: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.barrier()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.send(usage.ru_utime + usage.ru_stime)
    dist.destroy_process_group()


def start_world(context: Any, world_size: int) -> tuple[float, list[float]]:
    """Wall seconds from the first start to the last exit, and each rank's own CPU seconds."""
    import torch.distributed as dist

    # hosted here on port 0 and kept bound while the ranks run, so no other process can take the port first
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    port = store.port
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    started = time.perf_counter()
    procs = [context.Process(target=_rank, args=(r, world_size, port, pipes[r][1])) for r in range(world_size)]
    for proc in procs:
        proc.start()
    cpu = [pipes[r][0].recv() for r in range(world_size)]
    for proc in procs:
        proc.join(60)
        if proc.exitcode != 0:
            raise RuntimeError(f"a rank exited with {proc.exitcode}")
    del store
    return time.perf_counter() - started, cpu


def import_cost() -> float:
    """CPU seconds of a fresh interpreter importing torch and torch.distributed (the forkserver's one start)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "import torch, torch.distributed"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def measure(rounds: int, world_size: int) -> dict[str, Any]:
    contexts = {"spawn": multiprocessing.get_context("spawn"), "forkserver": multiprocessing.get_context("forkserver")}
    contexts["forkserver"].set_forkserver_preload(["torch", "torch.distributed"])
    start_world(contexts["forkserver"], world_size)  # starts the server; its cost is measured apart below
    walls: dict[str, list[float]] = {m: [] for m in METHODS}
    cpus: dict[str, list[float]] = {m: [] for m in METHODS}
    for round_ in range(rounds):
        for method in METHODS if round_ % 2 == 0 else METHODS[::-1]:
            wall, cpu = start_world(contexts[method], world_size)
            walls[method].append(wall)
            cpus[method].append(statistics.mean(cpu))
    server = [import_cost() for _ in range(3)]
    return {
        "wall_s": {m: spread(walls[m]) for m in METHODS},
        "cpu_per_rank_s": {m: spread(cpus[m]) for m in METHODS},
        "ratio_wall": statistics.median(walls["forkserver"]) / statistics.median(walls["spawn"]),
        "ratio_cpu_per_rank": statistics.median(cpus["forkserver"]) / statistics.median(cpus["spawn"]),
        "forkserver_start_cpu_s": statistics.median(server),
    }


def render(result: dict[str, Any]) -> str:
    wall, cpu = result["wall_s"], result["cpu_per_rank_s"]
    lines = [
        f"command: {result['command']}",
        f"commit: {result['commit']}; {result['machine']['cpus']} CPUs; torch {result['torch']}; load average at "
        f"start {result['loadavg_start']}, at end {result['loadavg_end']}",
        f"{result['world_size']} gloo ranks per world, {result['rounds']} rounds, A B / B A",
        "",
        f"{'start method':24s} {'wall per world (s)':>20s} {'CPU per rank (s)':>18s}",
    ]
    for method in METHODS:
        lines.append(f"{method:24s} {wall[method]['median']:20.3f} {cpu[method]['median']:18.3f}")
    lines += [
        "",
        f"forkserver / spawn: wall {result['ratio_wall']:.3f}, CPU per rank {result['ratio_cpu_per_rank']:.3f}",
        f"the forkserver's own start (once per parent process): {result['forkserver_start_cpu_s']:.3f} s of CPU",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--text", type=Path)
    args = parser.parse_args()
    import torch

    started = {"loadavg": load(), "commit": commit()}
    result = {
        "command": " ".join(["python", "benchmarks/bench_rank_start.py", *sys.argv[1:]]),
        "commit": started["commit"],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "torch": torch.__version__,
        "rounds": args.rounds,
        "world_size": args.world_size,
        "loadavg_start": started["loadavg"],
        **measure(args.rounds, args.world_size),
        "loadavg_end": load(),
    }
    text = render(result)
    print(text, end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.text:
        args.text.parent.mkdir(parents=True, exist_ok=True)
        args.text.write_text(text)


if __name__ == "__main__":
    main()
