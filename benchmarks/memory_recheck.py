"""Re-check the memory section, and show when the gather's buffers actually leave RSS.

    python benchmarks/memory_recheck.py alone --repeat 3    # run_all.py --only memory, 3 times
    python benchmarks/memory_recheck.py after-gather        # run_all.py --only gather memory --quick
    python benchmarks/memory_recheck.py timing --rounds 15  # RSS after a gather, by what happens in between

Each run writes ``benchmarks/results/memory-recheck/<what>[-<i>].json`` and ``.md`` (replacing an earlier run's),
stating the command, the commit and the load average at start and end.

``timing`` answers why a reading right after a gather can show the gather's input and receive buffers (192 MiB
here, patched or not) although nothing of the package holds them (``benchmarks/_memory.py`` explains gloo's
worker thread and the barrier's weak reference): per round and mode it gathers and reads RSS right away, after
one barrier, after three barriers, after 20 ms without a collective, and after a barrier then 20 ms. It also
holds the all_gather's work handle (``async_op=True``) after dropping every tensor: the RSS it keeps is the
padded input plus every receive buffer.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE.parent)]  # this checkout's src/ and benchmarks first

from benchmarks import run_all  # noqa: E402
from benchmarks._memory import rss_kib  # noqa: E402
from benchmarks._provenance import commit, load  # noqa: E402

OUT = HERE / "results" / "memory-recheck"
ROWS, COLS = 65536, 256  # the memory section's tensor: 64 MiB on rank 0, 48 MiB on rank 1


def timing_rank(rounds: int) -> dict[str, Any]:
    """Runs in a spawned rank: MiB above the RSS before the gather, per condition, mode and round."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812
    from torchmetrics.utilities.distributed import gather_all_tensors as gather

    import torchmetrics_gradpatch as tmgp

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    x = torch.randn(ROWS - rank * (ROWS // 4), COLS)
    conditions = {
        "right after": lambda: None,
        "after 1 barrier": dist.barrier,
        "after 3 barriers": lambda: [dist.barrier() for _ in range(3)],
        "after 20 ms, no collective": lambda: time.sleep(0.02),
        "after 1 barrier and 20 ms": lambda: (dist.barrier(), time.sleep(0.02)),
    }
    out: dict[str, list[float]] = collections.defaultdict(list)
    for warm in (tmgp.unpatch, tmgp.patch):
        warm()
        del_me = gather(x)
        del del_me
    for _ in range(rounds):
        for mode in ("unpatched", "patched"):
            (tmgp.patch if mode == "patched" else tmgp.unpatch)()
            for name, between in conditions.items():
                gc.collect()
                dist.barrier()
                time.sleep(0.1)
                before = rss_kib()
                result = gather(x)
                between()
                out[f"{mode}, {name}"].append(round((rss_kib() - before) / 1024))
                del result
        # the work handle of a plain all_gather, kept after every tensor was dropped
        dist.barrier()
        time.sleep(0.1)
        before = rss_kib()
        padded = F.pad(x, (0, 0, 0, rank * (ROWS // 4)))
        buffers = [torch.zeros_like(padded) for _ in range(dist.get_world_size())]
        work = dist.all_gather(buffers, padded, async_op=True)
        work.wait()
        del padded, buffers
        time.sleep(0.1)
        out["all_gather work handle kept, tensors dropped, 100 ms"].append(round((rss_kib() - before) / 1024))
        del work
        time.sleep(0.1)
        out["all_gather work handle dropped, 100 ms"].append(round((rss_kib() - before) / 1024))
    tmgp.patch()
    return {"rank": rank, "mib": dict(out)}


def header(command: str, started: dict[str, Any]) -> dict[str, Any]:
    return {"command": command, "commit": commit(), **started}


def start() -> dict[str, Any]:
    return {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "loadavg": load()}


def write(name: str, results: dict[str, Any], lines: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {OUT / name}.json and .md")


def recheck(what: str, index: int | None, shown: str) -> None:
    """run_all.py's memory section (after the quick gather section for ``after-gather``), saved with its commit."""
    sections = ["memory"] if what == "alone" else ["gather", "memory"]
    args = ["--only", *sections] + (["--quick"] if what == "after-gather" else [])
    started = start()
    with tempfile.TemporaryDirectory() as tmp:
        run_all.main([*args, "--out", tmp])
        results = json.loads((Path(tmp) / "latest.json").read_text())
        report = (Path(tmp) / "latest.md").read_text().rstrip("\n")
    results.update(header("python benchmarks/run_all.py " + " ".join(args), started))
    name = what + ("" if index is None else f"-{index}")
    run = "" if index is None else f"run {index} of "
    write(name, results, [f"At commit {results['commit']}, {run}`{shown}`:", "", report])


def timing(rounds: int) -> None:
    from torchmetrics_gradpatch.testing import spawn_ranks

    started = start()
    env_before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # as the memory section: a freed tensor leaves RSS at once
    try:
        from benchmarks import memory_recheck

        ranks = spawn_ranks(memory_recheck.timing_rank, 2, args=(rounds,), timeout=1800)
    finally:
        if env_before is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = env_before
    results = header(f"python benchmarks/memory_recheck.py timing --rounds {rounds}", started)
    results.update({"loadavg_end": load(), "rounds": rounds, "ranks": ranks})
    lines = [
        f"Measured {results['when']} with `{results['command']}` at commit {results['commit']}, load average at "
        f"start {results['loadavg']} (end: {results['loadavg_end']}). Uneven gather of {ROWS}x{COLS} float32 "
        "(rank 1: 3/4 of the rows), 2 gloo ranks; MiB of RSS above the reading before the gather, counted over "
        f"{rounds} rounds (value: rounds).",
        "",
    ]
    for rank in ranks:
        lines.append(f"Rank {rank['rank']}:")
        for name, values in rank["mib"].items():
            counts = ", ".join(f"{v}: {n}" for v, n in sorted(collections.Counter(values).items()))
            lines.append(f"- {name}: {counts}")
        lines.append("")
    write("timing", results, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["alone", "after-gather", "timing"])
    parser.add_argument("--repeat", type=int, default=1, help="runs of alone/after-gather")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of timing")
    opts = parser.parse_args(argv)
    if opts.what == "timing":
        timing(opts.rounds)
    else:
        for index in range(opts.repeat):
            shown = " ".join(["python benchmarks/memory_recheck.py", *(sys.argv[1:] if argv is None else argv)])
            recheck(opts.what, index + 1 if opts.repeat > 1 else None, shown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
