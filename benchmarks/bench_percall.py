"""What the package adds to one gather call, in µs, measured side by side in one run.

    python benchmarks/bench_percall.py                   # 41 rounds, one rank and two ranks; prints the tables
    python benchmarks/bench_percall.py --rounds 81 --skip-two-ranks
    python benchmarks/bench_percall.py --quick           # a smoke test of the script (figures mean nothing)

The targets (patched - unpatched <= 2 µs, trampoline + dispatch <= 1 µs, and patched - unpatched <= 0.5 µs with
the collectives stubbed, per call, on one rank) are judged in the printed report.

**One rank** (a spawned world-size-1 gloo group): the collectives are as cheap as they get,
so what the package adds in Python is not buried under another rank's scheduling. Each round times one block of
back-to-back calls per series, the series in an order that rotates from round to round and reverses every other
round (no series always runs first or after the same neighbour). Series, for a float32 scalar and 1,000 elements:

* ``unpatched``: torchmetrics' ``gather_all_tensors`` with the patch off (torchmetrics' own code);
* ``patched``: the same function with the patch in force, local mode (trampoline, dispatch, the package's gather);
* ``direct``: the package's local gather, :func:`torchmetrics_gradpatch._gather.gather_local`, called directly;
* ``noop_through`` / ``noop_direct``: a gather that only returns ``[result]`` put behind the trampoline, and the
  same no-op called directly: their difference is the trampoline and dispatch alone, without a collective's noise;
* ``stubbed_unpatched`` / ``stubbed_patched``: ``unpatched`` and ``patched`` with ``dist.barrier`` and
  ``dist.all_gather`` stubbed alike: everything the patch adds in Python, the gather's own work included;
* ``local_fwd`` / ``global_fwd``: torchmetrics' function, patched, in local and in global mode, on a tensor that
  requires grad (global mode builds its autograd node): the global mode's forward cost.

Reported per call: the median of each series and, for each difference (patched - unpatched, patched - direct,
noop_through - noop_direct, global_fwd - local_fwd, stubbed_patched - stubbed_unpatched), the median of the
per-round differences with its 95% confidence interval (distribution-free, ``benchmarks/_stats.py``).

**Two ranks** (spawned, gloo on loopback): in a world of one every rank has the same shape, so the uneven path
(shapes differ: pad, gather, trim) needs a second rank. The same series (without the no-op pair) for a scalar,
1,000 elements on both ranks (equal) and 1,000 / 1,100 elements (uneven), the ranks starting each block together.
Reported from rank 0: wall time per call, and the calling thread's CPU time per call (``time.thread_time``; what
the Python code costs, without the wait for the other rank, which dominates the wall time and its noise).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import _ranks
from _stats import spread

ONE_RANK_CASES = {"scalar": (), "1k": (1000,)}
#: name -> shape of rank r's tensor
TWO_RANK_CASES: dict[str, Callable[[int], tuple[int, ...]]] = {
    "scalar": lambda r: (),
    "1k": lambda r: (1000,),
    "1k uneven": lambda r: (1000 + 100 * r,),
}
GATHER_SERIES = ("unpatched", "patched", "direct")
MODE_SERIES = ("local_fwd", "global_fwd")
NOOP_SERIES = ("noop_through", "noop_direct")
STUBBED_SERIES = ("stubbed_unpatched", "stubbed_patched")
#: (label, minuend, subtrahend), all in µs per call
DIFFERENCES = (
    ("patched - unpatched", "patched", "unpatched"),
    ("patched - direct (trampoline + dispatch, real gather)", "patched", "direct"),
    ("direct - unpatched (the package's gather vs torchmetrics')", "direct", "unpatched"),
    ("trampoline + dispatch (no-op gather behind it)", "noop_through", "noop_direct"),
    ("global mode forward - local mode", "global_fwd", "local_fwd"),
    ("patched - unpatched, collectives stubbed", "stubbed_patched", "stubbed_unpatched"),
)
TARGET_PATCHED_US = 2.0
TARGET_TRAMPOLINE_US = 1.0
TARGET_STUBBED_US = 0.5


def _order(names: tuple[str, ...], round_: int) -> list[str]:
    """``names`` rotated by the round number, reversed every other round."""
    shift = round_ % len(names)
    rotated = list(names[shift:] + names[:shift])
    return rotated[::-1] if round_ % 2 else rotated


@contextmanager
def _stubbed_collectives() -> Iterator[None]:
    """``dist.barrier`` and ``dist.all_gather`` as no-ops, for both arms alike: what is left is the Python each
    gather runs around its collectives, without a collective's noise (the results are not used)."""
    import torch.distributed as dist

    saved = dist.barrier, dist.all_gather
    dist.barrier = lambda *args, **kwargs: None
    dist.all_gather = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.barrier, dist.all_gather = saved


@contextmanager
def _noop_behind_trampoline(noop: Callable[..., Any]) -> Iterator[None]:
    """Put ``noop`` where the trampoline's dispatch finds the local-mode gather (benchmark-only seam)."""
    from torchmetrics_gradpatch import _engine, _modes

    table = getattr(_modes, "GATHERS", None)
    if table is not None:  # this package: dispatch calls the gather the engine chose from _modes.GATHERS
        saved = table["local"]
        table["local"] = noop
        _engine.refresh()
        try:
            yield
        finally:
            table["local"] = saved
            _engine.refresh()
    else:  # before the per-call work: dispatch looked up _engine.gather_all_tensors at every call
        saved = _engine.gather_all_tensors  # type: ignore[attr-defined]
        _engine.gather_all_tensors = noop  # type: ignore[attr-defined]
        try:
            yield
        finally:
            _engine.gather_all_tensors = saved  # type: ignore[attr-defined]


def _series_callables(tensor: Any, graph_tensor: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """name -> (set the state up, one call)."""
    from torchmetrics.utilities.distributed import gather_all_tensors as through

    import torchmetrics_gradpatch as tmgp
    from torchmetrics_gradpatch._gather import gather_local

    return {
        "unpatched": (lambda: tmgp.unpatch(), lambda: through(tensor)),
        "patched": (lambda: tmgp.patch("local"), lambda: through(tensor)),
        "direct": (lambda: tmgp.patch("local"), lambda: gather_local(tensor)),
        "local_fwd": (lambda: tmgp.patch("local"), lambda: through(graph_tensor)),
        "global_fwd": (lambda: tmgp.patch("global"), lambda: through(graph_tensor)),
    }


def _timed_block(call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Wall and calling-thread CPU seconds per call over ``calls`` back-to-back calls."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        call()
    return (time.perf_counter() - wall) / calls, (time.thread_time() - cpu) / calls


def _measure(series: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], rounds: int, calls: int, sync: Any) -> Any:
    names = tuple(series)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        setup, call = series[name]
        setup()
        _timed_block(call, max(1, calls // 10))
    for round_ in range(rounds):
        for name in _order(names, round_):
            setup, call = series[name]
            setup()
            sync()
            w, c = _timed_block(call, calls)
            wall[name].append(w * 1e6)
            cpu[name].append(c * 1e6)
    return wall, cpu


def _one_rank_main(rounds: int, calls: int) -> dict[str, Any]:
    """What the one spawned rank runs; µs per call, per case and series."""
    import torch
    import torchmetrics.utilities.distributed  # noqa: F401 - the patch lands when torchmetrics is imported

    import torchmetrics_gradpatch as tmgp
    from torchmetrics_gradpatch import _engine

    out: dict[str, Any] = {}
    tmgp.patch("local")
    if not _engine.installed():
        raise RuntimeError("the patch installs nothing here (native torchmetrics): nothing to measure")
    for case, shape in ONE_RANK_CASES.items():
        tensor = torch.randn(shape)
        graph_tensor = torch.randn(shape, requires_grad=True)
        series = _series_callables(tensor, graph_tensor)

        def noop(result: Any, group: Any = None, **kwargs: Any) -> list[Any]:
            return [result]

        series["noop_through"] = (lambda: tmgp.patch("local"), series["patched"][1])
        series["noop_direct"] = (lambda: tmgp.patch("local"), lambda t=tensor: noop(t))
        gathers = {k: v for k, v in series.items() if k not in NOOP_SERIES}
        wall, _ = _measure(gathers, rounds, calls, sync=lambda: None)
        with _noop_behind_trampoline(noop):
            if series["patched"][1]()[0] is not tensor:
                raise RuntimeError("the no-op is not behind the trampoline")
            noops = {k: series[k] for k in NOOP_SERIES}
            noop_wall, _ = _measure(noops, rounds, calls * 10, sync=lambda: None)
        wall.update(noop_wall)
        stubbed = {f"stubbed_{k}": series[k] for k in ("unpatched", "patched")}
        with _stubbed_collectives():
            stubbed_wall, _ = _measure(stubbed, rounds, calls * 10, sync=lambda: None)
        wall.update(stubbed_wall)
        out[case] = _summarise(wall)
        out[case]["calls_per_block"] = {"gathers": calls, "noop": calls * 10}
    tmgp.patch()
    return out


def one_rank(rounds: int, calls: int) -> dict[str, Any]:
    """The one-rank section: a spawned world-size-1 gloo group."""
    return _ranks.spawn_ranks(_one_rank_main, 1, (rounds, calls))[0]  # type: ignore[no-any-return]


def _two_rank_main(rounds: int, calls: int) -> dict[str, Any]:
    """What each spawned rank runs; returns its wall and thread-CPU series per case."""
    import torch
    import torch.distributed as dist

    import torchmetrics_gradpatch as tmgp

    warnings.simplefilter("ignore")  # torchmetrics < 1.6 warns at every uneven gather on torch >= 2.8
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for case, shape_of in TWO_RANK_CASES.items():
        tensor = torch.randn(shape_of(rank))
        graph_tensor = torch.randn(shape_of(rank), requires_grad=True)
        wall, cpu = _measure(_series_callables(tensor, graph_tensor), rounds, calls, sync=dist.barrier)
        out[case] = {"wall": wall, "cpu": cpu}
    tmgp.patch()
    return out


def two_ranks(rounds: int, calls: int) -> dict[str, Any]:
    raw = _ranks.spawn_ranks(_two_rank_main, 2, (rounds, calls))[0]
    out: dict[str, Any] = {}
    for case, measured in raw.items():
        out[case] = {"wall": _summarise(measured["wall"]), "cpu": _summarise(measured["cpu"])}
        out[case]["calls_per_block"] = calls
    return out


def _summarise(series: dict[str, list[float]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"us": {name: spread(values) for name, values in series.items()}, "difference_us": {}}
    for label, a, b in DIFFERENCES:
        if a in series and b in series:
            summary["difference_us"][label] = spread([x - y for x, y in zip(series[a], series[b], strict=True)])
    return summary


# --- the artifact ---------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import importlib.metadata

    return {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
        "torch": importlib.metadata.version("torch"),
        "torchmetrics": importlib.metadata.version("torchmetrics"),
        "package": _ranks.package(),
    }


def _interval(stats: dict[str, float], digits: int = 2) -> str:
    return f"{stats['median']:.{digits}f} [{stats['ci95_lo']:.{digits}f} to {stats['ci95_hi']:.{digits}f}]"


def _verdict(stats: dict[str, float], target: float) -> str:
    if stats["ci95_hi"] <= target:
        return f"met (<= {target:g}: the whole interval)"
    if stats["median"] <= target:
        return f"median met (<= {target:g}); the interval reaches above it"
    return f"MISSED (> {target:g})"


def _two_rank_cell(two: dict[str, Any], case: str, row: str) -> str:
    """A two-rank table cell: wall / CPU median, or their differences' intervals for a difference row."""
    wall, cpu = two[case]["wall"], two[case]["cpu"]
    if row in wall["us"]:
        return f"{wall['us'][row]['median']:.1f} / {cpu['us'][row]['median']:.1f}"
    return _interval(wall["difference_us"][row], 1) + " / " + _interval(cpu["difference_us"][row], 1)


def _table(title: str, cases: list[str], rows: list[str], cell: Callable[[str, str], str]) -> list[str]:
    """A markdown table under ``title``: one row per name in ``rows``, one column per case, ``cell(case, row)``."""
    lines = [title, "", "| µs per call | " + " | ".join(cases) + " |", "| --- |" + " --- |" * len(cases)]
    lines += [f"| {row} | " + " | ".join(cell(case, row) for case in cases) + " |" for row in rows]
    return [*lines, ""]


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    load = ", ".join(f"{v:.2f}" for v in m["loadavg_start"])
    load_end = ", ".join(f"{v:.2f}" for v in results["loadavg_end"])
    lines = [
        f"Measured {m['when']} with `{results['command']}`: Python {m['python']}, "
        f"torch {m['torch']}, torchmetrics {m['torchmetrics']}, {m['package']}, {m['cpus']} CPUs, "
        f"load average at start {load} "
        f"(end: {load_end}). µs per call: medians, and for differences the median of the per-round differences "
        "[95% confidence interval].",
        "",
    ]
    one = results.get("one_rank")
    if one:
        first = next(iter(one.values()))

        def one_cell(case: str, row: str) -> str:
            if row in one[case]["us"]:
                return f"{one[case]['us'][row]['median']:.2f}"
            return _interval(one[case]["difference_us"][row])

        lines += _table(
            f"One rank (world-size-1 gloo group, {results['rounds']} rounds of {first['calls_per_block']['gathers']} "
            f"calls per series; the no-op pair {first['calls_per_block']['noop']} calls):",
            list(one),
            [*GATHER_SERIES, *MODE_SERIES, *NOOP_SERIES, *STUBBED_SERIES, *(label for label, _, _ in DIFFERENCES)],
            one_cell,
        )
        for case, entry in one.items():
            patched = entry["difference_us"]["patched - unpatched"]
            trampoline = entry["difference_us"]["trampoline + dispatch (no-op gather behind it)"]
            stubbed = entry["difference_us"]["patched - unpatched, collectives stubbed"]
            lines.append(
                f"- {case}: patched - unpatched {_interval(patched)} µs: {_verdict(patched, TARGET_PATCHED_US)}; "
                f"trampoline + dispatch {_interval(trampoline, 3)} µs: {_verdict(trampoline, TARGET_TRAMPOLINE_US)}; "
                f"with the collectives stubbed {_interval(stubbed, 3)} µs: {_verdict(stubbed, TARGET_STUBBED_US)}"
            )
        lines.append("")
    two = results.get("two_ranks")
    if two:
        first = next(iter(two.values()))

        two_cell = functools.partial(_two_rank_cell, two)

        lines += _table(
            f"Two ranks (spawned, gloo on loopback, rank 0, {results['two_rank_rounds']} rounds of "
            f"{first['calls_per_block']} calls per series): wall time / calling thread's CPU time",
            list(two),
            [
                *GATHER_SERIES,
                *MODE_SERIES,
                *(label for label, _, _ in DIFFERENCES if label in first["wall"]["difference_us"]),
            ],
            two_cell,
        )
        for case, entry in two.items():
            cpu, wall = entry["cpu"]["difference_us"], entry["wall"]["difference_us"]
            lines.append(
                f"- {case}: patched - unpatched, calling thread's CPU time {_interval(cpu['patched - unpatched'], 1)} "
                f"µs (wall time {_interval(wall['patched - unpatched'], 1)} µs); global mode forward - local mode, "
                f"CPU time {_interval(cpu['global mode forward - local mode'], 1)} µs (wall time "
                f"{_interval(wall['global mode forward - local mode'], 1)} µs)"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=41, help="rounds of the one-rank section (default 41)")
    parser.add_argument("--calls", type=int, default=1500, help="calls per one-rank block (default 1500)")
    parser.add_argument("--two-rank-rounds", type=int, default=41, help="rounds of the two-rank section")
    parser.add_argument("--two-rank-calls", type=int, default=150, help="calls per two-rank block (default 150)")
    parser.add_argument("--skip-two-ranks", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 rounds of few calls")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.rounds, opts.calls, opts.two_rank_rounds, opts.two_rank_calls = 3, 50, 3, 10
    shown = list(sys.argv[1:] if argv is None else argv)
    results: dict[str, Any] = {
        "command": " ".join(["python benchmarks/bench_percall.py", *shown]),
        "machine": machine(),
        "rounds": opts.rounds,
        "two_rank_rounds": opts.two_rank_rounds,
    }
    results["one_rank"] = one_rank(opts.rounds, opts.calls)
    if not opts.skip_two_ranks:
        results["two_ranks"] = two_ranks(opts.two_rank_rounds, opts.two_rank_calls)
    results["loadavg_end"] = list(os.getloadavg())
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
