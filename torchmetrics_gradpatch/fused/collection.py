"""One exchange per ``MetricCollection``: under the fused sync, ``compute()`` syncs every member that syncs at once.

``SITE.install()`` replaces the class attribute ``torchmetrics.MetricCollection.compute`` (the method ``compute()`` runs
on every torchmetrics line from 0.11 to 1.9; from 1.0 on it calls ``_compute_and_reduce("compute")``, which
``forward`` shares, so that is left alone); ``SITE.uninstall()`` puts the very same object back. While the engine's
effective sync is ``"fused"``, the replacement:

1. takes the members as ``compute()`` does (``items(keep_base=True, copy_state=False)``, which links the states of
   a compute group's members to its first member's);
2. exchanges over the default group, in one exchange whatever the number of members and states (one collective
   when steady, two after a change: :mod:`torchmetrics_gradpatch.fused.wire`), a member table (each member's
   fingerprint, its form, whether it needs a sync) and the states of every member that joins; a state object
   shared by several members (a compute group) is one slot, sent once (each member still gets tensors of its own);
3. from those same facts on every rank: refuses with the same :class:`~torchmetrics_gradpatch.FusedSyncError`
   (naming the member and the state) what cannot be synced, before any state changes; else sets each joining
   member's synced states through the member's own ``sync()`` (so its cache of local states is taken as its
   torchmetrics takes it), with its ``_sync_dist`` replaced for that one call by the step-3 reduction;
4. runs torchmetrics' own ``compute()`` with those members' own sync skipped: each member computes on its synced
   states and its own ``unsync()`` restores its local states, as after torchmetrics' own sync.

A collection holding a class the exchange does not trust (:mod:`torchmetrics_gradpatch.fused.membership`), or a
rank that does not recognise what the exchange relies on (:mod:`torchmetrics_gradpatch.fused.aside`), runs
torchmetrics' own ``compute()`` whole: such a rank still sends its member table, flagged, and every rank follows it.
In a trusted collection, the exchange takes over only the members in the form its tests prove
(:mod:`torchmetrics_gradpatch.fused.forms`);
every other member computes, and syncs, in its own ``compute()`` at its place in the order, exactly as under
torchmetrics' own sync: one that does not sync on compute, syncs over a process group of its own, is not distributed
or is synced already, and one whose form is not proven (a wrapper, a class overriding what the fused path relies
on, module hooks, its own ``dist_sync_fn``, one object under two keys). Every rank sends each member's form. Where
the ranks' forms differ but every rank's torchmetrics would sync the member over the default group (hooks, or a
``dist_sync_fn`` of its own, on one rank only), every rank syncs it with torchmetrics' own ``_sync_dist``, so their
collectives match; where one rank would sync it and another not, every rank raises the same error. A member whose
result is cached is synced only when some rank has to (that rank's cache is then dropped, so every rank computes
from the same states).

A rank runs the exchange unless none of its members syncs over the default group or each one that does holds a
cached result (members with their own ``dist_sync_fn`` count): then it issues no collective, as torchmetrics' own
``compute()`` issues none there, and ``compute()`` on one rank alone, to log there, returns. A state that one rank
cannot prepare (a ``cat`` list whose tensors do not concatenate, say) is flagged in its header, and every rank raises
the same error after that collective. Under ``torch.compile`` the whole of it runs behind one graph break.
"""

from __future__ import annotations

import array
import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchmetrics_gradpatch import _compile, _engine, _syncs
from torchmetrics_gradpatch._site import Site
from torchmetrics_gradpatch.fused import aside, forms, membership

__all__ = ["SITE", "Outcome", "forget", "sync_members", "syncs_here", "torchmetrics_own"]

_MARK = "__torchmetrics_gradpatch_collection__"  # set on our replacement, so it is told apart from another tool's
_MEMBER_WORDS = 4  # per member in the table: fingerprint, form, needs, detail; then its slot references


def syncs_here(members: list[tuple[str, Any]], codes: list[int], on_step: bool = False) -> bool:
    """Whether some member of this rank syncs over the default group (in ``compute()``: and holds no cached result):
    the rank then runs the exchange; else it issues no collective for the collection, as torchmetrics' own path
    issues none there."""
    return any(
        forms.kind(code) in (forms.JOINED, forms.OWN_PATH) and (on_step or forms.computes_anew(metric))
        for code, (_, metric) in zip(codes, members, strict=True)
    )


def _member_name(key: str, metric: Any) -> str:
    return f"{type(metric).__name__} (MetricCollection member {key!r})"


def _fingerprint(key: str, metric: Any) -> int:
    reductions = tuple(getattr(metric, "_reductions", {}).items())
    cls: Any = type(metric)
    try:
        return _fingerprint_of(key, cls, reductions)
    except TypeError:  # a reduction that cannot be hashed: not cached
        return _fingerprint_of.__wrapped__(key, cls, reductions)


@functools.lru_cache(maxsize=1024)
def _fingerprint_of(key: str, cls: Any, reductions: tuple[tuple[str, Any], ...]) -> int:
    """The member's key, class and each state's reduction, as one number every rank compares."""
    from torchmetrics_gradpatch.fused.sync import reduction_name

    text = "|".join([key, cls.__qualname__, *(f"{a}:{reduction_name(r)}" for a, r in reductions)])
    return zlib.crc32(text.encode())


def _held(members: list[tuple[str, Any]]) -> list[str]:
    """Each member as errors name it to the other ranks: its key, class and states' reductions."""
    from torchmetrics_gradpatch.fused.sync import describe

    return [f"{key!r}: {describe(metric)}" for key, metric in members]


def _structure_error(
    members: list[tuple[str, Any]], rows: list[list[_Row]], texts: Callable[[str], list[str]]
) -> Exception | None:
    """The error every rank raises when the ranks hold other members (``None``: they hold the same).

    ``texts(text)`` gathers every rank's ``text`` (two collectives): called, alike on every rank, only where the
    tables disagree on which metrics the ranks hold, so the error names each rank's members, one text everywhere.
    """
    import json

    from torchmetrics_gradpatch.fused.sync import structure_error

    counts = {r: len(table) for r, table in enumerate(rows)}
    differing = [i for i in range(min(counts.values())) if len({table[i].fingerprint for table in rows}) > 1]
    if len(set(counts.values())) == 1 and not differing:
        return None
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


def _own_sync(members: list[tuple[str, Any]], rows: list[list[_Row]]) -> list[int]:
    """The members that every rank syncs with torchmetrics' own ``_sync_dist``: their forms differ between ranks but
    every rank's torchmetrics would sync them over the default group, so those collectives match.

    Raises, alike on every rank, where the forms differ so that torchmetrics' own sync could not complete (one rank
    syncs a member another does not, or one rank's member raises as synced already).
    """
    from torchmetrics_gradpatch.fused.sync import structure_error

    own = []
    for i, (key, metric) in enumerate(members):
        seen = [table[i] for table in rows]
        kinds = {forms.kind(row.form) for row in seen}
        if kinds in ({forms.JOINED}, {forms.QUIET}, {forms.OTHER_GROUP}, {forms.RAISES}):
            continue
        if kinds == {forms.OWN_PATH} and len({(row.form, row.detail) for row in seen}) == 1:
            continue  # the same own path on every rank
        if kinds <= {forms.JOINED, forms.OWN_PATH}:
            own.append(i)
            continue
        raise structure_error(
            _member_name(key, metric),
            None,
            "the ranks disagree on whether it syncs (torchmetrics' own sync would leave the ranks that sync waiting)",
            {r: forms.describe(row.form) for r, row in enumerate(seen)},
        )
    return own


@dataclass(frozen=True)
class _Row:
    """One member in one rank's table: its fingerprint, form, whether it needs a sync, its detail and its slots."""

    fingerprint: int
    form: int
    needs: bool
    detail: int
    refs: list[int]


@dataclass
class _Plan:
    """What one exchange's descriptions settle, alike on every rank: the members every rank syncs with torchmetrics'
    own sync (``own``), the members that join on every rank (``joins``) and those the exchange syncs (``joined``),
    the members whose cached result is dropped (``recompute``), and per joined member every rank's slots
    (``refs[i][r]``), descriptions (``views[i][r]``) and which of this rank's slots an earlier member holds
    already (``shared[i]``: that member gets copies)."""

    own: list[int]
    joins: list[int]
    joined: list[int]
    recompute: list[int]
    refs: dict[int, list[list[int]]] = field(default_factory=dict)
    views: dict[int, list[list[Any]]] = field(default_factory=dict)
    shared: dict[int, list[bool]] = field(default_factory=dict)

    @classmethod
    def make(
        cls,
        members: list[tuple[str, Any]],
        tables: list[list[_Row]],
        own: list[int],
        codes: list[int],
        everywhere: bool,
        aside_anywhere: bool,
        rank: int,
        world_size: int,
        got: Any,
    ) -> _Plan:
        needed = [any(t[i].needs for t in tables) for i in range(len(members))]
        joins = [] if aside_anywhere else [i for i, c in enumerate(codes) if c == forms.JOINS and i not in own]
        plan = cls(
            own,
            joins,
            [i for i in joins if everywhere and needed[i]],
            [i for i in range(len(members)) if needed[i] and (i in own or forms.kind(codes[i]) == forms.OWN_PATH)],
        )
        given: set[int] = set()  # slots whose tensors a member already holds: the next member of its group gets copies
        for i in plan.joined:
            plan.refs[i] = [tables[r][i].refs for r in range(world_size)]
            plan.views[i] = [[got.slots[r][ref] for ref in plan.refs[i][r]] for r in range(world_size)]
            plan.shared[i] = [ref in given for ref in plan.refs[i][rank]]
            given.update(plan.refs[i][rank])
        return plan


#: (every rank's description words, whether every rank sent its states, this rank) -> the plan, for exchanges whose
#: checks passed (the newest 64)
_PLANS: dict[tuple[Any, ...], _Plan] = {}


@functools.lru_cache(maxsize=256)
def _rows(table: tuple[int, ...]) -> list[_Row]:
    """A member table read back (once per table: callers do not change the rows)."""
    rows = []
    at = 1
    for _ in range(table[0]):
        fingerprint, form, needs, detail = table[at : at + _MEMBER_WORDS]
        count = table[at + _MEMBER_WORDS]
        refs = table[at + _MEMBER_WORDS + 1 : at + _MEMBER_WORDS + 1 + count]
        rows.append(_Row(fingerprint, form, bool(needs), detail, list(refs)))
        at += _MEMBER_WORDS + 1 + count
    return rows


def _prepare(
    members: list[tuple[str, Any]], codes: list[int], stream_cpu: bool, staged: bool
) -> tuple[list[Any], list[list[Any]], Any, int]:
    """Step 1 for every joining member (``staged``: their states are ready to send; else only the table travels): the
    slots this rank sends, each member's states (views of its slots), the outgoing description (with the member
    table in front) and the fingerprint every rank must share."""
    from torchmetrics_gradpatch.fused import sync as fs

    slots: list[fs.Local] = []
    states: list[list[fs.Local]] = []
    seen: dict[tuple[Any, ...], int] = {}
    table = [len(members)]
    placement: list[int] = []  # every member's slot references: what a proposal to reduce must agree on too
    shared: list[int] = []  # every member's fingerprint and form: what every rank must share
    for (key, metric), code in zip(members, codes, strict=True):
        refs: list[int] = []
        mine: list[fs.Local] = []
        if code == forms.JOINS and staged:
            rule = fs.placeholder_rule(metric)
            made = (metric.dtype, str(metric.device)) if rule else None
            for attr, reduction in metric._reductions.items():
                value = getattr(metric, attr)
                # what step 1 makes of a state, and what a reduced slot is reduced with, depend on these alone: one
                # slot for a compute group's shared state, one per reduction where grouped members reduce it apart
                # (the placeholder, made from the Metric's dtype and device, exists from torchmetrics 1.4 on only)
                slot_key = (id(value), reduction, made)
                try:
                    index = seen.get(slot_key)
                except TypeError:  # a reduction that cannot be hashed: by its identity (the member keeps it alive)
                    slot_key = (id(value), ("id", id(reduction)), made)
                    index = seen.get(slot_key)
                if index is None:
                    index = seen[slot_key] = len(slots)
                    slots.append(fs.prepare_state(metric, attr, reduction, rule, stream_cpu))
                slot = slots[index]
                if slot.attr != attr or slot.reduction is not reduction:  # a compute group's member: its own names
                    slot = fs.Local(attr, reduction, slot.is_cat, slot.value, slot.tensors, slot.described)
                mine.append(slot)
                refs.append(index)
        needs = forms.computes_anew(metric)  # a cached result is returned without a sync
        own = forms.kind(code) == forms.OWN_PATH
        fingerprint = _fingerprint(key, metric)
        table += [fingerprint, code, int(needs), forms.detail(metric) if own else 0, len(refs), *refs]
        placement += [len(refs), *refs]
        shared += [fingerprint, code]
        states.append(mine)
    agreed = zlib.crc32(array.array("q", shared))
    return slots, states, fs.outgoing(slots, table, placement), agreed


@dataclass
class Outcome:
    """What the exchange settled, alike on every rank: whether every rank sent its states (``everywhere``), the
    members that join on every rank (their indices), the members whose synced states it set (each through
    ``set_synced``; none unless ``everywhere``), and the members that every rank syncs with torchmetrics' own
    ``_sync_dist``."""

    everywhere: bool
    joins: list[int]
    synced: list[Any] = field(default_factory=list)
    own_sync: list[Any] = field(default_factory=list)

    def torchmetrics_sync(self) -> Any:
        """A context in which the members of :attr:`own_sync`, and every Metric inside them, sync with torchmetrics'
        own ``_sync_dist``."""
        from torchmetrics import Metric

        metrics = [each for metric in self.own_sync for each in (metric, *forms.inside(metric))]
        return _syncs.own_sync(each for each in metrics if isinstance(each, Metric))


def sync_members(
    members: list[tuple[str, Any]],
    mode: str,
    codes: list[int] | None = None,
    set_synced: Callable[[Any, Callable[[], None]], None] | None = None,
    staged: bool = True,
    aside_here: bool = False,
) -> Outcome:
    """The one exchange over the default group: set the synced states of every member that joins on every rank and
    needs it, and settle which members every rank syncs with torchmetrics' own ``_sync_dist``.

    A collective of every rank where some member syncs over the default group (:func:`syncs_here`; the caller
    decides). ``codes``: each member's form (default: ``forms.forms_of`` for ``compute()``); ``set_synced``: what
    is done with each synced member and the function that sets its synced states (default: its own ``sync()``
    runs it, :func:`_set_synced`); ``staged``: this rank's joining members hold the states to send (a step's rank that
    ran no member yet sends its table alone, and then no member is synced by the exchange on any rank);
    ``aside_here``: this rank runs torchmetrics' own path for the whole collection (it sends its table alone), and
    then no member joins on any rank.
    """
    import torch
    import torch.distributed as dist

    from torchmetrics_gradpatch._gather import size_and_rank
    from torchmetrics_gradpatch.fused import large, transit, wire
    from torchmetrics_gradpatch.fused import sync as fs

    codes = forms.forms_of(members) if codes is None else codes
    apply = _set_synced if set_synced is None else set_synced
    group = dist.group.WORLD
    world_size, rank = size_and_rank(group)
    joining = [metric for code, (_, metric) in zip(codes, members, strict=True) if code == forms.JOINS]
    device, staging, stream_cpu = transit.devices((joining or [members[0][1]])[0].device, group)
    failure: Exception | None = None
    try:
        slots, states, out, agreed = _prepare(members, codes, stream_cpu, staged)
    except Exception as prepared:  # this rank's states cannot be sent: its header says so, and every rank raises
        slots, states, out, agreed, failure = [], [], fs.outgoing([]), 0, prepared
    name = "a MetricCollection"
    flags = fs.flags_of(slots) | (wire.FLAG_FAILED if failure is not None else 0)
    flags |= (0 if staged else wire.FLAG_UNSTAGED) | (wire.FLAG_ASIDE if aside_here else 0)
    with torch.no_grad():
        rows = fs.headers(out, flags, agreed, group, world_size, device)
        fs.raise_failures(name, rows, failure, group, world_size, device)
        got = fs.payloads(out, rows, rank, group, world_size, device)
        tables = [_rows(tuple(t)) for t in got.tables]
        everywhere = not any(row[wire.FLAGS] & wire.FLAG_UNSTAGED for row in rows)
        aside_anywhere = any(row[wire.FLAGS] & wire.FLAG_ASIDE for row in rows)
        # what the checks below find, and the plan, depend on the descriptions alone: a steady exchange makes them once
        key = (got.words, everywhere, aside_anywhere, rank)
        plan = _PLANS.get(key)
        if plan is None:
            error = _structure_error(members, tables, lambda text: fs.gather_texts(text, group, world_size, device))
            if error is not None:
                raise error
            own = _own_sync(members, tables)
            plan = _Plan.make(members, tables, own, codes, everywhere, aside_anywhere, rank, world_size, got)
        for i in plan.recompute:
            members[i][1]._computed = None  # a peer syncs it: this rank computes from the same states, not its cache
        if plan.joined:
            fs.check_grad_modes(name, rows, mode)
        if key not in _PLANS:
            for i in plan.joined:
                fs.validate(_member_name(*members[i]), states[i], plan.views[i])
            fs.remember(_PLANS, key, plan)
        if everywhere:
            fs.complete(got, out, slots, rows, rank, group, device, staging)
    outcome = Outcome(everywhere, plan.joins, own_sync=[members[i][1] for i in plan.own])
    if not plan.joined:
        return outcome
    keep = [[False] * len(got.slots[r]) for r in range(world_size)]
    for i in plan.joined:
        for s, state in enumerate(states[i]):
            if state.described.kind == wire.KIND_LIST and not state.is_cat:
                for r in range(world_size):
                    keep[r][plan.refs[i][r][s]] = True
    synced = fs.entries(slots, got, keep, rank, world_size, None, fs.node_wanted(rows, mode), device)
    reduced = got.reduced
    try:
        for i in plan.joined:
            metric = members[i][1]
            refs, shared = plan.refs[i], plan.shared[i]
            per_rank = [[synced[r][ref] for ref in refs[r]] for r in range(world_size)]
            if any(shared):
                per_rank = [
                    [
                        _own_copy(pieces, r != rank and keep[r][ref] and shared[s])
                        for s, (ref, pieces) in enumerate(zip(refs[r], row, strict=True))
                    ]
                    for r, row in enumerate(per_rank)
                ]
            values = (
                [
                    None if value is None else value.clone() if twice else value
                    for value, twice in zip((reduced.get(ref) for ref in refs[rank]), shared, strict=True)
                ]
                if reduced
                else None
            )
            set_states = functools.partial(fs.reduce, metric, states[i], plan.views[i], per_rank, values)
            moved = large.joined_in_place(states[i], values) if values is not None else None
            if moved:  # sync()'s copies of the cat states joined in place would add to the buffer's peak: none made
                with large.uncopied(metric, moved):
                    apply(metric, set_states)
            else:
                apply(metric, set_states)
            outcome.synced.append(metric)
    except BaseException:
        for metric in outcome.synced:
            metric.unsync()
        raise
    return outcome


def _own_copy(entries: list[Any], copy: bool) -> list[Any]:
    """A member's entries of another rank's slot: copies where an earlier member of its compute group holds them
    (torchmetrics syncs each member apart, so no two members share a synced tensor)."""
    return [entry.clone() if copy else entry for entry in entries]


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


def members_of(collection: Any, unrecognised: bool) -> tuple[list[tuple[str, Any]], bool]:
    """The collection's members as ``compute()`` and ``forward`` take them, and whether this rank runs torchmetrics'
    own path for the whole collection (``unrecognised``: a torchmetrics function it relies on is not recognised; or
    a class it does not trust, :func:`torchmetrics_gradpatch.fused.membership.untrusted`). Members are linked to their
    compute group's states (``items(copy_state=False)``) only where the rank takes part."""
    members = [(str(key), metric) for key, metric in collection._modules.items()]
    if unrecognised or membership.untrusted(collection, members) is not None:
        return members, True
    return [(str(key), metric) for key, metric in collection.items(keep_base=True, copy_state=False)], False


def _compute(original: Callable[[Any], Any], collection: Any, unrecognised: bool) -> Any:
    """The collection's ``compute()`` with one exchange for every member that joins (see the module docstring); in
    check mode, compared with torchmetrics' own (:mod:`torchmetrics_gradpatch.fused.check`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return original(collection)
    members, aside_here = members_of(collection, unrecognised)
    codes = forms.forms_of(members)
    if not members or not syncs_here(members, codes):
        return original(collection)
    if not _engine.effective_check():
        return _exchange_and_compute(original, collection, members, codes, aside_here)
    from torchmetrics_gradpatch.fused import check

    return check.run(
        "a MetricCollection's compute()",
        collection,
        lambda: _exchange_and_compute(original, collection, members, codes, aside_here),
        lambda: torchmetrics_own(original, collection),
    )


def torchmetrics_own(original: Callable[..., Any], collection: Any, *args: Any, **kwargs: Any) -> Any:
    """``original`` (the collection's own ``compute`` or ``forward``) with every Metric in the collection syncing
    with torchmetrics' own ``_sync_dist``."""
    from torchmetrics import Metric

    metrics = [each for each in forms.inside(collection) if isinstance(each, Metric)]
    with _syncs.own_sync(metrics):
        return original(collection, *args, **kwargs)


def _exchange_and_compute(
    original: Callable[[Any], Any], collection: Any, members: list[tuple[str, Any]], codes: list[int], aside_here: bool
) -> Any:
    outcome = sync_members(members, _engine.effective_mode(), codes, staged=not aside_here, aside_here=aside_here)
    joined = outcome.synced
    to_sync = [metric._to_sync for metric in joined]
    try:
        for metric in joined:
            metric._to_sync = False  # its own sync in compute() is skipped; its unsync still runs
        if joined:
            # compute() links compute groups again first; done now, it would give each member its group's first
            # member's synced states (the link was made above, before the exchange)
            collection._state_is_copy = True
        with outcome.torchmetrics_sync():
            return original(collection)
    except BaseException:
        for metric in joined:
            if metric._is_synced and metric._should_unsync:
                metric.unsync()  # what the failure left synced goes back to its local states
        raise
    finally:
        if joined:
            collection._state_is_copy = False  # as compute()'s items(copy_state=False) leaves it
        for metric, value in zip(joined, to_sync, strict=True):
            metric._to_sync = value


def _replacement(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)  # name, doc, __wrapped__ = the original, restored by uninstall
    def compute(self: Any) -> Any:
        if _engine.effective_sync() != "fused":
            return original(self)
        # a rank that steps aside still takes part in the exchange, so that every rank steps aside with it
        unrecognised = aside.stepping_aside(aside.COMPUTE)
        if _compile.is_compiling():  # under torch.compile: one graph break, the whole of it runs eagerly
            return _compile.run_eagerly(_compute, original, self, unrecognised)
        return _compute(original, self, unrecognised)

    return compute


#: ``MetricCollection.compute``, replaced by ``SITE.install()`` (now, or when ``torchmetrics.collections`` is
#: imported; idempotent) and put back, the very same object, by ``SITE.uninstall()``
SITE = Site("torchmetrics.collections", "MetricCollection", "compute", _MARK, _replacement)


def forget() -> None:
    """Forget the plans, member tables and fingerprints read once (``fused.reset``)."""
    _PLANS.clear()
    _rows.cache_clear()
    _fingerprint_of.cache_clear()
