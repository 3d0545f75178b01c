"""The fused sync: a Metric's whole sync in one exchange, registered with the core as the ``"fused"`` strategy.

``patch(sync="fused")``, ``patched(sync="fused")`` or ``TORCHMETRICS_GRADPATCH_SYNC=fused`` make the core's
``Metric._sync_dist`` replacement run :func:`fused_sync` whenever torchmetrics would sync with its own gather:
one collective per Metric when its layout is steady (two after a change) instead of two or three per state, the
same values bit for bit, and one :class:`~torchmetrics_gradpatch.FusedSyncError` on every rank where ranks hold
states of different structure (where torchmetrics' own sync can hang). While it is the strategy in force,
``MetricCollection.compute()`` syncs every member in one exchange (:mod:`torchmetrics_gradpatch.fused.collection`),
and so does a collection's ``forward`` for every member that syncs on step (:mod:`torchmetrics_gradpatch.fused.step`).

Importing this package registers the strategy and imports neither torch nor torchmetrics; the modules that do
(``sync``, ``wire``, ``grad``, ``collection``, ``step``) load on the first sync. Every rank of a group must use the same
strategy (docs/fused-sync.md).
"""

from __future__ import annotations

from typing import Any

from torchmetrics_gradpatch import _syncs

__all__ = ["fused_sync"]


def fused_sync(metric: Any, process_group: Any | None = None, mode: str = "local") -> None:
    """Sync ``metric``'s states across ``process_group`` in one exchange, as ``Metric._sync_dist`` would: one
    collective when the group's recent exchanges had the same sizes, two after a change.

    Values are torchmetrics' own, state by state; ``mode`` is the gradient mode (``"local"``: each rank's states
    keep their own graphs; ``"global"``: every rank's states get the gradients of every rank's loss, one backward
    collective for the whole sync). A collective: every rank of the group calls it for the same Metric class.
    Raises :class:`~torchmetrics_gradpatch.FusedSyncError` (on every rank alike) when the ranks' states cannot be
    synced together.
    """
    from torchmetrics_gradpatch.fused.sync import fused_sync as run

    run(metric, process_group, mode)


def _install_collection() -> None:
    from torchmetrics_gradpatch.fused import collection, step

    collection.install()
    step.install()


def _uninstall_collection() -> None:
    from torchmetrics_gradpatch.fused import collection, step

    step.uninstall()
    collection.uninstall()


def _collection_sites() -> tuple[str, ...]:
    from torchmetrics_gradpatch.fused import collection, step

    sites: tuple[str, ...] = (
        ("torchmetrics.MetricCollection.compute (one exchange per collection)",) if collection.installed() else ()
    )
    if step.installed():
        sites += ("torchmetrics.MetricCollection.forward (one exchange per collection step)",)
    return sites


_syncs.register(
    "fused",
    _syncs.Strategy(
        sync=fused_sync, install=_install_collection, uninstall=_uninstall_collection, sites=_collection_sites
    ),
)
