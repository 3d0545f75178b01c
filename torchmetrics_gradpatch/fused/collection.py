"""One exchange per ``MetricCollection``: under the fused sync, ``compute()`` syncs every member that syncs at once.

``SITE`` replaces ``MetricCollection.compute`` (put back, the very same object, on uninstall). The replacement sends
a member table (each member's fingerprint, form and slots) and the states of every member the exchange takes over
(:mod:`.forms`; a collection it trusts: :mod:`.membership`) in one :class:`~.exchange.Exchange` over the default
group, sets each such member's synced states through its own ``sync()``, and runs torchmetrics' own ``compute()``
with those members' own sync skipped. Every other member syncs in its own ``compute()``, as under torchmetrics.
:func:`sync_members` is the exchange the step shares. What it takes over and why: docs/fused-sync.md.
"""

from __future__ import annotations

import array
import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchmetrics_gradpatch import _compile, _engine, _syncs
from torchmetrics_gradpatch._site import COLLECTION_MARK, Site
from torchmetrics_gradpatch.fused import forms, internals, large, membership, recognise, wire

_MEMBER_WORDS = 4  # per member in the table: fingerprint, form, needs, detail; then its slot references


def syncs_here(members: list[tuple[str, Any]], codes: list[int], on_step: bool = False) -> bool:
    """Whether some member of this rank syncs over the default group (in ``compute()``: and holds no cached result):
    else the rank issues no collective, as torchmetrics' own path issues none there."""
    return any(
        forms.kind(code) in (forms.JOINED, forms.OWN_PATH) and (on_step or forms.computes_anew(metric))
        for code, (_, metric) in zip(codes, members, strict=True)
    )


def _member_name(key: str, metric: Any) -> str:
    return f"{type(metric).__name__} (MetricCollection member {key!r})"


def _structure_error(exchange: Any, members: list[tuple[str, Any]], tables: list[list[_Row]]) -> Exception | None:
    """The error every rank raises when the ranks hold other members (``None``: they hold the same); where the
    tables disagree, every rank's members are gathered (two collectives) so that one text names them all."""
    import json

    from torchmetrics_gradpatch.fused.exchange import describe, gather_texts, structure_error

    counts = {r: len(table) for r, table in enumerate(tables)}
    differing = [i for i in range(min(counts.values())) if len({table[i].fingerprint for table in tables}) > 1]
    if len(set(counts.values())) == 1 and not differing:
        return None
    mine = json.dumps([f"{key!r}: {describe(metric)}" for key, metric in members])
    held = [json.loads(text) for text in gather_texts(mine, exchange.group, exchange.world_size, exchange.device)]
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


def _own_sync(members: list[tuple[str, Any]], tables: list[list[_Row]]) -> list[int]:
    """The members every rank syncs with torchmetrics' own ``_sync_dist``: their forms differ between ranks but every
    rank's torchmetrics would sync them over the default group. Raises alike where torchmetrics' own sync could not
    complete (one rank syncs a member another does not, or raises as synced already)."""
    from torchmetrics_gradpatch.fused.exchange import structure_error

    own = []
    for i, (key, metric) in enumerate(members):
        seen = [table[i] for table in tables]
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


@dataclass
class _Settled:
    """What one exchange's tables settle, alike on every rank: the members every rank syncs with torchmetrics' own
    sync (``own``), those that join on every rank (``joins``) and those the exchange syncs (``joined``), those whose
    cached result is dropped (``recompute``), and per joined member every rank's slots (``refs[i][r]``) and
    descriptions (``views[i][r]``), and which of this rank's slots an earlier member holds (``shared[i]``)."""

    own: list[int]
    joins: list[int]
    joined: list[int]
    recompute: list[int]
    refs: dict[int, list[list[int]]] = field(default_factory=dict)
    views: dict[int, list[list[Any]]] = field(default_factory=dict)
    shared: dict[int, list[bool]] = field(default_factory=dict)

    @classmethod
    def of(cls, exchange: Any, members: list[tuple[str, Any]], codes: list[int], tables: list[list[_Row]]) -> _Settled:
        error = _structure_error(exchange, members, tables)
        if error is not None:
            raise error
        own = _own_sync(members, tables)
        everywhere = not exchange.flagged(wire.FLAG_UNSTAGED)
        needed = [any(t[i].needs for t in tables) for i in range(len(members))]
        aside = exchange.flagged(wire.FLAG_ASIDE)
        joins = [] if aside else [i for i, c in enumerate(codes) if c == forms.JOINS and i not in own]
        settled = cls(
            own,
            joins,
            [i for i in joins if everywhere and needed[i]],
            [i for i in range(len(members)) if needed[i] and (i in own or forms.kind(codes[i]) == forms.OWN_PATH)],
        )
        given: set[int] = set()  # slots a member already holds: the next member of its group gets copies
        for i in settled.joined:
            refs = settled.refs[i] = [tables[r][i].refs for r in range(exchange.world_size)]
            settled.views[i] = [[exchange.every[r][ref] for ref in refs[r]] for r in range(exchange.world_size)]
            settled.shared[i] = [ref in given for ref in refs[exchange.rank]]
            given.update(refs[exchange.rank])
        return settled


#: (every rank's description, which flags some rank sent, this rank) -> what it settled, where its checks passed
_SETTLED: dict[tuple[Any, ...], _Settled] = {}


@dataclass
class Synced:
    """A member's synced states, ready to set: torchmetrics' step 3 over the exchange's entries (:meth:`set`), or
    through the member's own ``sync()`` (:meth:`set_through_sync`)."""

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
        """Set them through ``sync()``, with :meth:`set` standing in for ``_sync_dist`` for that one call, so its
        cache of the local states is taken as torchmetrics takes it (none made of the states joined in place)."""
        metric = self.metric
        internals.set_flags(metric, computed=None)  # another rank had to sync it: this rank computes afresh too
        internals.stand_in(metric, "_sync_dist", lambda dist_sync_fn=None, process_group=None: self.set())
        try:
            with large.uncopied(metric, self.joined):
                metric.sync(should_sync=True, distributed_available=lambda: True)
        finally:
            internals.stand_down(metric, "_sync_dist")


@dataclass
class Outcome:
    """What the exchange settled, alike on every rank: whether every rank sent its states (``everywhere``), the
    members that join on every rank, each synced member's states (none unless ``everywhere``), and the members
    every rank syncs with torchmetrics' own ``_sync_dist``."""

    everywhere: bool
    joins: list[int]
    synced: dict[int, Synced] = field(default_factory=dict)
    own_sync: list[Any] = field(default_factory=list)

    def torchmetrics_sync(self) -> Any:
        """A context in which the members of :attr:`own_sync`, and every Metric inside them, sync with torchmetrics'
        own ``_sync_dist``."""
        from torchmetrics import Metric

        metrics = [each for metric in self.own_sync for each in (metric, *forms.inside(metric))]
        return _syncs.own_sync(each for each in metrics if isinstance(each, Metric))


def _table(exchange: Any, members: list[tuple[str, Any]], codes: list[int], staged: bool) -> tuple[Any, ...]:
    """Step 1 for every joining member (``staged``: their states are ready to send; else only the table travels):
    each member's states, the member table, what a proposal to reduce must agree on, and the fingerprint every rank
    must share."""
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
        own = forms.kind(code) == forms.OWN_PATH
        member = fingerprint(metric, key)
        refs = [state.slot for state in mine]
        # a cached result is returned without a sync: "needs" tells the peers
        table += [member, code, int(forms.computes_anew(metric)), forms.detail(metric) if own else 0, len(refs), *refs]
        placement += [len(refs), *refs]
        shared += [member, code]
        states.append(mine)
    return states, table, placement, zlib.crc32(array.array("q", shared))


def sync_members(
    members: list[tuple[str, Any]],
    mode: str,
    codes: list[int] | None = None,
    staged: bool = True,
    aside_here: bool = False,
) -> Outcome:
    """The one exchange over the default group for a collection's ``members`` (``codes``: their forms, by default
    for ``compute()``): every
    member that joins on every rank comes back synced, ready to set; and which members every rank syncs with
    torchmetrics' own ``_sync_dist``.

    A collective of every rank where some member syncs over the default group (:func:`syncs_here`). ``staged``:
    this rank's joining members hold the states to send (a step's rank that ran no member yet sends its table
    alone; then no member is synced on any rank); ``aside_here``: this rank runs torchmetrics' own path for the
    whole collection (it sends its table alone; then no member joins on any rank)."""
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
    tables = [_rows(t) for t in exchange.tables]
    everywhere = not exchange.flagged(wire.FLAG_UNSTAGED)
    # what the tables settle depends on the descriptions and flags alone: a steady exchange settles them once
    key = (exchange.words, everywhere, exchange.flagged(wire.FLAG_ASIDE), exchange.rank)
    settled = _SETTLED.get(key) or _Settled.of(exchange, members, codes, tables)
    for i in settled.recompute:
        internals.set_flags(members[i][1], computed=None)  # a peer syncs it: computed from the same states here too
    if settled.joined:
        exchange.check_grad_modes()
    for i in settled.joined:
        exchange.validate(_member_name(*members[i]), states[i], settled.views[i])
    remember(_SETTLED, key, settled)
    if everywhere:
        exchange.settle()
    outcome = Outcome(everywhere, settled.joins, own_sync=[members[i][1] for i in settled.own])
    if not settled.joined:
        return outcome
    rank, reduced = exchange.rank, exchange.reduced
    keep = [[False] * len(exchange.every[r]) for r in range(exchange.world_size)]  # slots that become list content
    for i in settled.joined:
        for s, ref in enumerate(settled.refs[i][rank]):
            if exchange.every[rank][ref].kind == wire.KIND_LIST and not exchange.slots[ref].is_cat:
                for r in range(exchange.world_size):
                    keep[r][settled.refs[i][r][s]] = True
    entries = exchange.entries(keep)
    for i in settled.joined:
        refs, shared = settled.refs[i], settled.shared[i]
        # torchmetrics syncs each member apart, so no two members share a synced tensor: copies past the first
        per_rank = [
            [
                [e.clone() for e in entries[r][ref]] if r != rank and keep[r][ref] and shared[s] else entries[r][ref]
                for s, ref in enumerate(refs[r])
            ]
            for r in range(exchange.world_size)
        ]
        values = [
            None if value is None else value.clone() if twice else value
            for value, twice in zip((reduced.get(ref) for ref in refs[rank]), shared, strict=True)
        ]
        joined = {
            state.attr: exchange.slots[state.slot].tensors[0] if exchange.slots[state.slot].tensors else None
            for state, value in zip(states[i], values, strict=True)
            if exchange.slots[state.slot].is_cat and value is not None
        }
        outcome.synced[i] = Synced(members[i][1], states[i], settled.views[i], per_rank, values, joined)
    return outcome


def members_of(collection: Any, unrecognised: bool) -> tuple[list[tuple[str, Any]], bool]:
    """The collection's members as ``compute()`` and ``forward`` take them, and whether this rank runs torchmetrics'
    own path for the whole collection (``unrecognised``: a torchmetrics function it relies on is not recognised; or
    a class it does not trust, :func:`torchmetrics_gradpatch.fused.membership.untrusted`). Members are linked to their
    compute group's states (``items(copy_state=False)``) only where the rank takes part."""
    members = [(str(key), metric) for key, metric in internals.children(collection).items()]
    if unrecognised or membership.untrusted(collection, members) is not None:
        return members, True
    return [(str(key), metric) for key, metric in collection.items(keep_base=True, copy_state=False)], False


def _compute(original: Callable[[Any], Any], collection: Any, unrecognised: bool) -> Any:
    """The collection's ``compute()`` with one exchange for every member that joins (see the module docstring); in
    check mode, compared with torchmetrics' own (:mod:`torchmetrics_gradpatch.fused.compare`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return original(collection)
    members, aside_here = members_of(collection, unrecognised)
    codes = forms.forms_of(members)
    if not members or not syncs_here(members, codes):
        return original(collection)
    if not _engine.effective_check():
        return _exchange_and_compute(original, collection, members, codes, aside_here)
    from torchmetrics_gradpatch.fused import compare

    return compare.run(
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
    joined: list[Any] = []
    try:
        for synced in outcome.synced.values():
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
        with outcome.torchmetrics_sync():
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
            return _compile.run_eagerly(_compute, original, self, unrecognised)
        return _compute(original, self, unrecognised)

    return compute


#: ``MetricCollection.compute``, replaced by ``SITE.install()`` (now, or when ``torchmetrics.collections`` is
#: imported; idempotent) and put back, the very same object, by ``SITE.uninstall()``
SITE = Site("torchmetrics.collections", "MetricCollection", "compute", COLLECTION_MARK, _replacement)


def forget() -> None:
    """Forget what the tables settled and the tables read once (``fused.reset``)."""
    _SETTLED.clear()
    _rows.cache_clear()
