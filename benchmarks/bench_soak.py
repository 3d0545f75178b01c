"""Soak: does anything grow over many gathers and Metric-loss steps? RSS and live tensors, sampled along the way.

    python benchmarks/bench_soak.py                      # 10,000 gathers, 1,000 steps per mode (several minutes)
    python benchmarks/bench_soak.py --gathers 600 --steps 120   # a smoke test (not written to results/)
    python benchmarks/bench_soak.py --update-docs                # also put the figures into docs/memory.md
    python benchmarks/bench_soak.py --docs-from benchmarks/results/soak/soak.json   # only the docs, from a run

Two spawned gloo ranks per gradient mode (``local``, ``global``), each a fresh pair of processes, and, as a
reference, ``unpatched``: torchmetrics' own gather with the patch off, gathers only (unpatched torchmetrics < 1.6
gives a Metric loss no graph, so its steps cannot run ``backward()``).

* **gathers**: torchmetrics' own ``gather_all_tensors`` (patched, in that mode) of a tensor that requires grad,
  cycling through a scalar, an even ``(64, 64)`` and an uneven ``(~240, 64)`` shape (rows differ per rank and
  per call), the result dropped before the next call without a backward (a global-mode node is built and
  thrown away).
* **steps**: a Metric used as a loss: a linear model's predictions go into a ``MeanSquaredError(
  dist_sync_on_step=True)`` (sum states: scalar gathers) and a cat-state metric with ``dist_sync_on_step=True``
  (per-rank batch sizes differ: uneven gathers); ``loss.backward()``, an SGD step, both metrics reset.

Every ``len // samples`` operations each rank records its RSS (``/proc/self/status``, once it has stopped
changing) and the number of ``torch.Tensor`` objects the garbage collector tracks, after ``gc.collect()``.
Verdict per mode, phase and rank, from the first sample after warm-up (10% of the run) to the last: the live
tensor count must not change and RSS must grow by less than ``--rss-bound`` MiB; the least-squares slope and
the growth over the second half of the run are reported beside it. Without ``--out`` the full run writes
``benchmarks/results/soak/soak.json`` and ``soak.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's src/ (the code measured) and benchmarks first

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._memory import live_tensors, settled_rss_kib  # noqa: E402
from benchmarks._pages import artifact_name, replace_region  # noqa: E402
from benchmarks._provenance import commit, load  # noqa: E402
from tests._workloads import LossSteps, run_phase  # noqa: E402 - the workload tests/test_leak.py checks
from tests._workloads import soak_gather_input as gather_input  # noqa: E402

MODES = ("local", "global", "unpatched")
WARMUP = 0.1  # the fraction of each phase before the baseline sample


def sample(done: int) -> dict[str, int]:
    gc.collect()
    rss, _ = settled_rss_kib()
    return {"done": done, "rss_kib": rss, "tensors": live_tensors()}


def soak_rank(mode: str, gathers: int, steps: int, samples: int) -> dict[str, Any]:
    """One rank's soak in ``mode``: the gather phase, then the Metric-loss phase (runs in a spawned rank)."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    import torchmetrics_gradpatch as tmgp

    warnings.simplefilter("ignore")  # torchmetrics < 1.6 warns at every uneven gather on torch >= 2.8
    if mode == "unpatched":
        tmgp.unpatch()
    else:
        tmgp.patch(mode)
    rank = dist.get_rank()
    torch.manual_seed(rank)
    started = time.monotonic()
    gather_samples = run_phase(lambda i: gather_all_tensors(gather_input(rank, i)), gathers, samples, sample)
    gather_seconds = time.monotonic() - started
    out: dict[str, Any] = {
        "rank": rank,
        "gathers": {"samples": gather_samples, "seconds": gather_seconds},
    }
    if mode != "unpatched":
        losses = LossSteps(rank)
        started = time.monotonic()
        out["steps"] = {
            "samples": run_phase(losses.step, steps, samples, sample),
            "seconds": time.monotonic() - started,
        }
    dist.barrier()
    tmgp.patch()
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def verdict(samples: list[dict[str, int]], per: int, unit: str, rss_bound_mib: float) -> dict[str, Any]:
    """Flat or not, from the first sample at or after the warm-up fraction to the last."""
    total = samples[-1]["done"]
    after = [s for s in samples if s["done"] >= WARMUP * total]
    first, last = after[0], after[-1]
    half = next(s for s in samples if s["done"] >= total / 2)
    second_half = (last["rss_kib"] - half["rss_kib"]) / 1024
    rss_growth = (last["rss_kib"] - first["rss_kib"]) / 1024
    tensor_growth = last["tensors"] - first["tensors"]
    rss_slope = slope([(s["done"], s["rss_kib"]) for s in after]) * per
    flat = tensor_growth == 0 and rss_growth < rss_bound_mib
    text = (
        f"from {first['done']} to {last['done']} {unit}: RSS {first['rss_kib'] / 1024:.1f} -> "
        f"{last['rss_kib'] / 1024:.1f} MiB ({rss_growth:+.1f} MiB, slope {rss_slope:+.1f} KiB per {per} {unit}, "
        "second half "
        f"{second_half:+.1f} MiB), "
        f"live tensors {first['tensors']} -> {last['tensors']} ({tensor_growth:+d}): "
        + ("flat" if flat else f"NOT FLAT (bound: no tensor growth, RSS growth < {rss_bound_mib} MiB)")
    )
    return {
        "from": first["done"],
        "to": last["done"],
        "rss_growth_mib": round(rss_growth, 2),
        "rss_slope_kib": round(rss_slope, 2),
        "rss_growth_second_half_mib": round(second_half, 2),
        "per": per,
        "tensor_growth": tensor_growth,
        "flat": flat,
        "verdict": text,
    }


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"Measured {m['when']} with `{results['command']}` at commit {results['commit']}: Python {m['python']}, "
        f"torch {m['torch']}, torchmetrics {m['torchmetrics']}, {m['cpus']} CPUs, load average at start "
        f"{', '.join(f'{v:.1f}' for v in m['loadavg'])} (end: {', '.join(f'{v:.1f}' for v in results['loadavg_end'])}"
        f"); {results['seconds']:.0f} s.",
        "",
        f"{results['gathers']} gathers and {results['steps']} Metric-loss steps (with backward) per gradient mode "
        "(unpatched, the reference: gathers only), 2 gloo ranks; RSS once settled and gc-tracked torch tensors "
        f"after gc.collect(), sampled {results['samples']} "
        "times per phase. A leak of one gathered uneven entry per call would add about "
        f"{results['leak_reference_mib']:.0f} MiB over the gather phase.",
        "",
    ]
    for mode in results["modes"]:
        for phase in ("gathers", "steps"):
            for rank in results["runs"][mode]:
                if phase in rank:
                    lines.append(f"- {mode}, {phase}, rank {rank['rank']}: {rank[phase]['verdict']['verdict']}")
    lines += [
        "",
        "Verdict: " + ("flat in every mode, phase and rank" if results["flat"] else "NOT FLAT (see above)"),
    ]
    return "\n".join(lines)


def docs_block(results: dict[str, Any], artifact: str) -> str:
    """The soak's figures for docs/memory.md: a table naming its artifact, without run details or verdict."""
    lines = [
        f"From `{artifact}` (its command, commit and machine load are stated there): {results['gathers']:,} gathers "
        f"and {results['steps']:,} Metric-loss steps with backward per gradient mode, 2 gloo ranks; unpatched "
        "torchmetrics' own gather as the reference. Growth is counted from the end of the warm-up (the first "
        "tenth of each phase) to the last sample.",
        "",
        "| mode | phase | rank | RSS growth | in the second half | live tensors |",
        "|------|-------|-----:|-----------:|-------------------:|-------------:|",
    ]
    for mode in results["modes"]:
        for phase in ("gathers", "steps"):
            for rank in results["runs"][mode]:
                if phase in rank:
                    samples = rank[phase]["samples"]  # the verdict's own arithmetic, unrounded, as in soak.md
                    total = samples[-1]["done"]
                    first = next(s for s in samples if s["done"] >= WARMUP * total)
                    half = next(s for s in samples if s["done"] >= total / 2)
                    growth, second = ((samples[-1]["rss_kib"] - s["rss_kib"]) / 1024 for s in (first, half))
                    lines.append(
                        f"| {mode} | {phase} | {rank['rank']} | {growth:+.1f} MiB | {second:+.1f} MiB | "
                        f"{first['tensors']} -> {samples[-1]['tensors']} |"
                    )
    return "\n".join(lines)  # the verdict against --rss-bound stays in soak.md


def update_docs(results: dict[str, Any], artifact: Path) -> None:
    """Put :func:`docs_block` between the ``soak`` markers of docs/memory.md."""
    page = ROOT / "docs" / "memory.md"
    if not replace_region(page, "soak", docs_block(results, artifact_name(artifact.with_suffix(".md")))):
        raise SystemExit(f"no soak markers in {page}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gathers", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=1_000)
    parser.add_argument("--samples", type=int, default=20, help="samples per phase")
    parser.add_argument(
        "--rss-bound",
        type=float,
        default=4.0,
        help="MiB of RSS growth after warm-up still 'flat'",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--update-docs", action="store_true", help="put the figures into docs/memory.md")
    parser.add_argument("--docs-from", type=Path, help="only put this saved soak.json's figures into docs/memory.md")
    parser.add_argument(
        "--out",
        type=Path,
        help="directory for soak.json/.md (default: results/soak for a full run)",
    )
    opts = parser.parse_args(argv)
    if opts.docs_from:
        update_docs(json.loads(opts.docs_from.read_text()), opts.docs_from)
        return 0
    full = (opts.gathers, opts.steps) == (10_000, 1_000)
    out_dir = opts.out or (HERE / "results" / "soak" if full else None)

    from benchmarks import (
        bench_soak,
    )  # this module by name, so the spawned ranks can unpickle soak_rank
    from torchmetrics_gradpatch.testing import spawn_ranks

    shown = [a for a in (sys.argv[1:] if argv is None else argv)]
    if "--out" in shown:
        del shown[shown.index("--out") : shown.index("--out") + 2]
    results: dict[str, Any] = {
        "command": " ".join(["python benchmarks/bench_soak.py", *shown]),
        "commit": commit(),
        "machine": {
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": load(),
            "torch": torch.__version__,
            "torchmetrics": __import__("torchmetrics").__version__,
        },
        "gathers": opts.gathers,
        "steps": opts.steps,
        "samples": opts.samples,
        "modes": opts.modes,
        "rss_bound_mib": opts.rss_bound,
        # the uneven entries average 200 + 37/2 + 22 rows of 64 float32; one in three calls is uneven
        "leak_reference_mib": opts.gathers * (1 - WARMUP) / 3 * (240 * 64 * 4) / 2**20,
        "runs": {},
    }
    started = time.monotonic()
    for mode in opts.modes:
        print(
            f"[{time.strftime('%H:%M:%S')}] {mode}: {opts.gathers} gathers, {opts.steps} steps",
            flush=True,
        )
        ranks = spawn_ranks(
            bench_soak.soak_rank,
            2,
            args=(mode, opts.gathers, opts.steps, opts.samples),
            timeout=3600,
        )
        for rank in ranks:
            for phase, count in (("gathers", opts.gathers), ("steps", opts.steps)):
                if phase in rank:
                    per = max(1, count // 10)
                    rank[phase]["verdict"] = verdict(rank[phase]["samples"], per, phase, opts.rss_bound)
        results["runs"][mode] = ranks
    results["seconds"] = round(time.monotonic() - started, 1)
    results["loadavg_end"] = load()
    results["flat"] = all(
        rank[phase]["verdict"]["flat"]
        for ranks in results["runs"].values()
        for rank in ranks
        for phase in ("gathers", "steps")
        if phase in rank
    )
    report = markdown(results)
    print(report)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "soak.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        (out_dir / "soak.md").write_text(report + "\n")
        print(f"wrote {out_dir / 'soak.json'} and soak.md")
    if opts.update_docs:
        if out_dir is None:
            raise SystemExit("--update-docs needs a written artifact: a full run or --out")
        update_docs(results, out_dir / "soak.json")
    return 0 if results["flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
