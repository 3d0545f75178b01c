"""One job of ``bench_gather.py`` in a fresh interpreter: ``python benchmarks/_worker.py JOB JSON-ARGS``; prints JSON.

Run in this environment or in the second one (native torchmetrics, where the package need not be installed).
Jobs: ``gather`` (patched vs unpatched), ``shipped`` (the gather as the environment ships it) and ``memory``, on
spawned ranks; ``toggle`` in this process.

Every rank runs the same loops with the same fixed call counts: the number of collectives never depends on a
clock, so the ranks stay in lockstep. Timings are taken on every rank; the parent reports rank 0 (each gather
ends in a collective, so the ranks' times agree closely).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from typing import Any

import _ranks

#: name -> (shape for rank r, calls per timed block). Uneven: every rank a different number of rows.
CASES: dict[str, tuple[Any, int]] = {
    "scalar": (lambda r: (), 60),
    "1k": (lambda r: (1000,), 40),
    "64k": (lambda r: (65536,), 20),
    "1M": (lambda r: (1_000_000,), 4),
    "uneven": (lambda r: (4096 + 1000 * r, 16), 15),
}


def _block(gather: Any, tensor: Any, calls: int) -> float:
    """Seconds per call over ``calls`` back-to-back gathers."""
    start = time.perf_counter()
    for _ in range(calls):
        gather(tensor)
    return (time.perf_counter() - start) / calls


def patched_vs_unpatched(rounds: int, case_names: list[str]) -> dict[str, dict[str, list[float]]]:
    """torchmetrics' own gather, patch off (A) and on (B), interleaved A B B A A B ..., ``rounds`` blocks each."""
    import torch
    import torch.distributed as dist
    from torchmetrics.utilities.distributed import gather_all_tensors as gather

    import torchmetrics_gradpatch as tmgp

    warnings.simplefilter("ignore")  # torchmetrics < 1.6 warns at every uneven gather on torch >= 2.8
    rank = dist.get_rank()
    out: dict[str, dict[str, list[float]]] = {}
    for name in case_names:
        shape_of, calls = CASES[name]
        tensor = torch.randn(shape_of(rank))
        times: dict[str, list[float]] = {"unpatched": [], "patched": []}
        for warm in (tmgp.unpatch, tmgp.patch):
            warm()
            _block(gather, tensor, 2)
        for round_ in range(rounds):  # A B, then B A: neither mode always runs first
            for mode in ("unpatched", "patched")[:: 1 if round_ % 2 == 0 else -1]:
                (tmgp.patch if mode == "patched" else tmgp.unpatch)()
                times[mode].append(_block(gather, tensor, calls))
        out[name] = times
    tmgp.patch()
    return out


def as_shipped(rounds: int, case_names: list[str]) -> dict[str, Any]:
    """torchmetrics' gather as this environment ships it: patched by the import where the package is installed."""
    import torch
    import torch.distributed as dist
    import torchmetrics
    from torchmetrics.utilities.distributed import gather_all_tensors as gather

    try:
        import torchmetrics_gradpatch as tmgp

        shim = f"torchmetrics_gradpatch {tmgp.__version__}"
    except ImportError:  # the native environment needs no shim
        shim = "no torchmetrics_gradpatch"
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    out: dict[str, Any] = {"torchmetrics": torchmetrics.__version__, "shim": shim}
    for name in case_names:
        shape_of, calls = CASES[name]
        tensor = torch.randn(shape_of(rank))
        _block(gather, tensor, 2)
        out[name] = [_block(gather, tensor, calls) for _ in range(rounds)]
    return out


def toggle(rounds: int, toggles: int) -> dict[str, Any]:
    """``with patched(): pass`` against one scan of every loaded module's namespace, interleaved."""
    import torch  # noqa: F401 - the module set of a real program
    import torchmetrics  # noqa: F401
    from torchmetrics.utilities.distributed import gather_all_tensors as target

    import torchmetrics_gradpatch as tmgp

    def scan() -> int:
        found = 0
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if namespace is None:
                continue
            for value in list(namespace.values()):
                if value is target:
                    found += 1
        return found

    def blocks(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            with tmgp.patched():
                pass
        return (time.perf_counter() - start) / n

    out: dict[str, Any] = {
        "modules": len(sys.modules),
        "names": sum(len(getattr(m, "__dict__", {})) for m in list(sys.modules.values())),
    }
    # "swap": patch() off, so every block swaps __code__ in and out (the costly case);
    # "counted": patch() on, so a block only counts (the state after `import torchmetrics_gradpatch`).
    series: dict[str, list[float]] = {"scan": [], "swap": [], "counted": []}
    scan()
    for _ in range(rounds):
        tmgp.unpatch()
        series["swap"].append(blocks(toggles))
        start = time.perf_counter()
        scan()
        series["scan"].append(time.perf_counter() - start)
        tmgp.patch()
        series["counted"].append(blocks(toggles))
    out.update(series)
    return out


def main() -> None:
    job, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    if job == "gather":
        result: Any = _ranks.spawn_ranks(patched_vs_unpatched, args["world_size"], (args["rounds"], args["cases"]))[0]
    elif job == "shipped":
        result = _ranks.spawn_ranks(as_shipped, args["world_size"], (args["rounds"], args["cases"]))[0]
        import torch

        result["torch"] = torch.__version__
        result["torch_git"] = torch.version.git_version
    elif job == "memory":
        import _memory

        shape = (args["rounds"], args["rows"], args["cols"])
        result = _ranks.spawn_ranks(_memory.gather_memory, args["world_size"], shape)
    elif job == "toggle":
        result = toggle(args["rounds"], args["toggles"])
    else:
        raise SystemExit(f"unknown job {job!r}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
