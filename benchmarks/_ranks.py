"""Start benchmark ranks: ``spawn_ranks(fn, world_size, args, timeout)`` runs ``fn(*args)`` on ``world_size``
spawned gloo ranks and returns what each returned, in rank order. The benchmarks' one way to start ranks.

* Ranks are started by ``torch.multiprocessing.start_processes`` (spawn). Each joins a gloo group through a
  ``FileStore`` in a fresh temporary directory (no port to pick), with one intra-op thread, runs ``fn`` and writes
  its return value (which must pickle) to a file there.
* ``fn`` is a module-level function of the benchmark script or of a module beside it: the rank imports it by name.
* A rank that raises ends the run: the others are stopped and torch's ``ProcessRaisedException`` carries that
  rank's traceback. Past ``timeout`` seconds every rank still alive is killed and ``TimeoutError`` raised. No rank
  outlives the call.

A benchmark runs as a script (``python benchmarks/bench_x.py``): Python puts ``benchmarks/`` first on ``sys.path``,
not the checkout's root, so ``torchmetrics_gradpatch`` is the installed package, as in the test suite; the ranks
get the same ``sys.path``. :func:`package` says which copy was imported.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any


def package() -> str:
    """``torchmetrics_gradpatch <version> (<directory>)``: the copy this process imports."""
    import torchmetrics_gradpatch as tg

    return f"torchmetrics_gradpatch {tg.__version__} ({os.path.dirname(tg.__file__)})"


def _rank(
    rank: int, fn: Callable[..., Any], args: Sequence[Any], world_size: int, directory: str, timeout: float
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(directory, "store"), world_size)
    wait = datetime.timedelta(seconds=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=wait)
    dist.barrier()  # every rank connected before any can finish and leave
    result = fn(*args)
    path = os.path.join(directory, f"rank{rank}.pickle")
    with open(path + ".part", "wb") as out:
        pickle.dump(result, out)
    os.replace(path + ".part", path)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without tearing the group down: gloo's teardown can deadlock holding the GIL on torch 2.0 to 2.4, and a
    # process that exits with its group alive can abort on 2.13 to 2.15. The result is on disk, every rank is past
    # the last collective.
    os._exit(0)


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 1800.0
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo ranks; their return values, rank 0 first (see the module docstring)."""
    from torch.multiprocessing import start_processes

    directory = tempfile.mkdtemp(prefix="tmgp-bench-")
    deadline = time.monotonic() + timeout
    context = start_processes(
        _rank, args=(fn, tuple(args), world_size, directory, timeout), nprocs=world_size, join=False
    )
    try:
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{fn.__qualname__} on {world_size} ranks: not done after {timeout:g} s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(directory, f"rank{rank}.pickle"), "rb") as result:
                results.append(pickle.load(result))
        return results
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        shutil.rmtree(directory, ignore_errors=True)
