"""The fused sync: a Metric's whole sync in one exchange, registered with the core as the ``"fused"`` strategy.

Under ``patch(sync="fused")`` the core's ``Metric._sync_dist`` replacement runs :func:`fused_sync`, and
``MetricCollection.compute()`` (:mod:`.collection`) and ``forward`` (:mod:`.step`) sync their members in one exchange
each. Importing this package imports neither torch nor torchmetrics. What it does and costs: docs/fused-sync.md; how:
docs/design.md ("The fused exchange").
"""

from __future__ import annotations

import sys
from typing import Any

from torchmetrics_gradpatch import _compile, _engine, _syncs
from torchmetrics_gradpatch.fused import recognise
from torchmetrics_gradpatch.fused.membership import explain, trust, trusted_names

__all__ = ["explain", "fused_sync", "reset", "trust"]


def fused_sync(metric: Any, process_group: Any | None = None, mode: str = "local") -> None:
    """Sync ``metric``'s states across ``process_group`` in one exchange, as ``Metric._sync_dist`` would: one
    collective when the group's recent exchanges had the same sizes, two after a change.

    Values are torchmetrics' own, state by state; ``mode`` is the gradient mode (``"local"``: each rank's states
    keep their own graphs; ``"global"``: every rank's states get the gradients of every rank's loss, one backward
    collective for the whole sync). A collective: every rank of the group calls it for the same Metric class.
    Raises :class:`~torchmetrics_gradpatch.FusedSyncError` (on every rank alike) when the ranks' states cannot be
    synced together.

    Where some rank of the group does not recognise what the sync relies on
    (:mod:`torchmetrics_gradpatch.fused.recognise`), every rank runs torchmetrics' own ``_sync_dist`` instead, after the
    header that tells them; in check mode the fused sync is compared with it
    (:mod:`torchmetrics_gradpatch.fused.compare`).
    """
    from torchmetrics_gradpatch.fused import compare, exchange

    # a rank that steps aside still sends its header, so that every rank steps aside with it
    unrecognised = recognise.stepping_aside(recognise.SINGLE)

    def own() -> None:
        _syncs.original_sync_dist()(metric, process_group=process_group)

    def fused() -> None:
        if not exchange.sync_metric(metric, process_group, mode, unrecognised):
            own()

    if _engine.effective_check():
        compare.run(type(metric).__name__, metric, fused, own, process_group or metric.process_group)
    else:
        fused()


def reset() -> None:
    """Forget what the fused sync keeps between syncs: every process group's agreed inline capacity (the next exchange
    over each group costs two collectives), the kept send buffers, the layouts and plans it read once, and which
    unrecognised objects it warned of (each is warned of again). Module sources it read stay cached.

    Every rank of a group must call it at the same point: the capacity is agreed, never exchanged. Never needed in a
    program; tests that reuse processes call it between cases."""
    for name in ("wire", "exchange", "collection", "transit", "recognise", "internals"):
        module = sys.modules.get(f"{__name__}.{name}")  # one never loaded holds nothing
        if module is not None:
            module.forget()


def _sites() -> tuple[tuple[Any, str], ...]:
    from torchmetrics_gradpatch.fused import collection, step

    return (
        (collection.SITE, "torchmetrics.MetricCollection.compute (one exchange per collection)"),
        (step.SITE, "torchmetrics.MetricCollection.forward (one exchange per collection step)"),
    )


def _install() -> None:
    _compile.watch_dynamo()  # the graph breaks' wrapper, once dynamo is imported
    for site, _ in _sites():
        site.install()
    if "torchmetrics.metric" in sys.modules:
        recognise.aside()  # the first look at torchmetrics' modules (each source read once) now, not in a first sync


def _uninstall() -> None:
    for site, _ in reversed(_sites()):
        site.uninstall()


_syncs.register(
    "fused",
    _syncs.Strategy(
        sync=fused_sync,
        install=_install,
        uninstall=_uninstall,
        sites=lambda: tuple(name for site, name in _sites() if site.installed()),
        aside=recognise.aside,
        trusted=trusted_names,
    ),
)
