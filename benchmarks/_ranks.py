"""Start benchmark ranks: ``spawn_ranks(fn, world_size, args, timeout)`` runs ``fn(*args)`` on ``world_size``
spawned gloo ranks and returns what each returned, in rank order. The benchmarks' one way to start ranks.

* The ranks come from the package's launcher (``torchmetrics_gradpatch.cli.ranks.run``): they meet at a store this
  process hosts, each runs ``fn`` with one intra-op thread, and its return value (which must pickle) comes back.
* ``fn`` is a module-level function of the benchmark script or of a module beside it: the rank imports it by name.
* A rank that raises or dies ends the run, and so does ``timeout``: the launcher's ``RanksError`` names each rank
  with its traceback, exit status or Python stack. No rank outlives the call.

A benchmark runs as a script (``python benchmarks/bench_x.py``): Python puts ``benchmarks/`` first on ``sys.path``,
not the checkout's root, so ``torchmetrics_gradpatch`` is the installed package, as in the test suite; the ranks
get the same ``sys.path``. :func:`package` says which copy was imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# bench_gather's second environment (native torchmetrics) has no package: there the launcher is its file alone,
# loaded with this module so that a rank, which imports the script and with it this module first, finds it too.
if importlib.util.find_spec("torchmetrics_gradpatch") is None:
    _SPEC = importlib.util.spec_from_file_location(
        "_launcher", Path(__file__).parents[1] / "torchmetrics_gradpatch/cli/ranks.py"
    )
    assert _SPEC is not None and _SPEC.loader is not None
    sys.modules["_launcher"] = importlib.util.module_from_spec(_SPEC)
    _SPEC.loader.exec_module(sys.modules["_launcher"])


def package() -> str:
    """``torchmetrics_gradpatch <version> (<directory>)``: the copy this process imports."""
    import torchmetrics_gradpatch as tg

    return f"torchmetrics_gradpatch {tg.__version__} ({os.path.dirname(tg.__file__)})"


def _one_thread(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    import torch

    torch.set_num_threads(1)
    return fn(*args)


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 1800.0
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo ranks; their return values, rank 0 first (see the module docstring)."""
    if "_launcher" in sys.modules:
        launcher: Any = sys.modules["_launcher"]
    else:  # imported here, not above: the toggle benchmark counts the modules this process has loaded
        from torchmetrics_gradpatch.cli import ranks as launcher
    return launcher.run(_one_thread, world_size, (fn, tuple(args)), timeout=timeout)
