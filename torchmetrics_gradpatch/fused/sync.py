"""The fused ``Metric._sync_dist``: torchmetrics' own sync, state by state, over two collectives in all.

torchmetrics' ``_sync_dist`` (the same from 0.11 to 1.9) does, for a Metric's states in ``_reductions`` order:

1. a ``cat`` list of more than one tensor is concatenated first (``dim_zero_cat``); from 1.4 on, on torch >= 2.1,
   an empty ``cat`` list becomes ``[torch.tensor([], device=self.device, dtype=self.dtype)]`` (the placeholder);
2. every tensor (a tensor state, or each element of a list state) is gathered on its own;
3. per state: an empty list stays ``[]``; a tensor state's gathered entries are stacked; a list state's gathered
   lists are flattened element by element (``[e0 of rank 0, e0 of rank 1, ..., e1 of rank 0, ...]``); then the
   reduction (``None``: the stacked tensor or flattened list as is) is applied and the result set.

This module does steps 1 and 3 with torchmetrics' own objects (``dim_zero_cat``, the placeholder rule, the same
stacking and reductions), so each state comes out bit for bit as torchmetrics' sync gives it, and replaces step 2
with :mod:`torchmetrics_gradpatch.fused.wire`'s two collectives. Where torchmetrics' sync hangs or desyncs
because ranks hold differently shaped states, every rank here sees every rank's description and either syncs to
what one process holding all the data would get or raises the same :class:`FusedSyncError`:

* list states of different lengths per rank: flattened element by element as above, a rank with no ``i``-th
  element skipped at position ``i`` (equal lengths: torchmetrics' order exactly);
* an empty ``cat`` list on some ranks (on every torchmetrics line): those ranks contribute nothing (the
  placeholder is dropped when another rank holds data; when every rank is empty the result is torchmetrics' own:
  ``[]`` before 1.4, the concatenated placeholders from 1.4 on);
* a tensor state whose dtype or shape differs between ranks (torchmetrics cannot stack it), a ``cat`` state whose
  contributions differ in dtype, number of dimensions or trailing sizes, a Metric of another class or other
  states, a state that is neither a tensor nor a list of tensors: :class:`FusedSyncError` on every rank, before
  any state is changed.

Gradients: in local mode each rank's own entries are its own tensors (as the graph-preserving gather puts them
back), so its states keep their graphs; in global mode :mod:`torchmetrics_gradpatch.fused.grad` builds one node
for the whole sync.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchmetrics_gradpatch.fused import grad as _fused_grad
from torchmetrics_gradpatch.fused import wire as fp
from torchmetrics_gradpatch._errors import FusedSyncError
from torchmetrics_gradpatch._gather import size_and_rank
from torchmetrics_gradpatch._modes import GradModeMismatchError, check_mode

__all__ = ["fused_sync"]


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


@dataclass
class _Local:
    """One state of this rank after step 1: its tensors (the pieces it sends) and what the description says."""

    attr: str
    reduction: Callable[..., Any] | None
    is_cat: bool
    value: Any
    tensors: list[torch.Tensor]
    described: fp.State


def _reduction_name(fn: object) -> str:
    return "None" if fn is None else str(getattr(fn, "__qualname__", type(fn).__qualname__))


def _prepare(metric: Any) -> list[_Local]:
    """Step 1, exactly as torchmetrics' ``_sync_dist`` does it, and each state's description."""
    import torchmetrics.metric as tm_metric
    from torchmetrics.utilities.data import dim_zero_cat  # the object torchmetrics.metric compares with

    # 1.4.0 reads the module's flag, 1.4.1+ the instance's; 0.11-1.3 have neither and insert no placeholder
    placeholder_rule = getattr(
        metric, "_TORCH_GREATER_EQUAL_2_1", getattr(tm_metric, "_TORCH_GREATER_EQUAL_2_1", False)
    )
    states = []
    for attr, reduction in metric._reductions.items():
        value = getattr(metric, attr)
        is_cat = reduction == dim_zero_cat
        placeholder = False
        if is_cat and isinstance(value, list) and len(value) > 1:
            value = [dim_zero_cat(value)]
        if placeholder_rule and is_cat and isinstance(value, list) and len(value) == 0:
            value = [torch.tensor([], device=metric.device, dtype=metric.dtype)]
            placeholder = True
        if isinstance(value, torch.Tensor):
            tensors = [value.contiguous()]
            described = fp.State(fp.KIND_TENSOR, (fp.piece_of(tensors[0]),))
        elif isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
            tensors = [v.contiguous() for v in value]
            described = fp.State(fp.KIND_LIST, tuple(fp.piece_of(t) for t in tensors), placeholder)
        else:
            tensors, described = [], fp.State(fp.KIND_OTHER, ())
        states.append(_Local(attr, reduction, is_cat, value, tensors, described))
    return states


def _fingerprint(metric: Any, states: list[_Local]) -> int:
    text = "|".join([type(metric).__qualname__, *(f"{s.attr}:{_reduction_name(s.reduction)}" for s in states)])
    return zlib.crc32(text.encode())


def _check_headers(metric: Any, rows: list[list[int]], mode: str) -> None:
    """Refuse, on every rank alike, what the headers alone show: another format, another Metric, grad modes."""
    name = type(metric).__name__
    if len({row[0] for row in rows}) > 1:
        raise FusedSyncError(
            f"torchmetrics_gradpatch: fused sync of {name}: the ranks run different versions of the fused sync's "
            "format; install the same torchmetrics_gradpatch on every rank."
        )
    if len({row[4] for row in rows}) > 1:
        raise structure_error(
            name,
            None,
            "the ranks are syncing different metrics (another class, or other states or reductions)",
            {r: f"fingerprint {row[4]:#x}" for r, row in enumerate(rows)},
        )
    if mode == "global":
        grad = [bool(row[3] & fp.FLAG_GRAD_MODE) for row in rows]
        requiring = [r for r, row in enumerate(rows) if row[3] & fp.FLAG_REQUIRES_GRAD]
        if requiring and len(set(grad)) > 1:
            raise GradModeMismatchError(
                f"torchmetrics_gradpatch: fused global-mode sync of {name}: the ranks disagree on grad mode. "
                f"Rank(s) {[r for r, g in enumerate(grad) if not g]} synced with grad mode off, rank(s) "
                f"{[r for r, g in enumerate(grad) if g]} with it on, and rank(s) {requiring} hold states that "
                "require grad. Sync with the same grad mode on every rank. Every rank raised this error after the "
                "same exchange; none is left waiting."
            )


def _validate(name: str, states: list[_Local], every: list[list[fp.State]]) -> None:
    """Refuse, on every rank alike, what torchmetrics' sync cannot complete and one process could not hold."""
    for index, state in enumerate(states):
        described = {r: descs[index] for r, descs in enumerate(every)}
        kinds = {r: d.kind for r, d in described.items()}
        if fp.KIND_OTHER in kinds.values() or len(set(kinds.values())) > 1:
            words = {fp.KIND_TENSOR: "a tensor", fp.KIND_LIST: "a list of tensors", fp.KIND_OTHER: "something else"}
            raise structure_error(
                name,
                state.attr,
                "it must be a tensor, or a list of tensors, on every rank",
                {r: words[k] for r, k in kinds.items()},
            )
        for r, d in described.items():
            if any(p.dtype is None for p in d.pieces):
                raise structure_error(name, state.attr, "a dtype the fused sync does not know", {r: "an unknown dtype"})
        if state.described.kind == fp.KIND_TENSOR:
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


def fused_sync(metric: Any, process_group: Any | None = None, mode: str = "local") -> None:
    """Sync ``metric``'s states over ``process_group`` (else the metric's, else the default group) in two
    collectives, with torchmetrics' values and ``mode``'s gradients (see the module docstring).

    A collective: every rank of the group must call it for the same Metric class, with the same ``mode``.
    """
    mode = check_mode(mode)
    group = process_group or metric.process_group
    resolved = dist.group.WORLD if group is None else group
    world_size, rank = size_and_rank(resolved)
    name = type(metric).__name__
    states = _prepare(metric)
    described = [s.described for s in states]
    words = fp.encode(described)
    offsets, size = fp.layout(described, 8 * len(words))
    requires_grad = any(t.requires_grad for s in states for t in s.tensors)
    flags = (fp.FLAG_GRAD_MODE if torch.is_grad_enabled() else 0) | (fp.FLAG_REQUIRES_GRAD if requires_grad else 0)
    device = torch.device(metric.device)
    with torch.no_grad():
        rows = fp.gather_headers([len(words), size, flags, _fingerprint(metric, states)], resolved, world_size, device)
        _check_headers(metric, rows, mode)
        sent = [[fp.sendable(t) for t in s.tensors] for s in states]
        payload = fp.pack(words, sent, offsets, max(row[2] for row in rows), device)
        buffers = fp.gather_payloads(payload, resolved, world_size)
        del payload
        every: list[list[fp.State]] = []
        layouts: list[list[list[int]]] = []
        previous_words: list[int] = []
        for r, (buffer, row) in enumerate(zip(buffers, rows, strict=True)):
            theirs = words if r == rank else fp.words_of(buffer, row[1])
            if every and theirs == previous_words:
                every.append(every[-1])
                layouts.append(layouts[-1])
            else:
                every.append(described if r == rank else fp.decode(theirs))
                layouts.append(offsets if r == rank else fp.layout(every[-1], 8 * len(theirs))[0])
            previous_words = theirs
        _validate(name, states, every)
        gathered = [fp.unpack(buffer, descs, lay) for buffer, descs, lay in zip(buffers, every, layouts, strict=True)]
    node = mode == "global" and any(row[3] & fp.FLAG_REQUIRES_GRAD for row in rows) and torch.is_grad_enabled()
    entries = _own_and_others(states, every, gathered, rank, world_size, group, node, device)
    _reduce(metric, states, every, entries)


def _own_and_others(
    states: list[_Local],
    every: list[list[fp.State]],
    gathered: list[list[list[torch.Tensor]]],
    rank: int,
    world_size: int,
    group: Any,
    node: bool,
    device: torch.device,
) -> list[list[list[torch.Tensor]]]:
    """Per state, per rank, the entries the reductions see: this rank's own tensors at its index (their graphs
    kept), every other rank's gathered copies; in global mode with a graph anywhere, the differentiable entries
    as the outputs of one node. Entries that become list-state content are copies, not views of the buffers."""
    entries = [[list(gathered[r][s]) for s in range(len(states))] for r in range(world_size)]
    for s, state in enumerate(states):
        entries[rank][s] = list(state.tensors)
    keep = [s.described.kind == fp.KIND_LIST and not s.is_cat for s in states]  # reduced to themselves: owned
    if node:
        plan = _fused_grad.Plan([], rank, world_size, group, device)
        slots, own = [], []
        for r in range(world_size):
            for s in range(len(states)):
                for i, piece in enumerate(every[r][s].pieces):
                    if piece.requires_grad:
                        plan.entries.append(_fused_grad.Entry(r, gathered[r][s][i], keep[s]))
                        slots.append((r, s, i))
                        if r == rank:
                            own.append(states[s].tensors[i])
        for (r, s, i), output in zip(slots, _fused_grad.apply(plan, own), strict=True):
            entries[r][s][i] = output
    for r in range(world_size):
        for s in range(len(states)):
            if keep[s] and r != rank:
                entries[r][s] = [e if e.grad_fn is not None else e.clone() for e in entries[r][s]]
    return entries


def _reduce(
    metric: Any, states: list[_Local], every: list[list[fp.State]], entries: list[list[list[torch.Tensor]]]
) -> None:
    """Step 3, as torchmetrics does it: stack or flatten, reduce, set (see the module docstring for list order)."""
    for s, state in enumerate(states):
        per_rank = [entries[r][s] for r in range(len(entries))]
        if state.described.kind == fp.KIND_TENSOR:
            gathered: Any = torch.stack([pieces[0] for pieces in per_rank])
        else:
            if state.is_cat:
                real = [r for r, descs in enumerate(every) if descs[s].pieces and not descs[s].placeholder]
                holders = real or [r for r, descs in enumerate(every) if descs[s].pieces]
                gathered = [per_rank[r][0] for r in holders]
            else:
                longest = max(len(pieces) for pieces in per_rank)
                gathered = [pieces[i] for i in range(longest) for pieces in per_rank if i < len(pieces)]
            if not gathered:
                setattr(metric, state.attr, [])
                continue
        reduction = state.reduction
        if not (callable(reduction) or reduction is None):
            raise TypeError("reduction_fn must be callable or None")
        setattr(metric, state.attr, reduction(gathered) if reduction is not None else gathered)
