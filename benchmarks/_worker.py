"""One benchmark job in a fresh interpreter: ``python benchmarks/_worker.py JOB JSON-ARGS``; prints JSON.

Run by ``bench_gather.py`` in this environment or in the second (native torchmetrics) one, with the repository
root on ``PYTHONPATH``. Jobs: ``gather`` (patched vs unpatched, spawned ranks), ``shipped`` (the gather as
the environment ships it, spawned ranks), ``memory`` (spawned ranks) and ``toggle`` (in-process).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _spawn(fn: Any, world_size: int, args: tuple[Any, ...]) -> list[Any]:
    from tests.harness import spawn_ranks

    return spawn_ranks(fn, world_size, args=args, timeout=900)


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
    from benchmarks import _ranks

    if job == "gather":
        result: Any = _spawn(_ranks.patched_vs_unpatched, args["world_size"], (args["rounds"], args["cases"]))[0]
    elif job == "shipped":
        result = _spawn(_ranks.as_shipped, args["world_size"], (args["rounds"], args["cases"]))[0]
        import torch

        result["torch"] = torch.__version__
        result["torch_git"] = torch.version.git_version
    elif job == "memory":
        from benchmarks import _memory

        result = _spawn(_memory.gather_memory, args["world_size"], (args["rounds"], args["rows"], args["cols"]))
    elif job == "toggle":
        result = toggle(args["rounds"], args["toggles"])
    else:
        raise SystemExit(f"unknown job {job!r}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
