"""What torch.compile support costs the eager hot path: per-call differences, measured side by side in one run.

    python benchmarks/bench_compile.py [--rounds 41] [--calls 20000]

The support is one call of torch's ``is_compiling`` check in ``_engine.dispatch``, the trampoline's path
(dynamo folds it to ``True`` and takes a graph break into ``torch.compiler.disable``; in eager mode it returns
``False``). Series, in rounds that rotate their order, in one spawned process (a world-size-1 gloo group):

* ``dispatch_with_check`` / ``dispatch_without_check``: ``_engine.dispatch`` as shipped, and the same
  function without the check (built from its source), both in front of a gather that returns ``[result]``: the
  difference is the check's cost per call, nothing else;
* ``disable_wrapper`` / ``plain_call``: that no-op gather called through ``torch.compiler.disable`` and directly:
  what the check saves compared with wrapping every call;
* ``gather_with_check`` / ``gather_without_check``: the same two functions in front of the real local gather in a
  one-rank gloo group (barrier and collectives included), so the check can be read against a real gather's noise.

Reported: per-call medians in ns, the median per-round difference with its 95% confidence interval, and the
machine load at start and end.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import _ranks
from _stats import spread


def _without_check(engine: Any) -> Callable[..., Any]:
    """``_engine.dispatch`` without its torch.compile branch (the ``is_compiling()`` test and the one line under it),
    in the same module namespace."""
    source = textwrap.dedent(inspect.getsource(engine.dispatch))
    lines = source.splitlines()
    tests = [i for i, line in enumerate(lines) if "is_compiling()" in line]
    if len(tests) != 1 or not lines[tests[0]].lstrip().startswith("if "):
        raise SystemExit("bench_compile: expected exactly one `if ...is_compiling():` line in _engine.dispatch")
    test = tests[0]
    depth = len(lines[test]) - len(lines[test].lstrip())
    body = lines[test + 1] if test + 1 < len(lines) else ""
    following = lines[test + 2] if test + 2 < len(lines) else ""
    if len(body) - len(body.lstrip()) <= depth or len(following) - len(following.lstrip()) > depth:
        raise SystemExit("bench_compile: expected the torch.compile branch in _engine.dispatch to be one line")
    kept = lines[:test] + lines[test + 2 :]
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(kept), engine.__file__, "exec"), engine.__dict__, namespace)
    return namespace["dispatch"]  # type: ignore[no-any-return]


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e9


def measure(rounds: int, calls: int) -> dict[str, Any]:
    """What the one spawned rank runs (a world-size-1 gloo group): every series, per call."""
    import torch

    from torchmetrics_gradpatch import _compile, _engine
    from torchmetrics_gradpatch._gather import gather_local as real_local

    x = torch.ones(())
    state = _engine._state
    without = _without_check(_engine)
    shipped = _engine.dispatch
    saved = state.gather, state.is_compiling
    state.is_compiling = _compile.is_compiling_function()

    def noop(result: Any, group: Any = None) -> list[Any]:
        return [result]

    disabled = torch.compiler.disable(noop)
    series: dict[str, list[float]] = {
        name: []
        for name in (
            "dispatch_with_check",
            "dispatch_without_check",
            "disable_wrapper",
            "plain_call",
            "gather_with_check",
            "gather_without_check",
        )
    }
    pairs = [
        ("dispatch_with_check", "dispatch_without_check", lambda: shipped(x), lambda: without(x), True),
        ("disable_wrapper", "plain_call", lambda: disabled(x), lambda: noop(x), False),
        ("gather_with_check", "gather_without_check", lambda: shipped(x), lambda: without(x), False),
    ]
    gather_calls = max(1, calls // 50)
    for round_ in range(rounds + 1):  # round 0 is a warm-up, discarded
        for a, b, fa, fb, use_noop in pairs:
            n = calls if use_noop or a == "disable_wrapper" else gather_calls
            state.gather = noop if use_noop else real_local
            try:
                order = [(a, fa), (b, fb)] if round_ % 2 == 0 else [(b, fb), (a, fa)]
                for name, fn in order:
                    value = _per_call(fn, n)
                    if round_:
                        series[name].append(value)
            finally:
                state.gather, state.is_compiling = saved[0], _compile.is_compiling_function()
    state.gather, state.is_compiling = saved
    found = _compile.is_compiling_function()
    out: dict[str, Any] = {"is_compiling": f"{found.__module__}.{found.__qualname__}"}
    for name, values in series.items():
        out[name] = spread(values)
    for a, b, *_ in pairs:
        out[f"{a} - {b}"] = spread([p - q for p, q in zip(series[a], series[b], strict=True)])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    import torch

    load_start = os.getloadavg()
    results = _ranks.spawn_ranks(measure, 1, (args.rounds, args.calls))[0]
    load_end = os.getloadavg()
    command = "python benchmarks/bench_compile.py " + " ".join(sys.argv[1:])
    record = {
        "command": command.strip(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "package": _ranks.package(),
        "load_start": [round(v, 2) for v in load_start],
        "load_end": [round(v, 2) for v in load_end],
        "rounds": args.rounds,
        "calls": args.calls,
        "results": results,
    }
    lines = [
        "# torch.compile support: eager cost per call",
        "",
        f"Command: `{record['command']}`; torch {record['torch']}, Python "
        f"{record['python']}, {record['package']}, {record['cpus']} CPUs; load average (1, 5, 15 min) at start "
        f"{record['load_start']}, at end {record['load_end']}. {args.rounds} rounds, order alternating.",
        "",
        "| series | median ns per call | 95% CI of the median |",
        "|---|---|---|",
    ]
    for name, value in results.items():
        if isinstance(value, dict):
            lines.append(f"| {name} | {value['median']:.0f} | {value['ci95_lo']:.0f} to {value['ci95_hi']:.0f} |")
    lines += ["", f"`is_compiling` is `{results['is_compiling']}`."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
