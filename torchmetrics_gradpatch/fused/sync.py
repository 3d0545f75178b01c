"""The fused ``Metric._sync_dist``: torchmetrics' own sync, state by state, over one exchange: one collective when
steady, two after a change.

torchmetrics' ``_sync_dist`` (the same from 0.11 to 1.9) does, for a Metric's states in ``_reductions`` order:

1. a ``cat`` list of more than one tensor is concatenated first (``dim_zero_cat``); from 1.4 on, on torch >= 2.1,
   an empty ``cat`` list becomes ``[torch.tensor([], device=self.device, dtype=self.dtype)]`` (the placeholder);
2. every tensor (a tensor state, or each element of a list state) is gathered on its own;
3. per state: an empty list stays ``[]``; a tensor state's gathered entries are stacked; a list state's gathered
   lists are flattened element by element (``[e0 of rank 0, e0 of rank 1, ..., e1 of rank 0, ...]``); then the
   reduction (``None``: the stacked tensor or flattened list as is) is applied and the result set.

This module does steps 1 and 3 with torchmetrics' own objects (``dim_zero_cat``, the placeholder rule, the same
stacking and reductions), so each state comes out bit for bit as torchmetrics' sync gives it, and replaces step 2
with :mod:`torchmetrics_gradpatch.fused.wire`'s exchange: one collective when the payloads fit the group's agreed
inline capacity (a steady layout), else two. Where torchmetrics' sync hangs or desyncs
because ranks hold differently shaped states, every rank here sees every rank's description and either syncs to
what one process holding all the data would get or raises the same :class:`FusedSyncError`:

* list states of different lengths per rank: flattened element by element as above, a rank with no ``i``-th
  element skipped at position ``i`` (equal lengths: torchmetrics' order exactly);
* an empty ``cat`` list on some ranks (on every torchmetrics line): those ranks contribute nothing (the
  placeholder is dropped when another rank holds data; when every rank is empty the result is torchmetrics' own:
  ``[]`` without the placeholder, the concatenated placeholders with it);
* a tensor state whose dtype or shape differs between ranks (torchmetrics cannot stack it), a ``cat`` state whose
  contributions differ in dtype, number of dimensions or trailing sizes, a Metric of another class or other
  states, a state that is neither a tensor nor a list of tensors: :class:`FusedSyncError` on every rank, before
  any state is changed;
* a state that step 1 fails on one rank (a ``cat`` list whose tensors do not concatenate, where torchmetrics'
  sync raises on that rank and leaves the others waiting): that rank's header says so, and every rank raises the
  same :class:`FusedSyncError`, naming each failing rank's error, after that first collective.
* a conjugate or negative view (``x.conj()``, ``x.conj().imag``), which torchmetrics' ``torch.cat``, padding or
  stacking resolves, but its ``all_gather`` refuses where a conjugate view is gathered as it is (equal shapes on
  every rank; those ranks raise, the others wait): resolved in step 1, before the header, so every state comes out
  as the values it reads as, as torchmetrics' result and one process give it.

Beyond that exchange: states whose reduction is exact in any order (an integer ``sum``, a ``max`` or
``min``) and large enough are all-reduced instead of gathered when every rank proposed the same
(:mod:`torchmetrics_gradpatch.fused.reduced`; one more collective per operation and dtype), a rank's large ``cat``
states cross apart, straight into their synced values (:mod:`torchmetrics_gradpatch.fused.large`; one more
collective for all of them), and states held on the CPU while the exchange runs on a device cross in chunks
(:mod:`torchmetrics_gradpatch.fused.transit`).

Gradients: in local mode each rank's own entries are its own tensors (as the graph-preserving gather puts them
back), so its states keep their graphs; in global mode :mod:`torchmetrics_gradpatch.fused.grad` builds one node
for the whole sync. A reduced state has no graph (a state with one is gathered).

The steps are functions of their own, shared with the one-exchange sync of a whole ``MetricCollection``
(:mod:`torchmetrics_gradpatch.fused.collection`): :func:`prepare_state` (step 1), :func:`outgoing`, :func:`headers`
and :func:`payloads` (collective 1, and collective 2 where a payload did not fit), :func:`validate`,
:func:`complete` (the stream and the reductions), :func:`entries` and :func:`reduce` (step 3). They work on *slots*
(what one rank sends: a prepared state) and on *states* (what a Metric sets), so a slot shared by several states
crosses the wire once. Errors that the ranks' disagreement causes carry the same text on every rank
(:func:`gather_texts` fetches what each rank holds where the exchanged facts do not say it).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch._engine import effective_check
from torchmetrics_gradpatch._errors import FusedSyncError, GradModeMismatchError
from torchmetrics_gradpatch._gather import chunk_bytes, chunk_refusal, size_and_rank
from torchmetrics_gradpatch._modes import check_mode
from torchmetrics_gradpatch.fused import grad as _fused_grad
from torchmetrics_gradpatch.fused import large as _large
from torchmetrics_gradpatch.fused import reduced as _reduced
from torchmetrics_gradpatch.fused import transit, wire

__all__ = [
    "CheckSettingError",
    "Exchanged",
    "Local",
    "Outgoing",
    "check_grad_modes",
    "complete",
    "describe",
    "entries",
    "flags_of",
    "forget",
    "fused_sync",
    "gather_texts",
    "headers",
    "is_cat",
    "node_wanted",
    "outgoing",
    "payloads",
    "placeholder_rule",
    "prepare_state",
    "put",
    "put_all",
    "raise_failures",
    "reduce",
    "reduction_name",
    "remember",
    "structure_error",
    "uneven_lists",
    "validate",
]


_PLAIN_TYPES = frozenset((torch.Tensor, bool, int, float, str, type(None), list, dict, tuple))


def put(module: Any, name: str, value: Any) -> None:
    """``setattr(module, name, value)`` for what torchmetrics keeps on a Metric as a plain attribute (a state, a
    flag, a count) that it holds already: stored as ``Module.__setattr__`` stores it, without its checks (a step
    sets hundreds). A name the instance does not hold yet, or a parameter, buffer or module, goes through
    ``setattr``."""
    put_all(module, {name: value})


def put_all(module: Any, values: dict[str, Any]) -> None:
    """:func:`put` for each of ``values`` in turn."""
    attributes = module.__dict__
    for name, value in values.items():
        if name in attributes and type(value) in _PLAIN_TYPES:
            attributes[name] = value
        else:
            setattr(module, name, value)


def structure_error(metric: str, attr: str | None, rule: str, seen: dict[int, str]) -> FusedSyncError:
    """The error for a state (``attr``; ``None``: the Metric as a whole) whose ranks break ``rule``.

    ``seen`` maps each rank (within the group) to what it holds, so the message names the ranks on each side.
    """
    what = f"state {attr!r} of {metric}" if attr is not None else metric
    held = "; ".join(f"rank {rank}: {value}" for rank, value in sorted(seen.items()))
    return FusedSyncError(
        f"torchmetrics_gradpatch: fused sync of {what}: {rule}. The ranks hold: {held}. Every rank of the group "
        "raised this error after the same exchange, before changing any state; none is left waiting. Make every "
        "rank hold states of the same structure, or sync with torchmetrics' own path (sync='torchmetrics')."
    )


class CheckSettingError(FusedSyncError):
    """The ranks' check settings differ: raised on every rank at the exchange's first collective (so a rank in check
    mode knows that its peers run no check collectives)."""


@dataclass(slots=True)  # made for every state at every sync
class Local:
    """One state of this rank after step 1: its tensors (the pieces it sends) and what the description says."""

    attr: str
    reduction: Callable[..., Any] | None
    is_cat: bool
    value: Any
    tensors: list[torch.Tensor]
    described: wire.State


#: while check mode runs a fused sync (its ``run`` pushes a list here), each list state that sync synced with another
#: number of pieces on some rank, as ``(metric, attr)``: torchmetrics' own sync gathers those one by one and would wait
uneven_lists: list[list[tuple[Any, str]]] = []


def _note_uneven(metric: Any, attrs: list[str], every: Sequence[Sequence[wire.State]]) -> None:
    """Note each state of ``attrs`` whose ranks send different numbers of pieces (``every[r][s]``; a ``cat`` list is
    one piece, as torchmetrics concatenates it first), for every check that watches."""
    for s, attr in enumerate(attrs):
        if len({len(states[s].pieces) for states in every}) > 1:
            for noted in uneven_lists:  # an enclosing check's reference would run this sync too
                noted.append((metric, attr))


def reduction_name(fn: object) -> str:
    """How a reduction is named in a fingerprint (its qualified name; ``None``: \"None\")."""
    return "None" if fn is None else str(getattr(fn, "__qualname__", type(fn).__qualname__))


def placeholder_rule(metric: Any) -> bool:
    """Whether ``metric``'s torchmetrics puts ``tensor([])`` in for an empty ``cat`` list (step 1)."""
    import torchmetrics.metric as tm_metric

    # 1.4.0 reads the module's flag, 1.4.1+ the instance's; 0.11-1.3 have neither and insert no placeholder
    return bool(getattr(metric, "_TORCH_GREATER_EQUAL_2_1", getattr(tm_metric, "_TORCH_GREATER_EQUAL_2_1", False)))


@functools.cache
def _dim_zero_cat() -> Callable[..., Any]:
    """torchmetrics' ``dim_zero_cat``, the object ``torchmetrics.metric`` holds and compares reductions with."""
    from torchmetrics.utilities.data import dim_zero_cat

    return dim_zero_cat


def is_cat(reduction: object) -> bool:
    """Whether ``reduction`` is torchmetrics' ``dim_zero_cat`` (compared as torchmetrics.metric compares it)."""
    return bool(reduction == _dim_zero_cat())


def prepare_state(metric: Any, attr: str, reduction: Any, rule: bool, stream_cpu: bool = False) -> Local:
    """Step 1 for one state, exactly as torchmetrics' ``_sync_dist`` does it, and the state's description
    (``stream_cpu``: its tensors held on the CPU are described as streamed)."""
    dim_zero_cat = _dim_zero_cat()
    value = getattr(metric, attr)
    cat = is_cat(reduction)
    # a conjugate or negative view is sent as the values it reads as (torchmetrics' torch.cat, pad or stack
    # resolves it), resolved here, before the header: a byte view of it would raise on this rank alone
    if isinstance(value, torch.Tensor):  # the common case first: a tensor state (a steady sync's, many of them)
        tensor = _bytes.resolved(value).contiguous()
        return Local(attr, reduction, cat, value, [tensor], wire.tensor_state(tensor, stream_cpu and tensor.is_cpu))
    placeholder = False
    if cat and isinstance(value, list):
        value = list(value)  # this sync's own list: the large path empties it once it wrote the tensors (large.run)
        if len(value) > 1 or (value and isinstance(value[0], torch.Tensor) and _bytes.unresolved(value[0])):
            deferred = _large.defer(value, stream_cpu)  # joined later, or written one by one
            if deferred is not None:
                return Local(attr, reduction, True, value, *deferred)
        if len(value) > 1:
            value = [dim_zero_cat(value)]
    if rule and cat and isinstance(value, list) and len(value) == 0:
        value = [torch.tensor([], device=metric.device, dtype=metric.dtype)]
        placeholder = True
    if isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
        tensors = [_bytes.resolved(v).contiguous() for v in value]
        pieces = tuple(wire.piece_of(t, stream_cpu and t.device.type == "cpu") for t in tensors)
        described = wire.State(wire.KIND_LIST, pieces, placeholder)
    else:
        tensors, described = [], wire.State(wire.KIND_OTHER, ())
    return Local(attr, reduction, cat, value, tensors, described)


def _prepare(metric: Any, stream_cpu: bool) -> list[Local]:
    rule = placeholder_rule(metric)
    return [prepare_state(metric, attr, reduction, rule, stream_cpu) for attr, reduction in metric._reductions.items()]


def describe(metric: Any) -> str:
    """``metric`` as errors name it to the other ranks: its class and each state's reduction."""
    reductions = getattr(metric, "_reductions", {})
    held = ", ".join(f"{a}: {reduction_name(r).removeprefix('dim_zero_')}" for a, r in reductions.items())
    return f"{type(metric).__name__} ({held})"


def _fingerprint(metric: Any, states: list[Local]) -> int:
    text = "|".join([type(metric).__qualname__, *(f"{s.attr}:{reduction_name(s.reduction)}" for s in states)])
    return zlib.crc32(text.encode())


def flags_of(slots: list[Local]) -> int:
    """This rank's header flags: grad mode (call it outside ``no_grad``), and whether a tensor it sends requires
    grad."""
    requires_grad = any(t.requires_grad for s in slots for t in s.tensors)
    return (wire.FLAG_GRAD_MODE if torch.is_grad_enabled() else 0) | (wire.FLAG_REQUIRES_GRAD if requires_grad else 0)


@dataclass
class Outgoing:
    """What this rank sends: its description, its payload's layout (every state; and with the states it proposes
    to reduce left out), its proposal, the tensors it sends and, once :func:`headers` ran, what collective 1
    brought."""

    words: list[int]
    offsets: list[list[int]]
    size: int
    offsets_reduced: list[list[int]]
    size_reduced: int
    plan: _reduced.Plan
    sent: list[list[torch.Tensor]] = field(default_factory=list)
    first: wire.First | None = None


def outgoing(slots: list[Local], table: list[int] | None = None, placement: list[int] | None = None) -> Outgoing:
    """This rank's description of ``slots`` (``table``: the words in front, the collection's member table), its
    payload layouts and its proposal of states to reduce (``placement``: which slots the members' states are, so
    that ranks whose members map to other slots do not agree on it)."""
    _large.mark(slots)  # large cat states leave the payload
    described = [s.described for s in slots]
    words = wire.encode(described, table or ())
    plan = _reduced.propose(slots, placement or ())
    offsets, size = wire.read_layout(tuple(words), ())
    offsets_reduced, size_reduced = wire.read_layout(tuple(words), tuple(plan.slots)) if plan.slots else (offsets, size)
    # a separate piece is never packed: its stand-in keeps no reference to the local tensor (large.recopy); a piece
    # of a dtype the format does not know (described with none) is never sent
    sent = [
        s.tensors
        if len(s.tensors) == 1 and not s.described.pieces[0].separate and s.described.pieces[0].dtype is not None
        else [_NOT_SENT if p.separate else wire.sendable(t) for t, p in zip(s.tensors, s.described.pieces, strict=True)]
        for s in slots
    ]
    return Outgoing(words, offsets, size, offsets_reduced, size_reduced, plan, sent)


_NOT_SENT = torch.empty(0, dtype=torch.uint8)


def headers(out: Outgoing, flags: int, fingerprint: int, group: Any, world_size: int, device: Any) -> list[list[int]]:
    """Collective 1: every rank's header (format, description length, payload sizes, flags, fingerprint, proposal
    digest, chunk size, inline capacity) and, where it fits the group's inline capacity, its payload with the
    states it proposes to reduce left out (kept in ``out.first`` for :func:`payloads`); the group's capacity record
    is updated from the rows on every rank (:func:`torchmetrics_gradpatch.fused.wire.agree`).

    Raises on every rank alike when the ranks run different formats (nothing more can be read then) or some rank's
    chunk size setting is not valid.
    """
    group = dist.group.WORLD if group is None else group
    flags |= wire.FLAG_CHECK if effective_check() else 0
    header = [len(out.words), out.size, flags, fingerprint, out.size_reduced, out.plan.digest, chunk_bytes()]
    out.first = wire.gather_first(
        header, out.words, out.sent, out.offsets_reduced, out.size_reduced, group, world_size, device
    )
    rows = out.first.rows
    if len({row[0] for row in rows}) > 1:
        raise FusedSyncError(
            "torchmetrics_gradpatch: fused sync: the ranks run different versions of the fused sync's format ("
            + "; ".join(f"rank {r}: {row[0]:#x}" for r, row in enumerate(rows))
            + "); install the same torchmetrics_gradpatch on every rank."
        )
    wire.agree(group, rows)  # every rank, from the same rows, before anything else can raise
    refusal = chunk_refusal([row[wire.CHUNK] for row in rows])
    if refusal is not None:
        raise FusedSyncError(refusal)
    checking = [bool(row[wire.FLAGS] & wire.FLAG_CHECK) for row in rows]
    if len(set(checking)) > 1:
        raise CheckSettingError(
            "torchmetrics_gradpatch: fused sync: the ranks' check settings differ (check mode on rank(s) "
            f"{[r for r, c in enumerate(checking) if c]}, off on rank(s) "
            f"{[r for r, c in enumerate(checking) if not c]})."
            " Every rank raised this error after the same exchange, before changing any state. Set check the same "
            "way on every rank (patch(check=...), patched(check=...) or TORCHMETRICS_GRADPATCH_CHECK)."
        )
    return rows


def raise_failures(
    name: str, rows: list[list[int]], failure: Exception | None, group: Any, world_size: int, device: Any
) -> None:
    """After the headers: where some rank flagged that it could not prepare its states (``failure``, on this rank),
    raise one :class:`FusedSyncError` on every rank, naming each failing rank's error (from ``failure`` here)."""
    failed = [r for r, row in enumerate(rows) if row[wire.FLAGS] & wire.FLAG_FAILED]
    if not failed:
        return
    own = "" if failure is None else f"{type(failure).__name__}: {failure}"
    texts = gather_texts(own, group, world_size, device)
    held = "; ".join(f"rank {r}: {texts[r]}" for r in failed)
    raise FusedSyncError(
        f"torchmetrics_gradpatch: fused sync of {name}: rank(s) {failed} could not prepare their states for the "
        f"sync ({held}). Every rank raised this error after the same exchange, before changing any state; none is "
        "left waiting. torchmetrics' own sync raises the same on those ranks alone; fix what they hold."
    ) from failure


def gather_texts(text: str, group: Any, world_size: int, device: Any) -> list[str]:
    """Every rank's ``text``, in group-rank order: two collectives, issued only where every rank has found from
    the same exchanged facts that an error needs what each rank holds named."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group)
    lengths = [int(n) for n in torch.cat(sizes).tolist()]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()].copy_(data)
    received = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(received, padded, group)
    return [bytes(b[:n].tolist()).decode("utf-8", "replace") for b, n in zip(received, lengths, strict=True)]


def check_grad_modes(name: str, rows: list[list[int]], mode: str) -> None:
    """In global mode, refuse on every rank alike when the ranks disagree on grad mode while a state needs grad."""
    if mode != "global":
        return
    grad = [bool(row[wire.FLAGS] & wire.FLAG_GRAD_MODE) for row in rows]
    requiring = [r for r, row in enumerate(rows) if row[wire.FLAGS] & wire.FLAG_REQUIRES_GRAD]
    if requiring and len(set(grad)) > 1:
        raise GradModeMismatchError(
            f"torchmetrics_gradpatch: fused global-mode sync of {name}: the ranks disagree on grad mode. "
            f"Rank(s) {[r for r, g in enumerate(grad) if not g]} synced with grad mode off, rank(s) "
            f"{[r for r, g in enumerate(grad) if g]} with it on, and rank(s) {requiring} hold states that "
            "require grad. Sync with the same grad mode on every rank. Every rank raised this error after the "
            "same exchange; none is left waiting."
        )


def node_wanted(rows: list[list[int]], mode: str) -> bool:
    """Whether global mode builds its node: some rank sends a tensor that requires grad, and grad mode is on."""
    if mode != "global":
        return False
    return any(row[wire.FLAGS] & wire.FLAG_REQUIRES_GRAD for row in rows) and torch.is_grad_enabled()


@dataclass
class Exchanged:
    """Every rank's description table and slots, every slot's pieces (views of the receive buffers), the slots
    every rank reduces (``skip``: they have no pieces) and, once :func:`complete` ran, their values."""

    tables: list[Sequence[int]]
    slots: list[Sequence[wire.State]]
    gathered: list[list[list[torch.Tensor]]]
    skip: tuple[int, ...] = ()
    words: tuple[tuple[int, ...], ...] = ()  # every rank's description: what everything read from it depends on
    reduced: dict[int, torch.Tensor] | None = None
    own: tuple[torch.Tensor, wire.Plan] | None = None  # this rank's buffer and plan: its pieces are not viewed back


def payloads(
    out: Outgoing,
    rows: list[list[int]],
    rank: int,
    group: Any,
    world_size: int,
    device: Any,
) -> Exchanged:
    """Every rank's description and data: from collective 1 where every rank inlined its payload in the layout the
    exchange uses, else collective 2 (every payload padded to the largest); read back per rank.

    The states every rank proposed alike to reduce are left out (:func:`torchmetrics_gradpatch.fused.reduced.agreed`).
    """
    words = out.words
    skip = out.plan.slots if _reduced.agreed(rows, out.plan) else ()
    offsets = out.offsets_reduced if skip else out.offsets
    first = out.first
    out.first = None  # the receive buffers live on in the views below only
    # an inline payload leaves out what its rank proposed to reduce: usable where that proposal was agreed, or empty
    if first is not None and all(
        row[wire.FLAGS] & wire.FLAG_INLINE and (skip or row[wire.SIZE_REDUCED] == row[wire.SIZE]) for row in rows
    ):
        buffers = first.regions
    else:
        size = max(row[wire.SIZE_REDUCED if skip else wire.SIZE] for row in rows)
        payload = wire.pack(words, out.sent, offsets, size, device)
        buffers = wire.gather_payloads(payload, group, world_size)
        del payload
    described = first.words if first is not None else [None] * world_size
    tables: list[Sequence[int]] = []
    every: list[Sequence[wire.State]] = []
    plans: list[wire.Plan] = []
    described_words: list[tuple[int, ...]] = []
    for r, (buffer, row) in enumerate(zip(buffers, rows, strict=True)):
        known = described[r]
        theirs = words if r == rank else known if known is not None else wire.words_of(buffer, row[1])
        described_words.append(tuple(theirs))
        table, states, _, plan = wire.read(described_words[-1], tuple(skip))
        tables.append(table)
        every.append(states)
        plans.append(plan)
    # this rank's own pieces are its own tensors (entries): viewed back only where global mode's node needs them
    gathered = [
        wire.absent(plan) if r == rank else wire.unpack_planned(buffer, plan)
        for r, (buffer, plan) in enumerate(zip(buffers, plans, strict=True))
    ]
    return Exchanged(tables, every, gathered, skip, tuple(described_words), own=(buffers[rank], plans[rank]))


def complete(
    got: Exchanged,
    out: Outgoing,
    slots: list[Local],
    rows: list[list[int]],
    rank: int,
    group: Any,
    device: Any,
    staging: torch.device | None,
) -> None:
    """After validation: every rank's streamed pieces into ``got.gathered``, the agreed reductions into
    ``got.reduced`` (the collectives both need, decided from the exchanged facts alike on every rank)."""
    chunk = min(row[wire.CHUNK] for row in rows)
    traits = [wire.apart(words) for words in got.words]  # what the descriptions say, alike on every rank
    if any(streamed for streamed, _ in traits):
        own = [s.tensors for s in slots]
        transit.receive_stream(got.gathered, own, got.slots, got.skip, rank, group, staging, chunk)
    got.reduced = _reduced.run(out.plan, slots, group, device, staging, chunk) if got.skip else {}
    if any(separate for _, separate in traits):
        got.reduced.update(_large.run(got, slots, rank, group, device))


def validate(name: str, states: list[Local], every: Sequence[Sequence[wire.State]]) -> None:
    """Refuse, on every rank alike, what torchmetrics' sync cannot complete and one process could not hold.

    ``every[r][i]`` is rank ``r``'s description of ``states[i]``.
    """
    for index, state in enumerate(states):
        described = {r: descs[index] for r, descs in enumerate(every)}
        kinds = {r: d.kind for r, d in described.items()}
        if wire.KIND_OTHER in kinds.values() or len(set(kinds.values())) > 1:
            words = {
                wire.KIND_TENSOR: "a tensor",
                wire.KIND_LIST: "a list of tensors",
                wire.KIND_OTHER: "something else",
            }
            raise structure_error(
                name,
                state.attr,
                "it must be a tensor, or a list of tensors, on every rank",
                {r: words[k] for r, k in kinds.items()},
            )
        for r, d in described.items():
            if any(p.dtype is None for p in d.pieces):
                raise structure_error(name, state.attr, "a dtype the fused sync does not know", {r: "an unknown dtype"})
        if state.described.kind == wire.KIND_TENSOR:
            pieces = {r: d.pieces[0] for r, d in described.items()}
            if len({(p.dtype, p.shape) for p in pieces.values()}) > 1:
                raise structure_error(
                    name,
                    state.attr,
                    "a tensor state must have one dtype and shape on every rank (its gathered values are stacked)",
                    {r: f"{p.dtype} {list(p.shape)}" for r, p in pieces.items()},
                )
        elif state.is_cat:
            real = {r: d.pieces[0] for r, d in described.items() if d.pieces and not d.placeholder}
            if (
                len({p.dtype for p in real.values()}) > 1
                or len({_cat_key(p.shape) for p in real.values()} - {None}) > 1
            ):
                raise structure_error(
                    name,
                    state.attr,
                    "the tensors of a 'cat' state must agree in dtype, number of "
                    "dimensions and every size but the first",
                    {r: f"{p.dtype} {list(p.shape)}" for r, p in real.items()},
                )


def _cat_key(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """What ``torch.cat`` needs equal (0-d counts as 1-d; an empty 1-d tensor is skipped by it: ``None``)."""
    if not shape:
        return (1,)
    if shape == (0,):
        return None
    return (len(shape), *shape[1:])


#: the exchanges that validate() passed (the newest 64): a steady sync validates its layout once
_VALID: dict[tuple[Any, ...], None] = {}


def remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    """Keep ``value`` under ``key`` in ``memo``, which holds its newest 64 entries (a steady exchange's layout, and
    a few others)."""
    memo[key] = value
    while len(memo) > 64:
        memo.pop(next(iter(memo)))


def fused_sync(metric: Any, process_group: Any | None = None, mode: str = "local", aside_here: bool = False) -> bool:
    """Sync ``metric``'s states over ``process_group`` (else the metric's, else the default group) in one exchange
    (one collective when steady, two after a change), with torchmetrics' values and ``mode``'s gradients (see the
    module docstring). Returns ``False``, having changed nothing, where some rank steps aside (``aside_here`` on
    this rank: it sends its header alone): then every rank runs torchmetrics' own ``_sync_dist`` instead.

    A collective: every rank of the group must call it for the same Metric class, with the same ``mode``.
    """
    mode = check_mode(mode)
    group = process_group or metric.process_group
    resolved = dist.group.WORLD if group is None else group
    world_size, rank = size_and_rank(resolved)
    name = type(metric).__name__
    device, staging, stream_cpu = transit.devices(metric.device, resolved)
    failure: Exception | None = None
    try:
        states = [] if aside_here else _prepare(metric, stream_cpu)
        out = outgoing(states)
    except Exception as error:  # this rank's states cannot be sent: its header says so, and every rank raises
        states, out, failure = [], outgoing([]), error
    flags = flags_of(states) | (wire.FLAG_FAILED if failure is not None else 0)  # grad mode before the no_grad
    flags |= wire.FLAG_ASIDE if aside_here else 0
    with torch.no_grad():
        rows = headers(out, flags, _fingerprint(metric, states), resolved, world_size, device)
        raise_failures(name, rows, failure, resolved, world_size, device)
        if any(row[wire.FLAGS] & wire.FLAG_ASIDE for row in rows):
            return False
        released = _large.release_cache(metric, _large.sent_apart(states))  # sync()'s copies: made again after
        if len({row[wire.FINGERPRINT] for row in rows}) > 1:
            held = gather_texts(describe(metric), resolved, world_size, device)
            raise structure_error(
                "a Metric",
                None,
                "the ranks are syncing different metrics (another class, or other states or reductions)",
                dict(enumerate(held)),
            )
        check_grad_modes(name, rows, mode)
        got = payloads(out, rows, rank, resolved, world_size, device)
        # what validate() finds depends on the descriptions, the Metric (its fingerprint) and which states are cat
        valid = (got.words, rows[rank][wire.FINGERPRINT], tuple(s.is_cat for s in states))
        if valid not in _VALID:
            validate(name, states, got.slots)
            remember(_VALID, valid, None)
        complete(got, out, states, rows, rank, resolved, device, staging)
    keep = [s.described.kind == wire.KIND_LIST and not s.is_cat for s in states]
    synced = entries(states, got, [keep] * world_size, rank, world_size, group, node_wanted(rows, mode), device)
    reduce(metric, states, got.slots, synced, [got.reduced.get(s) if got.reduced else None for s in range(len(states))])
    _large.recopy(metric, _large.written(states, released))  # the local tensors are no longer held but by the cache
    return True


def entries(
    own: list[Local],
    got: Exchanged,
    keep: list[list[bool]],
    rank: int,
    world_size: int,
    group: Any,
    node: bool,
    device: Any,
) -> list[list[list[torch.Tensor]]]:
    """Per rank, per slot, the entries the reductions see: this rank's own tensors at its index (their graphs
    kept), every other rank's gathered copies; in global mode with a graph anywhere (``node``), the differentiable
    entries as the outputs of one node. ``keep[r][s]``: rank ``r``'s slot ``s`` becomes list-state content, so its
    entries are copies, not views of the buffers."""
    gathered = got.gathered
    result = [[list(pieces) for pieces in gathered[r]] for r in range(world_size)]
    result[rank] = [list(slot.tensors) for slot in own]
    if node:
        plan = _fused_grad.Plan([], rank, world_size, group, device)
        places, inputs = [], []
        viewed = wire.unpack_planned(*got.own) if got.own is not None else gathered[rank]
        for r in range(world_size):
            for s, described in enumerate(got.slots[r]):
                for i, piece in enumerate(described.pieces):
                    if piece.requires_grad:
                        value = gathered[r][s][i]
                        if r == rank and value is wire.ABSENT:  # not sent apart nor streamed: in the buffer
                            value = viewed[s][i]
                        plan.entries.append(_fused_grad.Entry(r, value, keep[r][s]))
                        places.append((r, s, i))
                        if r == rank:
                            inputs.append(own[s].tensors[i])
        for (r, s, i), output in zip(places, _fused_grad.apply(plan, inputs), strict=True):
            result[r][s][i] = output
    for r in range(world_size):
        if r == rank:
            continue
        for s, pieces in enumerate(result[r]):
            if keep[r][s]:
                result[r][s] = [e if e.grad_fn is not None else e.clone() for e in pieces]
    return result


def reduce(
    metric: Any,
    states: list[Local],
    every: Sequence[Sequence[wire.State]],
    entries: list[list[list[torch.Tensor]]],
    reduced: list[torch.Tensor | None] | None = None,
) -> None:
    """Step 3, as torchmetrics does it: stack or flatten, reduce, set (see the module docstring for list order).

    ``every[r][i]`` and ``entries[r][i]`` are rank ``r``'s description and entries of ``states[i]``;
    ``reduced[i]``, where not ``None``, is ``states[i]``'s value already reduced across the ranks.
    """
    if uneven_lists:  # in check mode: the list states whose lengths differ between ranks, from every description
        _note_uneven(metric, [state.attr for state in states], every)
    ranks = range(len(entries))
    for s, state in enumerate(states):
        if reduced is not None and reduced[s] is not None:
            put(metric, state.attr, reduced[s])
            continue
        reduction = state.reduction
        if state.described.kind == wire.KIND_TENSOR:
            gathered: Any = torch.stack([entries[r][s][0] for r in ranks])
        else:
            per_rank = [entries[r][s] for r in ranks]
            if state.is_cat:
                real = [r for r, descs in enumerate(every) if descs[s].pieces and not descs[s].placeholder]
                holders = real or [r for r, descs in enumerate(every) if descs[s].pieces]
                gathered = [per_rank[r][0] for r in holders]
            else:
                longest = max(len(pieces) for pieces in per_rank)
                gathered = [pieces[i] for i in range(longest) for pieces in per_rank if i < len(pieces)]
            if not gathered:
                put(metric, state.attr, [])
                continue
        if reduction is None:
            put(metric, state.attr, gathered)
        elif callable(reduction):
            put(metric, state.attr, reduction(gathered))
        else:
            raise TypeError("reduction_fn must be callable or None")


def forget() -> None:
    """Forget the layouts validated once (``fused.reset``)."""
    _VALID.clear()
