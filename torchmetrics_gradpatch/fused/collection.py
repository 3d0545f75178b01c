"""One exchange per ``MetricCollection``: under the fused sync, ``compute()`` syncs every member that syncs at once.

``SITE`` replaces ``MetricCollection.compute``; :func:`sync_members` is the exchange it shares with the step
(:mod:`.step`). How: docs/design.md ("The fused exchange", "Members and their forms"); what it takes over:
docs/fused-sync.md.
"""

from __future__ import annotations

import array
import functools
import json
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch.distributed as dist

from torchmetrics_gradpatch import _compile, _engine, _syncs
from torchmetrics_gradpatch._site import COLLECTION_MARK, Site
from torchmetrics_gradpatch.fused import forms, internals, large, membership, recognise, wire

Members = list[tuple[str, Any]]  # a collection's members: (key, Metric), in its order
Method = Callable[..., Any]  # a collection's compute or forward, or what runs in its place


def _member_name(key: str, metric: Any) -> str:
    return f"{type(metric).__name__} (MetricCollection member {key!r})"


class _Row(NamedTuple):
    """One member in one rank's table: its fingerprint, form, whether it needs a sync, its detail and its slots."""

    fingerprint: int
    form: int
    needs: bool
    detail: int
    refs: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def _rows(table: tuple[int, ...]) -> list[_Row]:
    """A member table read back (once per table: callers do not change the rows)."""
    rows = []
    at = 1
    for _ in range(table[0]):  # per member: fingerprint, form, needs, detail, the slot count, the slots
        fingerprint, form, needs, detail, count = table[at : at + 5]
        rows.append(_Row(fingerprint, form, bool(needs), detail, table[at + 5 : at + 5 + count]))
        at += 5 + count
    return rows


class _Settled(NamedTuple):
    """What the member tables settle, alike on every rank: the members whose forms differ between ranks (every rank
    syncs them with torchmetrics' own ``_sync_dist``), the members that join, the ones computed anew, and per member
    the exchange syncs (``joined[i]``) every rank's slots, their descriptions, and which of this rank's slots an
    earlier member holds."""

    own: list[int]
    joins: list[int]
    recompute: list[int]
    joined: dict[int, tuple[list[tuple[int, ...]], list[list[Any]], list[bool]]]


def _settle(exchange: Any, members: Members, codes: list[int]) -> _Settled:
    """What the tables settle. Raises alike where the ranks hold other members (gathered, two collectives, to name
    them all) or where torchmetrics' own sync could not complete."""
    from torchmetrics_gradpatch.fused.exchange import describe, gather_texts, structure_error

    tables = [_rows(described.table) for described in exchange.described]
    sizes = {len(table) for table in tables}
    differing = [i for i in range(min(sizes)) if len({table[i].fingerprint for table in tables}) > 1]
    if len(sizes) > 1 or differing:
        mine = json.dumps([f"{key!r}: {describe(metric)}" for key, metric in members])
        held = [json.loads(text) for text in gather_texts(mine, exchange.group, exchange.world_size, exchange.device)]
        if len(sizes) > 1:
            rule = "the ranks are computing collections of different sizes"
            raise structure_error(
                "a MetricCollection", None, rule, {r: f"{len(h)} members: " + ", ".join(h) for r, h in enumerate(held)}
            )
        i = differing[0]
        rule = "the ranks hold different metrics as this member (another key, class, or other states or reductions)"
        raise structure_error(f"member {i} of a MetricCollection", None, rule, {r: h[i] for r, h in enumerate(held)})
    own = []
    for i, (key, metric) in enumerate(members):
        seen = [table[i] for table in tables]
        kinds = {forms.kind(row.form) for row in seen}
        if len(kinds) == 1 and (kinds != {forms.OWN_PATH} or len({(row.form, row.detail) for row in seen}) == 1):
            continue  # alike on every rank (an own path: the same one)
        if kinds <= {forms.JOINED, forms.OWN_PATH}:
            own.append(i)
            continue
        raise structure_error(
            _member_name(key, metric),
            None,
            "the ranks disagree on whether it syncs (torchmetrics' own sync would leave the ranks that sync waiting)",
            {r: forms.describe(row.form) for r, row in enumerate(seen)},
        )
    needed = [any(table[i].needs for table in tables) for i in range(len(members))]
    joins = [i for i, code in enumerate(codes) if code == forms.JOINS and i not in own]
    if exchange.flagged(wire.FLAG_ASIDE):
        joins = []
    recompute = [i for i, need in enumerate(needed) if need and (i in own or forms.kind(codes[i]) == forms.OWN_PATH)]
    joined: dict[int, tuple[list[tuple[int, ...]], list[list[Any]], list[bool]]] = {}
    given: set[int] = set()  # slots a member already holds: the next member of its group gets copies
    for i in [] if exchange.flagged(wire.FLAG_UNSTAGED) else joins:
        if needed[i]:
            refs = [table[i].refs for table in tables]
            views = [[exchange.every[r][ref] for ref in refs[r]] for r in range(exchange.world_size)]
            joined[i] = (refs, views, [ref in given for ref in refs[exchange.rank]])
            given.update(refs[exchange.rank])
    return _Settled(own, joins, recompute, joined)


#: (every rank's description, which flags some rank sent, this rank) -> what it settled, where its checks passed
_SETTLED: dict[tuple[Any, ...], _Settled] = {}


class Synced(NamedTuple):
    """A member's synced states, ready to set: torchmetrics' step 3 (:meth:`set`), or its own ``sync()`` with that
    step standing in for ``_sync_dist`` (:meth:`set_through_sync`)."""

    metric: Any
    states: list[Any]
    views: list[list[Any]]
    entries: list[list[list[Any]]]
    values: list[Any]
    joined: dict[str, Any]  # cat states concatenated in place: this rank's tensors as the buffer holds them

    def set(self) -> None:
        from torchmetrics_gradpatch.fused.exchange import set_states

        set_states(self.metric, self.states, self.views, self.entries, self.values)

    def set_through_sync(self) -> None:
        # sync() caches the local states as torchmetrics caches them (the ones joined in place uncopied)
        metric = self.metric
        internals.set_flags(metric, computed=None)  # another rank had to sync it: this rank computes afresh too
        internals.stand_in(metric, "_sync_dist", lambda dist_sync_fn=None, process_group=None: self.set())
        try:
            with large.uncopied(metric, self.joined):
                metric.sync(should_sync=True, distributed_available=lambda: True)
        finally:
            internals.stand_down(metric, "_sync_dist")


def torchmetrics_sync(modules: Iterable[Any]) -> Any:
    """A context in which every Metric among ``modules`` and inside them syncs with torchmetrics' own ``_sync_dist``."""
    from torchmetrics import Metric

    inside = (each for module in modules for each in (module, *forms.inside(module)))
    return _syncs.own_sync(each for each in inside if isinstance(each, Metric))


@dataclass
class Outcome:
    """What the exchange settled, alike on every rank: whether every rank sent its states, the members that join on
    every rank, each synced member's states (none unless ``everywhere``), and the members every rank syncs with
    torchmetrics' own ``_sync_dist`` (in :func:`torchmetrics_sync`)."""

    everywhere: bool
    joins: list[int]
    synced: dict[int, Synced] = field(default_factory=dict)
    own_sync: list[Any] = field(default_factory=list)

    def take(self) -> list[Synced]:
        """The synced members' states, handed over once: the outcome no longer holds their entries, nor the receive
        buffers those view, while the members compute."""
        taken = list(self.synced.values())
        self.synced.clear()
        return taken


def _table(exchange: Any, members: Members, codes: list[int], staged: bool) -> tuple[Any, ...]:
    """Step 1 for every joining member (``staged``; else the table travels alone): each member's states, the member
    table, what a proposal to reduce must agree on, and the fingerprint every rank must share."""
    from torchmetrics_gradpatch.fused.exchange import State, fingerprint

    states: list[list[State]] = []
    table = [len(members)]
    placement: list[int] = []  # every member's slot references
    shared: list[int] = []  # every member's fingerprint and form
    for (key, metric), code in zip(members, codes, strict=True):
        mine: list[State] = []
        if code == forms.JOINS and staged:
            rule = internals.placeholder_rule(metric)
            made = (metric.dtype, str(metric.device)) if rule else None
            for attr, reduction in internals.reductions(metric).items():
                # step 1 depends on these alone: one slot for a compute group's shared state, one per reduction where
                # grouped members reduce it apart (the placeholder is made from the Metric's dtype and device)
                slot_key: Any = (id(getattr(metric, attr)), reduction, made)
                try:
                    hash(slot_key)
                except TypeError:  # a reduction that cannot be hashed: by its identity (the member keeps it alive)
                    slot_key = (slot_key[0], ("id", id(reduction)), made)
                mine.append(State(attr, reduction, exchange.add(metric, attr, reduction, rule, slot_key)))
        member = fingerprint(metric, key)
        refs = [state.slot for state in mine]
        detail = forms.detail(metric) if forms.kind(code) == forms.OWN_PATH else 0
        # a cached result is returned without a sync: "needs" tells the peers
        table += [member, code, int(forms.computes_anew(metric)), detail, len(refs), *refs]
        placement += [len(refs), *refs]
        shared += [member, code]
        states.append(mine)
    return states, table, placement, zlib.crc32(array.array("q", shared))


def sync_members(
    members: Members, mode: str, codes: list[int] | None = None, staged: bool = True, aside_here: bool = False
) -> Outcome:
    """The one exchange over the default group for a collection's ``members`` (``codes``: their forms, by default
    for ``compute()``), a collective of every rank where some member syncs (:func:`adapt`). ``staged``: the joining
    members hold their states (else this rank sends its table alone, and no member is synced on any rank);
    ``aside_here``: this rank runs torchmetrics' own path for the whole collection (its table alone; no member joins
    on any rank)."""
    from torchmetrics_gradpatch.fused.exchange import Exchange, remember

    codes = forms.forms_of(members) if codes is None else codes
    joining = [metric for code, (_, metric) in zip(codes, members, strict=True) if code == forms.JOINS]
    exchange = Exchange("a MetricCollection", None, (joining or [members[0][1]])[0].device, mode)
    try:
        states, table, placement, agreed = _table(exchange, members, codes, staged and not aside_here)
    except Exception as error:  # this rank's states cannot be sent: its header says so, and every rank raises
        exchange.fail(error)
        states, table, placement, agreed = [], [], [], 0
    flags = (0 if staged else wire.FLAG_UNSTAGED) | (wire.FLAG_ASIDE if aside_here else 0)
    exchange.send(flags, agreed, table, placement)
    exchange.receive()  # the member tables are in the descriptions
    everywhere = not exchange.flagged(wire.FLAG_UNSTAGED)
    # what the tables settle depends on the descriptions and flags alone: a steady exchange settles them once
    key = (exchange.words, everywhere, exchange.flagged(wire.FLAG_ASIDE), exchange.rank)
    settled = _SETTLED.get(key) or _settle(exchange, members, codes)
    joined = settled.joined
    for i in settled.recompute:
        internals.set_flags(members[i][1], computed=None)  # a peer syncs it: computed from the same states here too
    if joined:
        exchange.check_grad_modes()
    for i, (_, views, _) in joined.items():
        exchange.validate(_member_name(*members[i]), states[i], views)
    remember(_SETTLED, key, settled)
    if everywhere:
        exchange.settle()
    outcome = Outcome(everywhere, settled.joins, own_sync=[members[i][1] for i in settled.own])
    if not joined:
        return outcome
    rank, slots = exchange.rank, exchange.slots
    keep = [[False] * len(described) for described in exchange.every]  # slots that become list content: copies
    for every_refs, _, _ in joined.values():
        for s, ref in enumerate(every_refs[rank]):
            if exchange.every[rank][ref].kind == wire.KIND_LIST and not slots[ref].is_cat:
                for r, refs in enumerate(every_refs):
                    keep[r][refs[s]] = True
    entries = exchange.entries(keep)
    for i, (every_refs, views, shared) in joined.items():
        # torchmetrics syncs each member apart, so no two members share a synced tensor: copies past the first
        per_rank = [
            [
                [e.clone() for e in entries[r][ref]] if r != rank and keep[r][ref] and shared[s] else entries[r][ref]
                for s, ref in enumerate(refs)
            ]
            for r, refs in enumerate(every_refs)
        ]
        values = []
        in_place = {}  # cat states concatenated in place: this rank's tensors as the buffer holds them
        for state, twice in zip(states[i], shared, strict=True):
            value = exchange.reduced.get(state.slot)
            values.append(value.clone() if twice and value is not None else value)
            if slots[state.slot].is_cat and value is not None:
                in_place[state.attr] = slots[state.slot].tensors[0] if slots[state.slot].tensors else None
        outcome.synced[i] = Synced(members[i][1], states[i], views, per_rank, values, in_place)
    return outcome


def adapt(
    fused: Method, original: Method, metrics: Any, unrecognised: bool, on_step: bool, /, *args: Any, **kwargs: Any
) -> Any:
    """``original`` (the collection's ``compute`` or, ``on_step``, ``forward``) as ``fused(original, metrics,
    members, codes, aside_here, *args, **kwargs)`` runs it, with one exchange for every member that joins; in check
    mode compared with torchmetrics' own. ``aside_here``: this rank runs torchmetrics' own path for the whole
    collection (``unrecognised``, or a class it does not trust: :mod:`.membership`); the members are linked to their
    compute group's states (``items(copy_state=False)``) only where it does not."""
    if not (dist.is_available() and dist.is_initialized()):
        return original(metrics, *args, **kwargs)
    members = [(str(key), metric) for key, metric in internals.children(metrics).items()]
    aside_here = unrecognised or membership.untrusted(metrics, members) is not None
    if not aside_here:
        members = [(str(key), metric) for key, metric in metrics.items(keep_base=True, copy_state=False)]
    codes = forms.forms_of(members, on_step=on_step)
    # where no member syncs over the default group (in compute(): with no cached result), the rank issues no
    # collective, as torchmetrics' own path issues none
    if not any(
        forms.kind(code) in (forms.JOINED, forms.OWN_PATH) and (on_step or forms.computes_anew(metric))
        for code, (_, metric) in zip(codes, members, strict=True)
    ):
        return original(metrics, *args, **kwargs)
    if not _engine.effective_check():
        return fused(original, metrics, members, codes, aside_here, *args, **kwargs)
    from torchmetrics_gradpatch.fused import compare

    def own() -> Any:
        with torchmetrics_sync([metrics]):
            return original(metrics, *args, **kwargs)

    what = "a MetricCollection's forward" if on_step else "a MetricCollection's compute()"
    return compare.run(
        what, metrics, lambda: fused(original, metrics, members, codes, aside_here, *args, **kwargs), own
    )


def _compute(original: Method, collection: Any, members: Members, codes: list[int], aside_here: bool) -> Any:
    outcome = sync_members(members, _engine.effective_mode(), codes, staged=not aside_here, aside_here=aside_here)
    joined: list[Any] = []
    try:
        for synced in outcome.take():
            synced.set_through_sync()
            joined.append(synced.metric)
    except BaseException:
        for metric in joined:
            metric.unsync()
        raise
    to_sync = [internals.flag(metric, "to_sync") for metric in joined]
    try:
        for metric in joined:
            internals.set_flags(metric, to_sync=False)  # its own sync in compute() is skipped; its unsync still runs
        if joined:
            # compute() links compute groups again first; done now, it would give each member its group's first
            # member's synced states (the link was made above, before the exchange)
            internals.set_state_is_copy(collection, True)
        with torchmetrics_sync(outcome.own_sync):
            return original(collection)
    except BaseException:
        for metric in joined:
            if internals.flag(metric, "is_synced") and internals.flag(metric, "should_unsync"):
                metric.unsync()  # what the failure left synced goes back to its local states
        raise
    finally:
        if joined:
            internals.set_state_is_copy(collection, False)  # as compute()'s items(copy_state=False) leaves it
        for metric, value in zip(joined, to_sync, strict=True):
            internals.set_flags(metric, to_sync=value)


def _replacement(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)  # name, doc, __wrapped__ = the original, restored by uninstall
    def compute(self: Any) -> Any:
        if _engine.effective_sync() != "fused":
            return original(self)
        # a rank that steps aside still takes part in the exchange, so that every rank steps aside with it
        unrecognised = recognise.stepping_aside(recognise.COMPUTE)
        if _compile.is_compiling():  # under torch.compile: one graph break, the whole of it runs eagerly
            return _compile.run_eagerly(adapt, _compute, original, self, unrecognised, False)
        return adapt(_compute, original, self, unrecognised, False)

    return compute


#: ``MetricCollection.compute``, replaced by ``SITE.install()`` and put back, the very same object, on ``uninstall()``
SITE = Site("torchmetrics.collections", "MetricCollection", "compute", COLLECTION_MARK, _replacement)


def forget() -> None:
    """Forget what the tables settled and the tables read once (``fused.reset``)."""
    _SETTLED.clear()
    _rows.cache_clear()
