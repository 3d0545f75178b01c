"""Run at every interpreter start of the fused tox environments (tox puts this directory on ``PYTHONPATH``).

``TMGP_FUSED_PROBE=<dir>``: every fused Metric sync a process completes appends a line, its gradient mode, to
``<dir>/<pid>``, written at once (pool workers are killed at the end of a run, so nothing waits for exit). It
watches for the package's ``fused.exchange`` module (where the sync is looked up at every call) instead of importing
it, so a process imports exactly what it would without this file.

``TMGP_IMPORT_PACKAGE=1``: import ``torchmetrics_gradpatch`` at start, so upstream's spawned ranks and pool workers,
whose code never imports it, run patched, with the mode and sync the environment names.

``TMGP_SPAWN_FORKSERVER=1``: ``torch.multiprocessing.spawn`` starts its ranks from a forkserver that has imported
torch and torchmetrics once (upstream 0.11 spawns 2 fresh ranks per test, each importing them: most of its time),
and the ranks meet at a barrier before they exit (see below). The rank functions run unchanged.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

if os.environ.get("TMGP_FUSED_PROBE"):
    import wrapt

    def _count_fused_syncs(module: Any) -> None:
        run = module.sync_metric
        probe = os.environ["TMGP_FUSED_PROBE"]

        @functools.wraps(run)
        def counted(metric: Any, process_group: Any = None, mode: str = "local", aside_here: bool = False) -> bool:
            synced: bool = run(metric, process_group, mode, aside_here)
            if synced:  # counted where the fused sync ran, not where it stepped aside
                with open(os.path.join(probe, str(os.getpid())), "a") as out:
                    out.write(mode + "\n")
            return synced

        module.sync_metric = counted

    wrapt.register_post_import_hook(_count_fused_syncs, "torchmetrics_gradpatch.fused.exchange")

if os.environ.get("TMGP_IMPORT_PACKAGE") == "1":
    import torchmetrics_gradpatch  # noqa: F401  (patches at import, in the mode and with the sync the environment names)


if os.environ.get("TMGP_SPAWN_FORKSERVER") == "1":
    import datetime
    import multiprocessing
    from collections.abc import Callable

    import wrapt

    # A forkserver child leaves with os._exit, skipping the interpreter's and C++'s teardown. That teardown is where
    # spawned ranks that exit with their gloo group alive abort now and then on torch 2.13-2.15 ("terminate called
    # without an active exception", with or without this package), and its slowness is what kept rank 0, which
    # serves the TCPStore, alive until rank 1 had joined the group: without the barrier rank 0 can be gone first
    # ("Connection reset by peer" in test_non_contiguous_tensors, whose ranks run no collective). Bounded: a peer
    # that failed or hangs fails this rank instead of holding it.
    _EXIT_BARRIER_TIMEOUT = datetime.timedelta(seconds=60)

    def _rank_then_wait_for_peers(rank: int, fn: Callable[..., object], *args: object) -> None:
        fn(rank, *args)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.monitored_barrier(timeout=_EXIT_BARRIER_TIMEOUT)

    def _spawn_from_a_forkserver(module: Any) -> None:
        start_processes = module.start_processes

        @functools.wraps(module.spawn)
        def spawn(
            fn: Callable[..., object],
            args: tuple[object, ...] = (),
            nprocs: int = 1,
            join: bool = True,
            daemon: bool = False,
            start_method: str = "spawn",
        ) -> Any:
            if start_method != "spawn":  # a caller that chose its start method keeps it
                return start_processes(fn, args, nprocs, join, daemon, start_method)
            return start_processes(
                _rank_then_wait_for_peers, (fn, *args), nprocs, join, daemon, start_method="forkserver"
            )

        # the forkserver runs this file too, so it is patched and counted before it imports these
        multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torchmetrics"])
        module.spawn = spawn

    wrapt.register_post_import_hook(_spawn_from_a_forkserver, "torch.multiprocessing")
