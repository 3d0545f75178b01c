"""The whole gather, patched against unpatched, and what surrounds it: the toggle, the import, memory.

    python benchmarks/bench_gather.py            # every section (about 5-8 minutes on 2 idle cores)
    python benchmarks/bench_gather.py --quick    # fewer rounds, for a smoke test
    python benchmarks/bench_gather.py --skip-native   # without the second environment (torchmetrics >= 1.6)

Every comparison is a ratio measured side by side in this one run, in rounds that alternate their order (A B, then
B A, so neither side always runs first), and reported as the median with its spread (25th-75th percentile of the
per-round ratios, min-max, and the 95% confidence interval of the median). Each target is checked against the
median and the verdict printed as measured: a missed target says MISSED.

* ``gather``: torchmetrics' own ``gather_all_tensors`` with the patch off (A) and on (B), on 2 and 3 spawned
  gloo ranks, for a scalar, 1k, 64k and 1M float32 elements and an uneven (rows differ per rank) shape.
  Target B/A <= 1.02.
* ``native``: torchmetrics 1.5.x patched (this environment) against native torchmetrics >= 1.6 on the same torch
  (a second environment, created by ``_envs.py``), whole runs alternated A B / B A. Target <= 1.02.
* ``toggle``: ``with patched(): pass`` against one scan of every loaded module's namespace (what freezegun
  does at each start). Target <= 1 %.
* ``import``: ``import torchmetrics_gradpatch`` against ``import torchmetrics``, fresh interpreters, the order of
  the three imports reversed every other round. Target <= 1.05.
* ``memory``: peak and retained RSS of a patched vs unpatched gather of a large uneven tensor, every round's
  readings reported (right after the call, and once gloo's worker thread has let go of the finished gather).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _envs
import _ranks
from _stats import spread

HERE = Path(__file__).resolve().parent

GATHER_CASES = ["scalar", "1k", "64k", "1M", "uneven"]
TARGET_GATHER = 1.02
TARGET_NATIVE = 1.02
TARGET_TOGGLE = 0.01
TARGET_IMPORT = 1.05


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def verdict(ratio: dict[str, float], target: float) -> dict[str, Any]:
    met = ratio["median"] <= target
    text = (
        f"median {ratio['median']:.3f} (IQR {ratio['p25']:.3f}-{ratio['p75']:.3f}, 95% CI of the median "
        f"{ratio['ci95_lo']:.3f}-{ratio['ci95_hi']:.3f}) vs target <= {target}: "
    )
    if met:
        text += "met"
    elif ratio["ci95_lo"] <= target:
        text += "MISSED (the median is above the target; its 95% CI reaches below it: not resolved at this n)"
    else:
        text += "MISSED"
    return {"target": target, "met": met, "verdict": text}


def worker(python: str | os.PathLike[str], job: str, args: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    """Run ``_worker.py JOB`` in ``python`` (its installed packages; ``benchmarks/`` first on its path); its result."""
    proc = subprocess.run(
        [str(python), str(HERE / "_worker.py"), job, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=1800,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {job} in {python} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


# ----------------------------------------------------------------------------------------------------------------


def paired(base: list[float], patched: list[float], base_label: str, target: float) -> dict[str, Any]:
    """Summaries of two interleaved series of seconds and of their per-round ratio patched / base."""
    ratio = spread([p / b for b, p in zip(base, patched, strict=True)])
    return {
        f"{base_label}_ms": spread([t * 1e3 for t in base]),
        "patched_ms": spread([t * 1e3 for t in patched]),
        "ratio": ratio,
        **verdict(ratio, target),
    }


def bench_gather(rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for world in (2, 3):
        log(f"gather: patched vs unpatched on {world} ranks, {rounds} interleaved rounds per size")
        raw = worker(sys.executable, "gather", {"world_size": world, "rounds": rounds, "cases": GATHER_CASES})
        out[f"world{world}"] = {
            name: paired(raw[name]["unpatched"], raw[name]["patched"], "unpatched", TARGET_GATHER)
            for name in GATHER_CASES
        }
    return out


def bench_native(rounds: int, per_run: int) -> dict[str, Any]:
    import torch

    native_python = _envs.ensure_native_env(importlib.metadata.version("torch"), log=log)
    probe_a, probe_b = _envs.probe(sys.executable), _envs.probe(native_python)
    log(f"native: {probe_a} (patched) vs {probe_b} (native), {rounds} alternated runs of 2 ranks")
    per_case: dict[str, dict[str, list[float]]] = {c: {"patched": [], "native": []} for c in GATHER_CASES}
    builds = {}
    sides = (("patched", sys.executable), ("native", native_python))
    for round_ in range(rounds):  # A B, then B A: neither environment always runs first
        for label, python in sides[:: 1 if round_ % 2 == 0 else -1]:
            raw = worker(python, "shipped", {"world_size": 2, "rounds": per_run, "cases": GATHER_CASES})
            builds[label] = {key: raw[key] for key in ("torch", "torch_git", "torchmetrics", "shim")}
            for name in GATHER_CASES:
                per_case[name][label].append(statistics.median(raw[name]))
    out: dict[str, Any] = {"environments": builds}
    out["same_torch_build"] = (builds["patched"]["torch"], builds["patched"]["torch_git"]) == (
        builds["native"]["torch"],
        builds["native"]["torch_git"],
    )
    out["this_torch"] = torch.__version__
    out["sizes"] = {
        name: paired(per_case[name]["native"], per_case[name]["patched"], "native", TARGET_NATIVE)
        for name in GATHER_CASES
    }
    return out


def bench_toggle(rounds: int, toggles: int) -> dict[str, Any]:
    log(f"toggle: with patched(): pass vs one module scan, {rounds} interleaved rounds")
    raw = worker(sys.executable, "toggle", {"rounds": rounds, "toggles": toggles})
    out: dict[str, Any] = {
        "modules": raw["modules"],
        "names": raw["names"],
        "scan_ms": spread([t * 1e3 for t in raw["scan"]]),
    }
    for kind in ("swap", "counted"):
        ratio = spread([blk / scan for blk, scan in zip(raw[kind], raw["scan"], strict=True)])
        out[kind] = {"block_us": spread([t * 1e6 for t in raw[kind]]), "ratio": ratio, **verdict(ratio, TARGET_TOGGLE)}
    return out


_IMPORT_SNIPPET = "import time; t = time.perf_counter(); {stmt}; print('SECONDS', time.perf_counter() - t)"
IMPORTS = {
    "torchmetrics": "import torchmetrics",
    "torchmetrics_gradpatch": "import torchmetrics_gradpatch",
    "torchmetrics_gradpatch+torchmetrics": "import torchmetrics_gradpatch, torchmetrics",
}


def bench_import(rounds: int) -> dict[str, Any]:
    log(f"import: fresh interpreters, {rounds} interleaved rounds of {len(IMPORTS)}")
    times: dict[str, list[float]] = {name: [] for name in IMPORTS}
    order = list(IMPORTS.items())
    for round_ in range(rounds + 1):  # the first round warms the page cache and is dropped
        for name, stmt in order[:: 1 if round_ % 2 == 0 else -1]:  # reversed every other round
            proc = subprocess.run(
                [sys.executable, "-c", _IMPORT_SNIPPET.format(stmt=stmt)],
                capture_output=True,
                text=True,
                cwd=HERE,  # `-c` puts the working directory first on sys.path: never the checkout's root
                check=True,
            )
            times[name].append(float(proc.stdout.split("SECONDS")[-1]))
    times = {name: values[1:] for name, values in times.items()}
    out: dict[str, Any] = {"seconds": {name: spread(values) for name, values in times.items()}}
    base = times["torchmetrics"]
    for name in ("torchmetrics_gradpatch", "torchmetrics_gradpatch+torchmetrics"):
        ratio = spread([t / b for t, b in zip(times[name], base, strict=True)])
        out[f"{name} / torchmetrics"] = {"ratio": ratio, **verdict(ratio, TARGET_IMPORT)}
    out["PYTHONDONTWRITEBYTECODE"] = os.environ.get("PYTHONDONTWRITEBYTECODE", "")
    return out


def bench_memory(rounds: int, rows: int, cols: int) -> dict[str, Any]:
    """Per rank and mode: every round's readings (``_memory.gather_memory``) and their medians; the verdict.

    The verdict compares what stays once gloo's worker thread has let go of the finished all_gather ("settled")
    and what the returned list keeps alive; the reading right after the call is reported beside them, round by
    round, because it may still include the gather's input and receive buffers (see ``benchmarks/_memory.py``).
    """
    log(f"memory: uneven gather of {rows}x{cols} float32 (rank 1: {rows - rows // 4} rows) on 2 ranks")
    # Every allocation above 1 MiB gets its own mmap, so a freed tensor leaves RSS at once.
    raw = worker(
        sys.executable,
        "memory",
        {"world_size": 2, "rounds": rounds, "rows": rows, "cols": cols},
        env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    keys = ("settled_mib", "held_by_result_mib", "immediate_mib", "peak_mib", "settle_ms")
    out: dict[str, Any] = {"ranks": []}
    for rank_raw in raw:
        info = rank_raw["tensor"]
        entry: dict[str, Any] = {"rank": info["rank"], "tensor_mib": info["mib"]}
        for mode in ("unpatched", "patched"):
            rounds_ = rank_raw[mode]
            entry[mode] = {key: spread([r[key] for r in rounds_]) for key in keys}
            entry[mode]["rounds"] = {key: [round(r[key], 1) for r in rounds_] for key in keys}
            entry[mode]["local_entry_is_callers_tensor"] = all(r["local_entry_is_callers_tensor"] for r in rounds_)
        a, b = entry["unpatched"], entry["patched"]
        entry["no_extra_copy_retained"] = (
            b["settled_mib"]["max"] <= a["settled_mib"]["min"] + 1.0
            and b["held_by_result_mib"]["max"] <= a["held_by_result_mib"]["min"]
        )

        def per_round(side: dict[str, Any], key: str) -> str:
            return "/".join(f"{v:.0f}" for v in side["rounds"][key])

        entry["verdict"] = (
            f"rank {info['rank']}: retained {b['settled_mib']['median']:.0f} MiB patched vs "
            f"{a['settled_mib']['median']:.0f} MiB unpatched (settled RSS, rounds {per_round(b, 'settled_mib')} vs "
            f"{per_round(a, 'settled_mib')}; held by the result {b['held_by_result_mib']['median']:.0f} vs "
            f"{a['held_by_result_mib']['median']:.0f}); right after the call {per_round(b, 'immediate_mib')} vs "
            f"{per_round(a, 'immediate_mib')}; peak {b['peak_mib']['median']:.0f} vs {a['peak_mib']['median']:.0f} "
            "MiB: "
            + ("no extra copy retained" if entry["no_extra_copy_retained"] else "MISSED: the patch retains more")
        )
        out["ranks"].append(entry)
    out["met"] = all(entry["no_extra_copy_retained"] for entry in out["ranks"])
    return out


# ----------------------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg": load,
        "torch": importlib.metadata.version("torch"),
        "torchmetrics": importlib.metadata.version("torchmetrics"),
        "package": _ranks.package(),
    }


def ratio_cell(size: dict[str, Any]) -> str:
    """``median [95% CI of the median]``, and whether the target was missed (and if noise could explain it)."""
    r = size["ratio"]
    cell = f"{r['median']:.3f} [{r['ci95_lo']:.2f}-{r['ci95_hi']:.2f}]"
    if size["met"]:
        return cell
    return cell + (" **missed** (CI reaches the target)" if r["ci95_lo"] <= size["target"] else " **missed**")


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"Measured {m['when']} with `{results['command']}`: Python "
        f"{m['python']}, torch {m['torch']}, "
        f"torchmetrics {m['torchmetrics']}, {m['package']}, {m['cpus']} CPUs, load average at start "
        f"{', '.join(f'{v:.1f}' for v in m['loadavg'] or [])} (end: "
        f"{', '.join(f'{v:.1f}' for v in results.get('loadavg_end') or [])}).",
        "",
    ]
    if "world2" in results.get("gather", {}):
        lines += [
            "| gather, patched / unpatched | scalar | 1k | 64k | 1M | uneven |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for world in ("world2", "world3"):
            sizes = results["gather"][world]
            cells = [ratio_cell(sizes[c]) for c in GATHER_CASES]
            lines.append(f"| {world[-1]} ranks | " + " | ".join(cells) + " |")
        ms = [f"{results['gather']['world2'][c]['unpatched_ms']['median']:.3f}" for c in GATHER_CASES]
        lines.append("| (2 ranks, unpatched ms) | " + " | ".join(ms) + " |")
        lines.append("")
    native = results.get("native", {})
    if "sizes" in native:
        env_a, env_b = native["environments"]["patched"], native["environments"]["native"]
        cells = [ratio_cell(native["sizes"][c]) for c in GATHER_CASES]
        lines += [
            "| patched 1.5.x / native | scalar | 1k | 64k | 1M | uneven |",
            "| --- | --- | --- | --- | --- | --- |",
            f"| 2 ranks, vs torchmetrics {env_b['torchmetrics']} | " + " | ".join(cells) + " |",
            "",
            f"Same torch build in both environments: {native['same_torch_build']} "
            f"({env_b['torch']}, {env_b['torch_git'][:10]}); patched side: {env_a['shim']}, native side: "
            f"{env_b['shim']}.",
            "",
        ]
    elif native:
        lines += [f"Native comparison: {native}", ""]
    toggle = results.get("toggle")
    if toggle:
        lines += [
            f"Toggle: one scan of {toggle['modules']} modules ({toggle['names']} names) takes "
            f"{toggle['scan_ms']['median']:.2f} ms; `with patched(): pass` takes "
            f"{toggle['swap']['block_us']['median']:.2f} µs when it swaps the code in and out "
            f"(ratio {toggle['swap']['ratio']['median']:.5f}: {'met' if toggle['swap']['met'] else 'MISSED'}) and "
            f"{toggle['counted']['block_us']['median']:.2f} µs when `patch()` is already on "
            f"(ratio {toggle['counted']['ratio']['median']:.5f}). Target <= 0.01.",
            "",
        ]
    imports = results.get("import")
    if imports:
        s = imports["seconds"]
        r1 = imports["torchmetrics_gradpatch / torchmetrics"]
        r2 = imports["torchmetrics_gradpatch+torchmetrics / torchmetrics"]
        lines += [
            f"Import (fresh interpreters, medians): `import torchmetrics` {s['torchmetrics']['median']:.3f} s, "
            f"`import torchmetrics_gradpatch` {s['torchmetrics_gradpatch']['median']:.3f} s "
            f"(ratio {r1['ratio']['median']:.3f}, IQR {r1['ratio']['p25']:.3f}-{r1['ratio']['p75']:.3f}: "
            f"{'met' if r1['met'] else 'MISSED'}), `import torchmetrics_gradpatch, torchmetrics` "
            f"{s['torchmetrics_gradpatch+torchmetrics']['median']:.3f} s (ratio {r2['ratio']['median']:.3f}, "
            f"IQR {r2['ratio']['p25']:.3f}-{r2['ratio']['p75']:.3f}: {'met' if r2['met'] else 'MISSED'}). "
            "Target <= 1.05.",
            "",
        ]
    memory = results.get("memory")
    if memory and "ranks" in memory:
        lines += ["Memory (uneven gather, 2 ranks, MiB above the settled RSS before it; medians, then rounds):", ""]
        lines += [f"- {entry['verdict']}" for entry in memory["ranks"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke test; figures are noisier)")
    parser.add_argument("--skip-native", action="store_true", help="skip the second-environment comparison")
    parser.add_argument("--only", nargs="*", help="run only these sections (gather native toggle import memory)")
    opts = parser.parse_args(argv)
    quick = opts.quick
    wanted = set(opts.only or ["gather", "native", "toggle", "import", "memory"])
    if opts.skip_native:
        wanted.discard("native")

    command = " ".join(["python benchmarks/bench_gather.py", *(sys.argv[1:] if argv is None else argv)])
    results: dict[str, Any] = {"command": command, "machine": machine()}
    started = time.monotonic()
    sections = {
        "gather": lambda: bench_gather(rounds=8 if quick else 80),
        "native": lambda: bench_native(rounds=2 if quick else 6, per_run=5 if quick else 9),
        "toggle": lambda: bench_toggle(rounds=10 if quick else 40, toggles=2000),
        "import": lambda: bench_import(rounds=3 if quick else 12),
        "memory": lambda: bench_memory(rounds=2 if quick else 5, rows=65536, cols=256),
    }
    for name, run in sections.items():
        if name not in wanted:
            continue
        try:
            results[name] = run()
        except Exception as err:  # a broken section is reported, the others still run
            log(f"{name} FAILED: {err}")
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    results["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    results["seconds"] = round(time.monotonic() - started, 1)
    print(markdown(results))
    log(f"done in {results['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
