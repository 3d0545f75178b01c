"""What several test modules share: a collective recorder and counter, a Metric's synced-state loss, every rank's
value, the warnings of an uneven gather by every path, and the error a call raises with the patch off and on
(and, re-exported, the two small MSE metrics of ``tests/_workloads.py``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torchmetrics
from packaging.version import Version
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_cat

from tests._workloads import CatSquaredError, SumSquaredError

#: Whether torchmetrics' own sync puts ``tensor([])`` in for an empty ``cat`` list: from 1.4 on, on torch >= 2.1
#: only (``_TORCH_GREATER_EQUAL_2_1`` in ``Metric._sync_dist``). Without it, a rank whose ``cat`` state is empty
#: skips that gather (``apply_to_collection`` finds no tensor in ``[]``) and the ranks' collectives mismatch.
_TORCHMETRICS, _TORCH = Version(torchmetrics.__version__).release, Version(torch.__version__).release
EMPTY_CAT_PLACEHOLDER = _TORCHMETRICS >= (1, 4) and _TORCH >= (2, 1)

#: The collectives :func:`record_collectives` watches (those missing from a torch version are skipped).
COLLECTIVES = (
    "barrier",
    "all_gather",
    "all_gather_single",  # the fused exchange's, on a torch that has it
    "all_to_all_single",
    "all_to_all",
    "all_reduce",
    "reduce_scatter",
    "broadcast",
)


@contextmanager
def record_collectives() -> Iterator[list[str]]:
    """Record, in order, every collective the code inside issues: its name, and for ``all_gather`` the shapes."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def recorder(name: str) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            shapes = [tuple(t.shape) for t in args[0]] if name == "all_gather" else None
            calls.append(name if shapes is None else f"{name}{shapes}")
            return originals[name](*args, **kwargs)

        return record

    for name in originals:
        setattr(dist, name, recorder(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def destroy_subgroup(group: Any) -> None:
    """Destroy a group the test created (on its members; the others hold none), so that a warm rank is left as
    the test found it; a test that fails before this has its ranks ended (``run_ranks`` ends a failed call's pool).

    On torch 2.0 the group is left (the warm ranks keep it until they end): its gloo deadlocked in
    destroy_process_group 1 time in 30. Elsewhere the group's last work is a barrier, whose tensors Python does
    not own.
    """
    if group == dist.GroupMember.NON_GROUP_MEMBER or torch.__version__.startswith("2.0."):
        return
    gc.collect()
    dist.barrier(group=group)
    dist.destroy_process_group(group)


def collection_loss(preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The synced loss of a ``MetricCollection`` of a sum-state and a cat-state metric (``dist_sync_on_step``)."""
    collection = MetricCollection(
        {"sum": SumSquaredError(dist_sync_on_step=True), "cat": CatSquaredError(dist_sync_on_step=True)}
    )
    values = collection(preds, target)
    return values["sum"] + values["cat"]  # type: ignore[no-any-return]


def synced_state_loss(case: str, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Update a metric with grad on, sync it by ``case`` and return the loss read from its synced states.

    ``case`` ends in ``sum`` or ``cat`` (the metric) and starts with ``sync_dist_default`` (``_sync_dist()`` with
    the default argument bound when ``Metric`` was created) or ``sync`` (``Metric.sync()``, which looks the gather
    up in ``torchmetrics.metric``'s namespace).
    """
    metric: Metric = SumSquaredError() if case.endswith("sum") else CatSquaredError()
    metric._enable_grad = True  # what forward does, so update() records a graph
    metric.update(preds, target)
    if case.startswith("sync_dist_default"):
        metric._sync_dist()
    else:
        metric.sync()
    if isinstance(metric, SumSquaredError):
        return metric.sse / metric.n
    errors = metric.errors
    return (errors if isinstance(errors, torch.Tensor) else dim_zero_cat(errors)).mean()


def installing_modes() -> tuple[str, ...]:
    """The gradient modes in which the patch actually replaces torchmetrics' gather here.

    On native torchmetrics (>= 1.6) local mode installs nothing, so "patch on" there would run torchmetrics' own
    code and compare it with itself; the global mode installs the trampoline on every torchmetrics.
    """
    import torchmetrics_gradpatch as tmgp

    return ("global",) if tmgp.status().native else ("local", "global")


def error_of(call: Callable[[], object]) -> tuple[type[BaseException] | None, str]:
    """The error ``call()`` raises, as ``(type, message)``; ``(None, "no error")`` if it returns."""
    try:
        call()
    except Exception as err:
        return type(err), str(err)
    return None, "no error"


def errors_off_and_on(call: Callable[[], object]) -> list[tuple[type[BaseException] | None, str]]:
    """The error ``call()`` raises with the patch off, then on in each of :func:`installing_modes`.

    Used to show bad input fails exactly as with unpatched torchmetrics: the first entry is torchmetrics' own
    code, every later one the trampoline's. The patch state is restored after.
    """
    import torchmetrics_gradpatch as tmgp
    from torchmetrics_gradpatch import _engine

    before = _engine.snapshot()  # patch()'s switch and mode (open blocks are left alone)
    found = []
    try:
        tmgp.unpatch()
        assert not _engine.installed()
        found.append(error_of(call))
        for mode in installing_modes():
            tmgp.patch(mode)
            assert _engine.installed(), f"patch({mode!r}) installed nothing: the comparison would be vacuous"
            found.append(error_of(call))
    finally:
        tmgp.patch(before.manual_mode) if before.manual else tmgp.unpatch()
    return found


def calls(group: Any = None) -> int:
    """The number of collectives ``group`` (default: the world) has issued so far, whatever API issued them."""
    group = dist.distributed_c10d._get_default_group() if group is None else group
    return int(group._get_sequence_number_for_group())


def every_rank(value: object) -> list[object]:
    """Every rank's ``value``, in rank order (a collective: every rank of the default group calls it)."""
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def uneven_gather_warnings() -> dict[str, Any]:
    """The warnings of one uneven gather (rows differ per rank) by every path; every rank runs every path alike.

    torchmetrics before 1.6 slices uneven results with a list, which torch >= 2.8 deprecates with a warning at
    every call; the package's gather must not warn. The unpatched call is the control that this path is the one
    that warns. Global-mode calls use a tensor without grad, so no backward collective is left pending.
    """
    import warnings

    import torchmetrics.utilities.distributed as tm_dist

    import torchmetrics_gradpatch

    rank = dist.get_rank()
    x = torch.ones(2 + rank, 3, dtype=torch.float64, requires_grad=True)

    def unpatched() -> list[torch.Tensor]:
        torchmetrics_gradpatch.unpatch()
        try:
            return list(tm_dist.gather_all_tensors(x))
        finally:
            torchmetrics_gradpatch.patch()

    def through(mode: str) -> Callable[[], list[torch.Tensor]]:
        def call() -> list[torch.Tensor]:
            with torchmetrics_gradpatch.patched(mode=mode):
                return list(tm_dist.gather_all_tensors(x if mode == "local" else x.detach()))

        return call

    paths: dict[str, Callable[[], list[torch.Tensor]]] = {
        "direct, local": lambda: torchmetrics_gradpatch.gather_all_tensors(x),
        "direct, global": lambda: torchmetrics_gradpatch.gather_all_tensors(x.detach(), mode="global"),
        "torchmetrics' function, local": through("local"),
        "torchmetrics' function, global": through("global"),
        "unpatched": unpatched,
    }
    out: dict[str, Any] = {}
    for name, call in paths.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
        out[name] = {"warnings": [str(w.message) for w in caught], "shapes": [tuple(t.shape) for t in result]}
    return out


def dynamo_refusal() -> str | None:
    """Why torch.compile cannot run here (its own error), or None when a trivial compiled call works."""
    try:
        compiled = torch.compile(lambda x: x * 2, backend="eager")
        if not torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0)):
            return "torch.compile(backend='eager') computed a wrong value for x * 2"
    except Exception as err:
        return f"torch.compile cannot run with torch {torch.__version__} here: {type(err).__name__}: {err}"
    return None
