"""The fused sync: a Metric's whole sync in one exchange, registered with the core as the ``"fused"`` strategy.

``patch(sync="fused")`` makes the core's ``Metric._sync_dist`` replacement run :func:`fused_sync`, and, while it is
in force, ``MetricCollection.compute()`` (:mod:`.collection`) and ``forward`` (:mod:`.step`) sync their members in
one exchange each (:mod:`.exchange`). Importing this package registers the strategy and imports neither torch nor
torchmetrics. What it does and costs: docs/fused-sync.md; how: docs/design.md ("The fused exchange").
"""

from __future__ import annotations

import sys
from typing import Any

from torchmetrics_gradpatch import _syncs
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
    from torchmetrics_gradpatch import _engine
    from torchmetrics_gradpatch.fused import compare, exchange, recognise

    # a rank that steps aside still sends its header, so that every rank steps aside with it
    unrecognised = recognise.stepping_aside(recognise.SINGLE)

    def fused() -> None:
        if not exchange.sync_metric(metric, process_group, mode, unrecognised):
            _syncs.original_sync_dist()(metric, process_group=process_group)

    if _engine.effective_check():
        group = process_group or metric.process_group
        compare.run(
            type(metric).__name__,
            metric,
            fused,
            lambda: _syncs.original_sync_dist()(metric, process_group=process_group),
            group,
        )
    else:
        fused()


def reset() -> None:
    """Forget what the fused sync keeps between syncs: every process group's agreed inline capacity (the next exchange
    over each group costs two collectives), the kept send buffers, the layouts and plans it read once, and which
    unrecognised objects it warned of (each is warned of again). Module sources it read stay cached.

    Every rank of a group must call it at the same point: the capacity is agreed, never exchanged. Never needed in a
    program; tests that reuse processes call it between cases."""

    def loaded(name: str) -> Any:
        return sys.modules.get(f"{__name__}.{name}")

    if (wire := loaded("wire")) is not None:
        wire.forget()
    if (exchange := loaded("exchange")) is not None:
        exchange.forget()
    if (collection := loaded("collection")) is not None:
        collection.forget()
    if (transit := loaded("transit")) is not None:
        transit.forget()
    if (recognise := loaded("recognise")) is not None:
        recognise.forget()


def _collection_sites_all() -> tuple[tuple[Any, str], ...]:
    from torchmetrics_gradpatch.fused import collection, step

    return (
        (collection.SITE, "torchmetrics.MetricCollection.compute (one exchange per collection)"),
        (step.SITE, "torchmetrics.MetricCollection.forward (one exchange per collection step)"),
    )


def _install_collection() -> None:
    from torchmetrics_gradpatch import _compile

    _compile.watch_dynamo()  # the graph breaks' wrapper, once dynamo is imported
    for site, _ in _collection_sites_all():
        site.install()
    if "torchmetrics.metric" in sys.modules:
        # the first look at torchmetrics' modules (each source read and compiled once) now, not inside a first sync
        from torchmetrics_gradpatch.fused import recognise

        recognise.aside()


def _uninstall_collection() -> None:
    for site, _ in reversed(_collection_sites_all()):
        site.uninstall()


def _collection_sites() -> tuple[str, ...]:
    return tuple(name for site, name in _collection_sites_all() if site.installed())


def _stepped_aside() -> dict[str, tuple[str, ...]]:
    from torchmetrics_gradpatch.fused import recognise

    return recognise.aside()


_syncs.register(
    "fused",
    _syncs.Strategy(
        sync=fused_sync,
        install=_install_collection,
        uninstall=_uninstall_collection,
        sites=_collection_sites,
        aside=_stepped_aside,
        trusted=trusted_names,
    ),
)
