"""One benchmark job in a fresh interpreter: ``python benchmarks/_worker.py JOB JSON-ARGS``; prints JSON.

Run by ``run_all.py`` in this environment or in the second (native torchmetrics) one, with the repository
root on ``PYTHONPATH``. Jobs: ``gather`` (patched vs unpatched, spawned ranks), ``shipped`` (the gather as
the environment ships it, spawned ranks), ``memory`` (spawned ranks), ``toggle`` and ``trampoline``
(in-process).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _spawn(fn: Any, world_size: int, args: tuple[Any, ...]) -> list[Any]:
    from torchmetrics_gradpatch.testing import spawn_ranks

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


def trampoline(rounds: int, calls: int) -> dict[str, Any]:
    """The trampoline's own cost per call, in a one-rank gloo group (no other rank adds noise).

    ``through``: torchmetrics' ``gather_all_tensors`` with the patch in force (local mode), i.e. the trampoline,
    ``dispatch`` and the package's local gather; ``direct``: that same local gather called directly. Their
    difference is what the trampoline and ``dispatch`` add to a real gather. The ``noop_*`` series repeat both
    with a gather that only returns ``[result]`` put behind the trampoline and called directly, so the
    difference is the trampoline's own cost without a collective's noise. Rounds alternate A B / B A.
    """
    import torch
    import torch.distributed as dist
    from torchmetrics.utilities.distributed import gather_all_tensors as through

    import torchmetrics_gradpatch as tmgp
    from torchmetrics_gradpatch import _engine, _gather

    direct = getattr(_gather, "gather_local", None) or _gather.gather_all_tensors  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tmgp.patch("local")
    if not _engine.installed():
        raise SystemExit("trampoline: the patch installs nothing here (native torchmetrics): nothing to measure")
    x = torch.ones(())
    if through(x)[0] is not x or direct(x)[0] is not x:
        raise SystemExit("trampoline: the local entry is not the caller's tensor")

    def noop(result: Any, group: Any = None, **kwargs: Any) -> list[Any]:
        return [result]

    def block(fn: Any) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        return (time.perf_counter() - start) / calls

    real = _engine.gather_all_tensors  # what dispatch calls, looked up at every call
    series: dict[str, list[float]] = {"through": [], "direct": [], "noop_through": [], "noop_direct": []}
    for name in ("through", "direct"):  # warm-up
        block(through if name == "through" else direct)
    for round_ in range(rounds):
        for name in ("through", "direct")[:: 1 if round_ % 2 == 0 else -1]:
            series[name].append(block(through if name == "through" else direct))
        _engine.gather_all_tensors = noop
        try:
            for name in ("noop_through", "noop_direct")[:: 1 if round_ % 2 == 0 else -1]:
                series[name].append(block(through if name == "noop_through" else noop))
        finally:
            _engine.gather_all_tensors = real
    dist.barrier()
    dist.destroy_process_group()
    return {"calls": calls, **series}


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
    elif job == "trampoline":
        result = trampoline(args["rounds"], args["calls"])
    else:
        raise SystemExit(f"unknown job {job!r}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
