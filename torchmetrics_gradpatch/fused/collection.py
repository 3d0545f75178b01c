"""One exchange per ``MetricCollection``: under the fused sync, ``compute()`` syncs every member that syncs at once.

``SITE.install()`` replaces the class attribute ``torchmetrics.MetricCollection.compute`` (the method ``compute()`` runs
on every torchmetrics line from 0.11 to 1.9; from 1.0 on it calls ``_compute_and_reduce("compute")``, which
``forward`` shares, so that is left alone); ``SITE.uninstall()`` puts the very same object back. While the engine's
effective sync is ``"fused"``, the replacement:

1. takes the members as ``compute()`` does (``items(keep_base=True, copy_state=False)``, which links the states of
   a compute group's members to its first member's);
2. exchanges over the default group, in one exchange whatever the number of members and states (one collective
   when steady, two after a change: :mod:`torchmetrics_gradpatch.fused.wire`), a member table (each member's
   fingerprint, whether it joins the exchange or why not, whether it needs a sync) and the states of every member
   that joins; a state object shared by several members (a compute group) is one slot, sent once;
3. from those same facts on every rank: refuses with the same :class:`~torchmetrics_gradpatch.FusedSyncError`
   (naming the member and the state) what cannot be synced, before any state changes; else sets each joining
   member's synced states through the member's own ``sync()`` (so its cache of local states is taken as its
   torchmetrics takes it), with its ``_sync_dist`` replaced for that one call by the step-3 reduction;
4. runs torchmetrics' own ``compute()`` with those members' own sync skipped: each member computes on its synced
   states and its own ``unsync()`` restores its local states, as after torchmetrics' own sync.

A member opts out, and syncs in its own ``compute()`` as it does today, when it does not sync on compute
(``sync_on_compute=False``), syncs with a ``dist_sync_fn`` of its own or over a process group of its own,
overrides ``_sync_dist``, is not distributed (its ``distributed_available_fn``) or is synced already; every rank
sends why, and ranks that disagree raise the same error. A member whose result is cached is synced only when some
rank has to (that rank's cache is then dropped, so every rank computes from the same states). A rank with no member
to sync (none joins, or every one that joins holds a cached result) runs no exchange and issues no collective, as
torchmetrics' own ``compute()`` issues none there: ``compute()`` on one rank alone, to log there, returns. A state
that one rank cannot prepare (a ``cat`` list whose tensors do not concatenate, say) is flagged in its header, and
every rank raises the same error after that collective. Under ``torch.compile`` the whole of it runs behind one
graph break.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

from torchmetrics_gradpatch import _compile, _engine
from torchmetrics_gradpatch._site import Site

__all__ = ["SITE", "sync_members"]

_MARK = "__torchmetrics_gradpatch_collection__"  # set on our replacement, so it is told apart from another tool's

# Why a member does or does not join the exchange; sent by every rank, so they agree or all raise.
JOINS, NO_SYNC, OWN_SYNC_FN, OWN_GROUP, OWN_SYNC_DIST, NOT_DISTRIBUTED, SYNCED, NOT_A_METRIC = range(8)
NO_STEP_SYNC, OWN_FORWARD, PRE_HOOKS = range(8, 11)  # a step's own reasons (forward, fused.step)
_HOW = {
    JOINS: "joins the collection's exchange",
    NO_SYNC: "does not sync on compute (sync_on_compute=False)",
    OWN_SYNC_FN: "syncs with a dist_sync_fn of its own",
    OWN_GROUP: "syncs over a process group of its own",
    OWN_SYNC_DIST: "overrides _sync_dist",
    NOT_DISTRIBUTED: "is not distributed (its distributed_available_fn)",
    SYNCED: "is synced already",
    NOT_A_METRIC: "is not a torchmetrics Metric",
    NO_STEP_SYNC: "does not sync on step (dist_sync_on_step=False)",
    OWN_FORWARD: "overrides forward",
    PRE_HOOKS: "has forward pre-hooks",
}
_MEMBER_WORDS = 3  # per member in the table: fingerprint, how, needs; then its slot references


def _how(metric: Any, on_step: bool = False) -> int:
    """Whether ``metric`` joins the exchange, else why not: the same tests its own ``compute()`` makes, in order
    (``on_step``: its ``forward``'s, where the batch states sync when ``dist_sync_on_step`` is set)."""
    import torch.distributed as dist
    import torchmetrics.utilities.distributed as tm_distributed
    from torchmetrics import Metric

    if not isinstance(metric, Metric):
        return NOT_A_METRIC
    if on_step:
        if metric._is_synced:
            return SYNCED  # its forward() raises "shouldn't be synced", as today
        if not metric.dist_sync_on_step:
            return NO_STEP_SYNC
        cls = type(metric)
        if cls.forward is not Metric.forward or (
            cls._forward_full_state_update is not Metric._forward_full_state_update
        ):
            return OWN_FORWARD  # the step runs torchmetrics' own forward in two halves (fused.step)
        if metric._forward_pre_hooks:
            return PRE_HOOKS  # they run when the member is called, after its batch was updated
    elif not metric._to_sync:
        return NO_SYNC
    elif metric._is_synced:
        return SYNCED  # its compute() raises "already synced", as today
    available = metric.distributed_available_fn
    if not (callable(available) and available()):
        return NOT_DISTRIBUTED
    if metric.dist_sync_fn not in (None, tm_distributed.gather_all_tensors):
        return OWN_SYNC_FN
    if metric.process_group not in (None, dist.group.WORLD):
        return OWN_GROUP
    if type(metric)._sync_dist is not Metric.__dict__["_sync_dist"]:
        return OWN_SYNC_DIST  # it may post-process (CompositionalMetric syncs nothing, its operands sync)
    return JOINS


def _reduction_key(reduction: Any) -> Any:
    """``reduction`` as a slot's key: the object itself where it is hashable (torchmetrics' own functions), else its
    identity (the member keeps it alive for the whole exchange)."""
    try:
        hash(reduction)
    except TypeError:
        return ("id", id(reduction))
    return reduction


def _member_name(key: str, metric: Any) -> str:
    return f"{type(metric).__name__} (MetricCollection member {key!r})"


def _fingerprint(key: str, metric: Any) -> int:
    from torchmetrics_gradpatch.fused.sync import reduction_name

    reductions = getattr(metric, "_reductions", {})
    text = "|".join([key, type(metric).__qualname__, *(f"{a}:{reduction_name(r)}" for a, r in reductions.items())])
    return zlib.crc32(text.encode())


def _held(members: list[tuple[str, Any]]) -> list[str]:
    """Each member as errors name it to the other ranks: its key, class and states' reductions."""
    from torchmetrics_gradpatch.fused.sync import describe

    return [f"{key!r}: {describe(metric)}" for key, metric in members]


def _table_error(
    members: list[tuple[str, Any]], tables: list[list[int]], texts: Callable[[str], list[str]]
) -> Exception | None:
    """The error every rank raises when the ranks' member tables disagree (``None``: they agree).

    ``texts(text)`` gathers every rank's ``text`` (two collectives): called, alike on every rank, only where the
    tables disagree on which metrics the ranks hold, so the error names each rank's members, one text everywhere.
    """
    import json

    from torchmetrics_gradpatch.fused.sync import structure_error

    counts = {r: table[0] for r, table in enumerate(tables)}
    rows = [_rows(table) for table in tables]
    differing = [i for i in range(min(counts.values())) if len({row[i][0] for row in rows}) > 1]
    if len(set(counts.values())) > 1 or differing:
        held = [json.loads(text) for text in texts(json.dumps(_held(members)))]
        if len(set(counts.values())) > 1:
            return structure_error(
                "a MetricCollection",
                None,
                "the ranks are computing collections of different sizes",
                {r: f"{len(h)} members: " + ", ".join(h) for r, h in enumerate(held)},
            )
        i = differing[0]
        return structure_error(
            f"member {i} of a MetricCollection",
            None,
            "the ranks hold different metrics as this member (another key, class, or other states or reductions)",
            {r: h[i] for r, h in enumerate(held)},
        )
    for i, (key, metric) in enumerate(members):
        name = _member_name(key, metric)
        if len({row[i][1] for row in rows}) > 1:
            return structure_error(
                name,
                None,
                "the ranks disagree on whether it syncs in the collection's exchange",
                {r: _HOW.get(row[i][1], f"reason {row[i][1]}") for r, row in enumerate(rows)},
            )
    return None


def _rows(table: list[int]) -> list[tuple[int, int, int, list[int]]]:
    """A member table read back: per member its fingerprint, how, needs and slot references."""
    rows = []
    at = 1
    for _ in range(table[0]):
        fingerprint, how, needs = table[at : at + _MEMBER_WORDS]
        count = table[at + _MEMBER_WORDS]
        refs = table[at + _MEMBER_WORDS + 1 : at + _MEMBER_WORDS + 1 + count]
        rows.append((fingerprint, how, needs, list(refs)))
        at += _MEMBER_WORDS + 1 + count
    return rows


def _prepare(
    members: list[tuple[str, Any]], hows: list[int], stream_cpu: bool
) -> tuple[list[Any], list[list[Any]], Any, int]:
    """Step 1 for every joining member: the slots this rank sends, each member's states (views of its slots), the
    outgoing description (with the member table in front) and the fingerprint every rank must share."""
    from torchmetrics_gradpatch.fused import sync as fs

    slots: list[fs.Local] = []
    states: list[list[fs.Local]] = []
    seen: dict[tuple[Any, ...], int] = {}
    table = [len(members)]
    placement: list[int] = []  # every member's slot references: what a proposal to reduce must agree on too
    for (key, metric), how in zip(members, hows, strict=True):
        refs: list[int] = []
        mine: list[fs.Local] = []
        if how == JOINS:
            rule = fs.placeholder_rule(metric)
            for attr, reduction in metric._reductions.items():
                value = getattr(metric, attr)
                # what step 1 makes of a state, and what a reduced slot is reduced with, depend on these alone: one
                # slot for a compute group's shared state, one per reduction where grouped members reduce it apart
                # (the placeholder, made from the Metric's dtype and device, exists from torchmetrics 1.4 on only)
                slot_key = (id(value), _reduction_key(reduction), (metric.dtype, str(metric.device)) if rule else None)
                index = seen.get(slot_key)
                if index is None:
                    index = seen[slot_key] = len(slots)
                    slots.append(fs.prepare_state(metric, attr, reduction, rule, stream_cpu))
                slot = slots[index]
                mine.append(fs.Local(attr, reduction, slot.is_cat, slot.value, slot.tensors, slot.described))
                refs.append(index)
        needs = how == JOINS and metric._computed is None  # a cached result is returned without a sync
        table += [_fingerprint(key, metric), how, int(needs), len(refs), *refs]
        placement += [len(refs), *refs]
        states.append(mine)
    agreed = zlib.crc32(str([(row[0], row[1]) for row in _rows(table)]).encode())  # what every rank must share
    return slots, states, fs.outgoing(slots, table, placement), agreed


def sync_members(
    members: list[tuple[str, Any]],
    mode: str,
    hows: list[int] | None = None,
    set_synced: Callable[[Any, Callable[[], None]], None] | None = None,
) -> list[Any]:
    """The one exchange over the default group: set the synced states of every member that joins and needs it.

    A collective among the ranks that have a member to sync: a rank where no member joins, or every joining member
    holds a cached result, returns at once and issues none, as torchmetrics' own ``compute()`` would. Returns the
    members now synced (each through its own ``sync()``: ``_is_synced`` set, its local states in its cache).

    ``hows``: whether each member joins, else why not (default: :func:`_how` for ``compute()``); ``set_synced``:
    what is done with each synced member and the function that sets its synced states (default: its own
    ``sync()`` runs it, :func:`_set_synced`).
    """
    import torch
    import torch.distributed as dist

    from torchmetrics_gradpatch._gather import size_and_rank
    from torchmetrics_gradpatch.fused import large, transit
    from torchmetrics_gradpatch.fused import sync as fs
    from torchmetrics_gradpatch.fused import wire as fp

    hows = [_how(metric) for _, metric in members] if hows is None else hows
    apply = _set_synced if set_synced is None else set_synced
    if not any(how == JOINS and metric._computed is None for how, (_, metric) in zip(hows, members, strict=True)):
        return []  # nothing here needs a peer (a rank logging alone, say): no collective, so no rank waits alone
    group = dist.group.WORLD
    world_size, rank = size_and_rank(group)
    joining = [metric for how, (_, metric) in zip(hows, members, strict=True) if how == JOINS]
    device, staging, stream_cpu = transit.devices(joining[0].device, group)
    failure: Exception | None = None
    try:
        slots, states, out, agreed = _prepare(members, hows, stream_cpu)
    except Exception as prepared:  # this rank's states cannot be sent: its header says so, and every rank raises
        slots, states, out, agreed, failure = [], [], fs.outgoing([]), 0, prepared
    name = "a MetricCollection"
    flags = fs.flags_of(slots) | (fp.FLAG_FAILED if failure is not None else 0)
    with torch.no_grad():
        rows = fs.headers(out, flags, agreed, group, world_size, device)
        fs.raise_failures(name, rows, failure, group, world_size, device)
        got = fs.payloads(out, rows, rank, group, world_size, device)
        error = _table_error(members, got.tables, lambda text: fs.gather_texts(text, group, world_size, device))
        if error is not None:
            raise error
        fs.check_grad_modes(name, rows, mode)
        tables = [_rows(t) for t in got.tables]
        joined = [i for i, how in enumerate(hows) if how == JOINS and any(t[i][2] for t in tables)]
        views: dict[int, list[list[fp.State]]] = {}
        for i in joined:
            views[i] = [[got.slots[r][ref] for ref in tables[r][i][3]] for r in range(world_size)]
            fs.validate(_member_name(*members[i]), states[i], views[i])
        fs.complete(got, out, slots, rows, rank, group, device, staging)
    keep = [[False] * len(got.slots[r]) for r in range(world_size)]
    for i in joined:
        for s, state in enumerate(states[i]):
            if state.described.kind == fp.KIND_LIST and not state.is_cat:
                for r in range(world_size):
                    keep[r][tables[r][i][3][s]] = True
    synced = fs.entries(slots, got, keep, rank, world_size, None, fs.node_wanted(rows, mode), device)
    done: list[Any] = []
    try:
        for i in joined:
            metric = members[i][1]
            per_rank = [[synced[r][ref] for ref in tables[r][i][3]] for r in range(world_size)]
            values = [(got.reduced or {}).get(ref) for ref in tables[rank][i][3]]
            # sync()'s copies of the cat states joined in place would add to the buffer's peak: none are made
            with large.uncopied(metric, large.joined_in_place(states[i], values)):
                apply(metric, functools.partial(fs.reduce, metric, states[i], views[i], per_rank, values))
            done.append(metric)
    except BaseException:
        for metric in done:
            metric.unsync()
        raise
    return done


def _set_synced(metric: Any, reduce: Callable[[], None]) -> None:
    """Sync ``metric`` through its own ``sync()`` with ``reduce`` standing in for its ``_sync_dist`` (one call)."""
    metric._computed = None  # another rank had to sync it: this rank computes afresh from the same states too

    def _sync_dist(dist_sync_fn: Any = None, process_group: Any = None) -> None:
        reduce()

    metric._sync_dist = _sync_dist  # an instance attribute, over the class's, for this one call
    try:
        metric.sync(should_sync=True, distributed_available=lambda: True)
    finally:
        del metric._sync_dist


def _compute(original: Callable[[Any], Any], collection: Any) -> Any:
    """The collection's ``compute()`` with one exchange for every member that joins (see the module docstring)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return original(collection)
    members = [(str(key), metric) for key, metric in collection.items(keep_base=True, copy_state=False)]
    if not members:
        return original(collection)
    joined = sync_members(members, _engine.effective_mode())
    if not joined:
        return original(collection)
    to_sync = [metric._to_sync for metric in joined]
    try:
        for metric in joined:
            metric._to_sync = False  # its own sync in compute() is skipped; its unsync still runs
        # compute() links compute groups again first; done now, it would give each member its group's first
        # member's synced states (the link was made above, before the exchange)
        collection._state_is_copy = True
        return original(collection)
    except BaseException:
        for metric in joined:
            if metric._is_synced and metric._should_unsync:
                metric.unsync()  # what the failure left synced goes back to its local states
        raise
    finally:
        collection._state_is_copy = False  # as compute()'s items(copy_state=False) leaves it
        for metric, value in zip(joined, to_sync, strict=True):
            metric._to_sync = value


def _replacement(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)  # name, doc, __wrapped__ = the original, restored by uninstall
    def compute(self: Any) -> Any:
        if _engine.effective_sync() != "fused":
            return original(self)
        if _compile.is_compiling():  # under torch.compile: one graph break, the whole of it runs eagerly
            return _compile.run_eagerly(_compute, original, self)
        return _compute(original, self)

    return compute


#: ``MetricCollection.compute``, replaced by ``SITE.install()`` (now, or when ``torchmetrics.collections`` is
#: imported; idempotent) and put back, the very same object, by ``SITE.uninstall()``
SITE = Site("torchmetrics.collections", "MetricCollection", "compute", _MARK, _replacement)
