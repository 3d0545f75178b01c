"""Soak: does anything grow over many gathers and Metric-loss steps? RSS and live tensors, sampled along the way.

    python benchmarks/bench_soak.py                      # 10,000 gathers, 1,000 steps per mode (several minutes)
    python benchmarks/bench_soak.py --gathers 600 --steps 120   # a smoke test

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

The workload and the sampling are ``soak_workload.py``'s, which ``tests/test_leak.py`` runs briefly.

Every ``len // samples`` operations each rank records its RSS (``/proc/self/status``, once it has stopped
changing) and the number of ``torch.Tensor`` objects the garbage collector tracks, after ``gc.collect()``.
Verdict per mode, phase and rank, from the first sample after warm-up (10% of the run) to the last: the live
tensor count must not change and RSS must grow by less than ``--rss-bound`` MiB; the least-squares slope and
the growth over the second half of the run are reported beside it. Exit status 1 when something is not flat.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings
from typing import Any

import _ranks
import torch
import torch.distributed as dist
from soak_workload import LossSteps, run_phase, settled_sample
from soak_workload import soak_gather_input as gather_input

MODES = ("local", "global", "unpatched")
WARMUP = 0.1  # the fraction of each phase before the baseline sample


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
    gather_samples = run_phase(lambda i: gather_all_tensors(gather_input(rank, i)), gathers, samples, settled_sample)
    gather_seconds = time.monotonic() - started
    out: dict[str, Any] = {
        "rank": rank,
        "gathers": {"samples": gather_samples, "seconds": gather_seconds},
    }
    if mode != "unpatched":
        losses = LossSteps(rank)
        started = time.monotonic()
        out["steps"] = {
            "samples": run_phase(losses.step, steps, samples, settled_sample),
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
        f"Measured {m['when']} with `{results['command']}`: Python {m['python']}, "
        f"torch {m['torch']}, torchmetrics {m['torchmetrics']}, {m['package']}, {m['cpus']} CPUs, "
        "load average at start "
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


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


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
    opts = parser.parse_args(argv)

    shown = list(sys.argv[1:] if argv is None else argv)
    results: dict[str, Any] = {
        "command": " ".join(["python benchmarks/bench_soak.py", *shown]),
        "machine": {
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": load(),
            "torch": torch.__version__,
            "torchmetrics": __import__("torchmetrics").__version__,
            "package": _ranks.package(),
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
        ranks = _ranks.spawn_ranks(soak_rank, 2, (mode, opts.gathers, opts.steps, opts.samples), timeout=3600)
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
    print(markdown(results))
    return 0 if results["flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
