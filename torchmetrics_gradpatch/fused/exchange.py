"""One fused exchange: this rank's states in, every rank's synced states out, over one process group.

:class:`Exchange` owns a *slot* per distinct state, its buffers and its phases, run once each in order (``add``,
``send``, ``receive``, ``validate``, ``settle``, ``entries``); :func:`set_states` is torchmetrics' step 3 for one
Metric, :func:`sync_metric` the single sync. Every error the ranks' disagreement causes is raised on every rank, with
the same text, after the same collectives (docs/design.md, "The fused exchange").
"""

from __future__ import annotations

import functools
import itertools
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes, _gather
from torchmetrics_gradpatch._engine import effective_check
from torchmetrics_gradpatch._errors import FusedSyncError
from torchmetrics_gradpatch._gather import chunk_bytes, chunk_refusal, size_and_rank
from torchmetrics_gradpatch._global import grad_mode_error
from torchmetrics_gradpatch._modes import check_mode
from torchmetrics_gradpatch.fused import grad, internals, large, reduced, transit, wire


class CheckSettingError(FusedSyncError):
    """The ranks' check settings differ: raised on every rank at collective 1 (a rank in check mode then knows that
    its peers run no check collectives)."""


@dataclass(slots=True)  # made for every state at every sync
class Slot:
    """One state as this rank sends it, after step 1: the value it was made from, its tensors, their description."""

    reduction: Any
    is_cat: bool
    value: Any
    tensors: list[torch.Tensor]
    described: wire.State


class State(NamedTuple):
    """A Metric's state in an exchange: its name, its reduction and its slot's index (compute groups share slots)."""

    attr: str
    reduction: Any
    slot: int


@functools.cache
def _dim_zero_cat() -> Any:
    from torchmetrics.utilities.data import dim_zero_cat  # the object torchmetrics.metric compares reductions with

    return dim_zero_cat


def is_cat(reduction: object) -> bool:
    """Whether ``reduction`` is torchmetrics' ``dim_zero_cat``, compared as ``torchmetrics.metric`` compares it."""
    return bool(reduction == _dim_zero_cat())


def reduction_name(fn: object) -> str:
    return "None" if fn is None else str(getattr(fn, "__qualname__", type(fn).__qualname__))


def describe(metric: Any) -> str:
    """``metric`` (any object) as errors name it to the other ranks: its class and each state's reduction."""
    held = internals.reductions(metric).items()
    states = ", ".join(f"{a}: {reduction_name(r).removeprefix('dim_zero_')}" for a, r in held)
    return f"{type(metric).__name__} ({states})"


def fingerprint(metric: Any, key: str = "") -> int:
    """The ``key`` a collection holds ``metric`` under, its class and its states' reductions, as one number."""
    reductions = tuple(internals.reductions(metric).items())
    try:
        return _fingerprint(key, type(metric).__qualname__, reductions)
    except TypeError:  # a reduction that cannot be hashed: not cached
        return _fingerprint.__wrapped__(key, type(metric).__qualname__, reductions)


@functools.lru_cache(maxsize=1024)
def _fingerprint(key: str, cls: str, reductions: tuple[tuple[str, Any], ...]) -> int:
    text = "|".join([key, cls, *(f"{a}:{reduction_name(r)}" for a, r in reductions)])
    return zlib.crc32(text.encode())


def structure_error(what: str, attr: str | None, rule: str, seen: dict[int, str]) -> FusedSyncError:
    """The error for state ``attr`` of ``what`` (``None``: ``what`` itself) whose ranks break ``rule``, as ``seen``."""
    named = f"state {attr!r} of {what}" if attr is not None else what
    held = "; ".join(f"rank {rank}: {value}" for rank, value in sorted(seen.items()))
    return FusedSyncError(
        f"torchmetrics_gradpatch: fused sync of {named}: {rule}. The ranks hold: {held}. Every rank of the group "
        "raised this error after the same exchange, before changing any state; none is left waiting. Make every "
        "rank hold states of the same structure, or sync with torchmetrics' own path (sync='torchmetrics')."
    )


def gather_texts(text: str, group: Any, world_size: int, device: Any) -> list[str]:
    """Every rank's ``text`` (two collectives): called only where every rank found from the same exchanged facts that
    an error must name what each rank holds."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    lengths = _gather.exchange(torch.tensor([data.numel()], device=device), group, world_size)[:, 0].tolist()
    padded = torch.nn.functional.pad(data, (0, max(lengths) - data.numel()))
    rows = _gather.exchange(padded, group, world_size).cpu()
    return [bytes(row[:n].tolist()).decode("utf-8", "replace") for row, n in zip(rows, lengths, strict=True)]


#: While check mode runs a fused sync it pushes a list here; each list state synced with other lengths on some rank is
#: noted in it as ``(metric, attr)``: torchmetrics' own sync gathers those one by one and would wait.
uneven_lists: list[list[tuple[Any, str]]] = []

#: The exchanges whose descriptions validate() passed (the newest 64): a steady sync validates its layout once.
_VALID: dict[Hashable, None] = {}


def remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    """Keep ``value`` under ``key`` in ``memo``, which holds its newest 64 entries."""
    memo[key] = value
    while len(memo) > 64:
        memo.pop(next(iter(memo)))


def forget() -> None:
    """Forget the layouts validated once and the fingerprints (``fused.reset``)."""
    _VALID.clear()
    _fingerprint.cache_clear()
    reduced.forget()


_NOT_SENT = torch.empty(0, dtype=torch.uint8)  # the stand-in for a tensor of a dtype the format cannot carry
_KINDS = {wire.KIND_TENSOR: "a tensor", wire.KIND_LIST: "a list of tensors", wire.KIND_OTHER: "something else"}


class Exchange:
    """One fused exchange over ``group`` (``None``: the default group) for states of Metrics on ``device``; ``name``
    is what errors call its owner. Made per sync; its phases run once each, in order."""

    def __init__(self, name: str, group: Any, device: Any, mode: str = "local") -> None:
        self.name = name
        self.group = dist.group.WORLD if group is None else group
        self.world_size, self.rank = size_and_rank(self.group)
        self.mode = check_mode(mode)
        self.device, self.staging, self.stream_cpu = transit.devices(device, self.group)
        self.slots: list[Slot] = []
        self._keys: dict[Hashable, int] = {}
        self.failure: Exception | None = None
        self.rows: list[list[int]] = []
        self.words: tuple[tuple[int, ...], ...] = ()
        self.every: list[tuple[wire.State, ...]] = []
        self.described: list[wire.Described] = []  # every rank's description as read back
        self.gathered: list[list[list[torch.Tensor]]] = []
        self.skip: tuple[int, ...] = ()
        self.reduced: dict[int, torch.Tensor] = {}
        self.proposal = reduced.Proposal()
        self._own: tuple[torch.Tensor, wire.Views] | None = None
        self._sending: tuple[Any, ...] = ()  # between send and receive: what collective 2 may need

    def add(self, metric: Any, attr: str, reduction: Any, rule: bool, key: Hashable | None = None) -> int:
        """Step 1 for ``metric``'s state ``attr``, exactly as ``_sync_dist`` does it (``rule``: the placeholder rule);
        returns its slot. A state added before under ``key`` is that slot."""
        if key is not None and (found := self._keys.get(key)) is not None:
            return found
        self.slots.append(self._prepared(metric, attr, reduction, rule))
        if key is not None:
            self._keys[key] = len(self.slots) - 1
        return len(self.slots) - 1

    def fail(self, error: Exception) -> None:
        """This rank cannot send its states: its header says so, and every rank raises after collective 1."""
        self.failure, self.slots = error, []

    def _prepared(self, metric: Any, attr: str, reduction: Any, rule: bool) -> Slot:
        value = getattr(metric, attr)
        cat, streamed = is_cat(reduction), self.stream_cpu
        # a conjugate or negative view is sent as the values it reads as (torchmetrics' torch.cat, pad or stack
        # resolves it), resolved here, before the header: a byte view of it would raise on this rank alone
        if isinstance(value, torch.Tensor):  # the common case first: a tensor state (a steady sync's, many of them)
            tensor = _bytes.resolved(value).contiguous()
            return Slot(reduction, cat, value, [tensor], wire.tensor_state(tensor, streamed and tensor.is_cpu))
        placeholder = False
        if cat and isinstance(value, list):
            value = list(value)  # this sync's own list: emptied once the large path wrote its tensors
            if len(value) > 1 or (value and isinstance(value[0], torch.Tensor) and _bytes.unresolved(value[0])):
                deferred = large.defer(value, streamed)  # joined later, or written one by one
                if deferred is not None:
                    return Slot(reduction, True, value, *deferred)
            if len(value) > 1:
                value = [_dim_zero_cat()(value)]
        if rule and cat and isinstance(value, list) and not value:
            value, placeholder = [torch.tensor([], device=metric.device, dtype=metric.dtype)], True
        if isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
            tensors = [_bytes.resolved(v).contiguous() for v in value]
            pieces = tuple(wire.piece_of(t, streamed and t.device.type == "cpu") for t in tensors)
            return Slot(reduction, cat, value, tensors, wire.State(wire.KIND_LIST, pieces, placeholder))
        return Slot(reduction, cat, value, [], wire.State(wire.KIND_OTHER, ()))

    def send(
        self, flags: int = 0, fingerprint: int = 0, table: Sequence[int] = (), placement: Sequence[int] = ()
    ) -> list[list[int]]:
        """Collective 1: every rank's header row (returned) and, where it fits the group's capacity, its description
        and pieces, ``table`` (a collection's member table) in front; ``placement``: what a proposal to reduce must
        agree on besides the slots. Refusals are raised on every rank."""
        flags |= wire.FLAG_GRAD_MODE if torch.is_grad_enabled() else 0
        flags |= wire.FLAG_REQUIRES_GRAD if any(t.requires_grad for s in self.slots for t in s.tensors) else 0
        flags |= wire.FLAG_CHECK if effective_check() else 0
        flags |= wire.FLAG_FAILED if self.failure is not None else 0
        for s in large.chosen(self.slots):  # step 1 completed: they leave the payload
            piece = replace(self.slots[s].described.pieces[0], separate=True)
            self.slots[s].described = replace(self.slots[s].described, pieces=(piece,))
        for slot in self.slots:  # and the deferred states that stay in it are joined
            if large.deferred(slot) and not slot.described.pieces[0].separate:
                slot.tensors[:] = [_dim_zero_cat()(slot.value).contiguous()]
        words = wire.encode([s.described for s in self.slots], table)
        self.proposal = proposal = reduced.propose(self.slots, placement)
        whole = wire.read(tuple(words))
        # the payload collective 1 carries leaves out what this rank proposes to reduce
        proposed = wire.read(tuple(words), proposal.slots) if proposal.slots else whole
        sent = [
            [t if p.dtype is not None else _NOT_SENT for t, p in zip(s.tensors, s.described.pieces, strict=True)]
            for s in self.slots
        ]
        header = [len(words), whole.size, flags, fingerprint, proposed.size, proposal.digest, chunk_bytes()]
        with torch.no_grad():
            self.rows, inline, regions = wire.gather_first(
                header, words, sent, proposed.offsets, proposed.size, self.group, self.world_size, self.device
            )
        self._sending = (words, sent, whole, proposed, inline, regions)
        if len({row[wire.FORMAT] for row in self.rows}) > 1:
            raise FusedSyncError(
                "torchmetrics_gradpatch: fused sync: the ranks run different versions of the fused sync's format ("
                + "; ".join(f"rank {r}: {row[wire.FORMAT]:#x}" for r, row in enumerate(self.rows))
                + "); install the same torchmetrics_gradpatch on every rank."
            )
        wire.Group.of(self.group).agree(self.rows)  # every rank, from the same rows, before anything else can raise
        refusal = chunk_refusal([row[wire.CHUNK] for row in self.rows])
        if refusal is not None:
            raise FusedSyncError(refusal)
        checking = [bool(row[wire.FLAGS] & wire.FLAG_CHECK) for row in self.rows]
        if len(set(checking)) > 1:
            raise CheckSettingError(
                "torchmetrics_gradpatch: fused sync: the ranks' check settings differ (check mode on rank(s) "
                f"{[r for r, c in enumerate(checking) if c]}, off on rank(s) "
                f"{[r for r, c in enumerate(checking) if not c]}). Every rank raised this error after the same "
                "exchange, before changing any state. Set check the same way on every rank (patch(check=...), "
                "patched(check=...) or TORCHMETRICS_GRADPATCH_CHECK)."
            )
        failed = [r for r, row in enumerate(self.rows) if row[wire.FLAGS] & wire.FLAG_FAILED]
        if failed:
            own = "" if self.failure is None else f"{type(self.failure).__name__}: {self.failure}"
            texts = gather_texts(own, self.group, self.world_size, self.device)
            raise FusedSyncError(
                f"torchmetrics_gradpatch: fused sync of {self.name}: rank(s) {failed} could not prepare their states "
                f"for the sync ({'; '.join(f'rank {r}: {texts[r]}' for r in failed)}). Every rank raised this error "
                "after the same exchange, before changing any state; none is left waiting. torchmetrics' own sync "
                "raises the same on those ranks alone; fix what they hold."
            ) from self.failure
        return self.rows

    def receive(self) -> None:
        """Collective 2 where some payload did not fit the first, then every rank's description and pieces."""
        words, sent, whole, proposed, inline, regions = self._sending
        del self._sending  # the receive buffers live on in the pieces' views only
        self.skip = skip = self.proposal.slots if reduced.agreed(self.rows, self.proposal) else ()
        with torch.no_grad():
            # an inline payload leaves out what its rank proposed to reduce: usable where that was agreed, or empty
            buffers = regions
            if not all(
                row[wire.FLAGS] & wire.FLAG_INLINE and (skip or row[wire.SIZE_REDUCED] == row[wire.SIZE])
                for row in self.rows
            ):
                largest = max(row[wire.SIZE_REDUCED if skip else wire.SIZE] for row in self.rows)
                payload = wire.pack(words, sent, (proposed if skip else whole).offsets, largest, self.device)
                buffers = list(wire.gather_rows(payload, self.group, self.world_size))  # collective 2
            del regions
        for r, (buffer, row) in enumerate(zip(buffers, self.rows, strict=True)):
            known = words if r == self.rank else inline[r]
            theirs = tuple(known if known is not None else wire.words_of(buffer, row[wire.WORDS]))
            described = wire.read(theirs, skip)
            self.described.append(described)
            self.words += (theirs,)
            self.every.append(described.states)
            if r == self.rank:  # its own pieces are its own tensors: viewed back only where global mode's node needs
                self.gathered.append([[] if v is None else [wire.ABSENT] * len(v) for v in described.views])
                self._own = (buffer, described.views)
            else:
                self.gathered.append(wire.unpack(buffer, described.views))

    def flagged(self, flag: int) -> bool:
        return any(row[wire.FLAGS] & flag for row in self.rows)

    def check_grad_modes(self) -> None:
        """In global mode, refuse alike where the ranks disagree on grad mode while some state requires grad."""
        if self.mode != "global":
            return
        grad_mode = [bool(row[wire.FLAGS] & wire.FLAG_GRAD_MODE) for row in self.rows]
        requiring = [r for r, row in enumerate(self.rows) if row[wire.FLAGS] & wire.FLAG_REQUIRES_GRAD]
        if requiring and len(set(grad_mode)) > 1:
            raise grad_mode_error(f"fused global-mode sync of {self.name}", "synced", grad_mode, requiring)

    def validate(self, name: str, states: list[State], views: Sequence[Sequence[wire.State]]) -> None:
        """Refuse, alike on every rank, what torchmetrics' sync cannot complete and one process could not hold:
        ``views[r][i]`` is rank ``r``'s description of ``states[i]``. Done once per layout (a steady sync's is)."""
        key = (self.words, tuple((s.slot, is_cat(s.reduction)) for s in states))  # the views follow from these
        if key in _VALID:
            return
        for i, state in enumerate(states):
            described = {r: held[i] for r, held in enumerate(views)}
            kind = {r: d.kind for r, d in described.items()}
            if wire.KIND_OTHER in kind.values() or len(set(kind.values())) > 1:
                rule = "it must be a tensor, or a list of tensors, on every rank"
                raise structure_error(name, state.attr, rule, {r: _KINDS[k] for r, k in kind.items()})
            for r, d in described.items():
                if any(p.dtype is None for p in d.pieces):
                    rule = "a dtype the fused sync does not know"
                    raise structure_error(name, state.attr, rule, {r: "an unknown dtype"})
            if kind[self.rank] == wire.KIND_TENSOR:
                pieces = {r: d.pieces[0] for r, d in described.items()}
                rule = "a tensor state must have one dtype and shape on every rank (its gathered values are stacked)"
                broken = len({(p.dtype, p.shape) for p in pieces.values()}) > 1
            elif is_cat(state.reduction):
                pieces = {r: d.pieces[0] for r, d in described.items() if d.pieces and not d.placeholder}
                rule = "the tensors of a 'cat' state must agree in dtype, number of dimensions and every size but "
                rule += "the first"
                shapes = {wire.cat_key(p.shape) for p in pieces.values()} - {None}
                broken = len({p.dtype for p in pieces.values()}) > 1 or len(shapes) > 1
            else:
                continue
            if broken:
                held = {r: f"{p.dtype} {list(p.shape)}" for r, p in pieces.items()}
                raise structure_error(name, state.attr, rule, held)
        remember(_VALID, key, None)

    def settle(self) -> None:
        """The side channels, alike on every rank, where the descriptions call for them: streamed, reduced, large."""
        chunk = min(row[wire.CHUNK] for row in self.rows)
        with torch.no_grad():
            if any(each.streams for each in self.described):
                for r, s, i, piece in transit.receive_stream(self, chunk):
                    self.gathered[r][s][i] = piece
            if self.skip:
                self.reduced = reduced.run(self, chunk)
            if any(each.separates for each in self.described):
                pieces, written, joined = large.run(self)
                for r, s, i, piece in pieces:
                    self.gathered[r][s][i] = piece
                for s, view in written.items():  # the buffer holds them now: the local tensors can go
                    self.slots[s].tensors[:] = [view]
                    if isinstance(self.slots[s].value, list):
                        self.slots[s].value.clear()
                self.reduced.update(joined)

    def entries(self, keep: list[list[bool]]) -> list[list[list[torch.Tensor]]]:
        """Per rank, per slot, the entries torchmetrics' step 3 sees (in global mode with a graph anywhere, through one
        node); ``keep[r][s]``: rank ``r``'s slot ``s`` becomes list-state content, so its entries are copies."""
        rank = self.rank
        result = [
            [list(slot.tensors) for slot in self.slots] if r == rank else [list(pieces) for pieces in gathered]
            for r, gathered in enumerate(self.gathered)
        ]
        if self.mode == "global" and self.flagged(wire.FLAG_REQUIRES_GRAD) and torch.is_grad_enabled():
            viewed = wire.unpack(*self._own) if self._own is not None else self.gathered[rank]
            group = None if self.group is dist.group.WORLD else self.group
            places, inputs, entries = [], [], []
            for r, described in enumerate(self.every):
                for s, state in enumerate(described):
                    for i, piece in enumerate(state.pieces):
                        if not piece.requires_grad:
                            continue
                        value = self.gathered[r][s][i]
                        if r == rank:
                            inputs.append(self.slots[s].tensors[i])
                            if value is wire.ABSENT:  # not sent apart nor streamed: in the buffer
                                value = viewed[s][i]
                        entries.append(grad.Entry(r, value, keep[r][s]))
                        places.append((r, s, i))
            outputs = grad.apply(entries, inputs, rank, self.world_size, group, self.device)
            for (r, s, i), output in zip(places, outputs, strict=True):
                result[r][s][i] = output
        for r in range(self.world_size):
            for s, pieces in enumerate(result[r]):
                if r != rank and keep[r][s]:  # list-state content owns its memory
                    result[r][s] = [e if e.grad_fn is not None else e.clone() for e in pieces]
        return result


def set_states(
    metric: Any,
    states: Sequence[State],
    views: Sequence[Sequence[wire.State]],
    entries: list[list[list[torch.Tensor]]],
    values: Sequence[torch.Tensor | None] = (),
) -> None:
    """torchmetrics' step 3 for ``metric``: per state, stack or flatten, reduce and set (``values[i]``, if given and
    not ``None``: ``states[i]`` reduced). ``views[r][i]``, ``entries[r][i]``: rank ``r``'s description and entries."""
    if uneven_lists:  # in check mode: the list states whose lengths differ between ranks
        for i, state in enumerate(states):
            if len({len(held[i].pieces) for held in views}) > 1:
                for noted in uneven_lists:  # an enclosing check's reference would run this sync too
                    noted.append((metric, state.attr))
    ranks = range(len(entries))
    for i, state in enumerate(states):
        if values and values[i] is not None:
            internals.put(metric, {state.attr: values[i]})
            continue
        fn = state.reduction
        if views[0][i].kind == wire.KIND_TENSOR:
            gathered: Any = torch.stack([entries[r][i][0] for r in ranks])
        else:
            per_rank = [entries[r][i] for r in ranks]
            if is_cat(fn):  # torchmetrics' placeholder where no rank holds data, else the holders'
                holders = [r for r, held in enumerate(views) if held[i].pieces and not held[i].placeholder]
                holders = holders or [r for r, held in enumerate(views) if held[i].pieces]
                gathered = [per_rank[r][0] for r in holders]
            else:
                gathered = [e for at in itertools.zip_longest(*per_rank) for e in at if e is not None]
            if not gathered:  # set as it is, not reduced
                fn = None
        if fn is not None and not callable(fn):
            raise TypeError("reduction_fn must be callable or None")
        internals.put(metric, {state.attr: gathered if fn is None else fn(gathered)})


def sync_metric(metric: Any, process_group: Any, mode: str, aside_here: bool) -> bool:
    """The single sync: ``metric``'s ``_sync_dist`` in one exchange over ``process_group`` (else the Metric's, else
    the default group). Returns ``False``, having changed nothing, where some rank steps aside (``aside_here`` on
    this rank: it sends its header alone); then every rank runs torchmetrics' own ``_sync_dist``."""
    exchange = Exchange(type(metric).__name__, process_group or metric.process_group, metric.device, mode)
    states: list[State] = []
    try:  # step 1 for every state, in _sync_dist's order, a slot each
        if not aside_here:
            placeholders, reductions = internals.placeholder_rule(metric), internals.reductions(metric)
            states = [State(attr, fn, exchange.add(metric, attr, fn, placeholders)) for attr, fn in reductions.items()]
    except Exception as error:  # this rank's states cannot be sent: its header says so, and every rank raises
        exchange.fail(error)
    exchange.send(wire.FLAG_ASIDE if aside_here else 0, fingerprint(metric))
    if exchange.flagged(wire.FLAG_ASIDE):
        return False
    slots = exchange.slots
    # sync()'s copies of the states sent apart are freed before the buffer is made, and made again after
    apart = [s.attr for s in states if any(p.separate for p in slots[s.slot].described.pieces)]
    released = large.release_cache(metric, apart)
    if len({row[wire.FINGERPRINT] for row in exchange.rows}) > 1:
        held = gather_texts(describe(metric), exchange.group, exchange.world_size, exchange.device)
        rule = "the ranks are syncing different metrics (another class, or other states or reductions)"
        raise structure_error("a Metric", None, rule, dict(enumerate(held)))
    exchange.check_grad_modes()
    exchange.receive()
    exchange.validate(exchange.name, states, exchange.every)
    exchange.settle()
    keep = [s.described.kind == wire.KIND_LIST and not s.is_cat for s in slots]
    entries = exchange.entries([keep] * exchange.world_size)
    set_states(metric, states, exchange.every, entries, [exchange.reduced.get(s.slot) for s in states])
    # the local tensors are no longer held but by sync()'s cache: its copies are made from the buffer now
    large.recopy(metric, {s.attr: slots[s.slot].tensors[0] for s in states if s.attr in released})
    return True
