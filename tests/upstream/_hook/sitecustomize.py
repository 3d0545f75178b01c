"""Run at every interpreter start of the fused tox environments (tox puts this directory on ``PYTHONPATH``).

``TMGP_FUSED_PROBE=<dir>``: every fused Metric sync a process completes appends a line, its gradient mode, to
``<dir>/<pid>``, written at once (pool workers are killed at the end of a run, so nothing waits for exit). It
watches for the package's ``_fused`` module instead of importing it, so a process imports exactly what it would
without this file.

``TMGP_IMPORT_PACKAGE=1``: import ``torchmetrics_gradpatch`` at start, so upstream's spawned ranks and pool workers,
whose code never imports it, run patched, with the mode and sync the environment names.

``TMGP_DESTROY_AT_EXIT=1``: destroy the default process group at exit (see below; upstream 0.11's ranks only).
"""

from __future__ import annotations

import os

if os.environ.get("TMGP_FUSED_PROBE"):
    import functools
    from typing import Any

    import wrapt

    def _count_fused_syncs(module: Any) -> None:
        run = module.fused_sync
        probe = os.environ["TMGP_FUSED_PROBE"]

        @functools.wraps(run)
        def counted(metric: Any, process_group: Any = None, mode: str = "local") -> None:
            run(metric, process_group, mode)
            with open(os.path.join(probe, str(os.getpid())), "a") as out:
                out.write(mode + "\n")

        module.fused_sync = counted

    wrapt.register_post_import_hook(_count_fused_syncs, "torchmetrics_gradpatch._fused")

if os.environ.get("TMGP_IMPORT_PACKAGE") == "1":
    import torchmetrics_gradpatch  # noqa: F401  (patches at import, in the mode and with the sync the environment names)


if os.environ.get("TMGP_DESTROY_AT_EXIT") == "1":
    import atexit
    import sys

    def _destroy_the_group_before_exit() -> None:
        # Upstream 0.11's spawned ranks exit with their gloo group alive; on torch 2.13-2.15 such a rank aborts now
        # and then ("terminate called without an active exception", SIGABRT), with or without this package
        # (docs/gradient-modes.md). Not on torch 2.0, whose destroy_process_group can deadlock (1 run in 30).
        torch = sys.modules.get("torch")
        dist = sys.modules.get("torch.distributed")
        if torch is None or dist is None or torch.__version__.startswith("2.0."):
            return
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(_destroy_the_group_before_exit)
