"""One exchange per ``MetricCollection`` step: under the fused sync, ``forward`` syncs its step-syncing members at once.

``SITE`` replaces ``MetricCollection.forward``: torchmetrics' own ``Metric._forward_full_state_update`` runs in two
halves around one :func:`~.collection.sync_members` of every joining member's batch states, every update in
torchmetrics' order, so values, states and gradients are its own bit for bit. Why two halves, and what happens where
ranks hold other members: docs/design.md ("The fused step").
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from torchmetrics_gradpatch import _compile, _engine
from torchmetrics_gradpatch._site import STEP_MARK, Site
from torchmetrics_gradpatch.fused import collection, forms, internals, recognise
from torchmetrics_gradpatch.fused.collection import Members, Method


@dataclass
class _Pending:
    """A member between the two halves of torchmetrics' ``_forward_full_state_update``: what the first saved."""

    metric: Any
    update_count: int
    compute_on_cpu: bool
    cache: dict[str, Any]
    synced: Any = None  # the exchange's synced batch states (collection.Synced), once it ran
    finished: bool = False
    result: Any = None

    def finish(self) -> Any:
        """torchmetrics' lines from ``batch_val = self.compute()`` on (once; then that value again). Synced batch
        states are set first, as ``sync()`` sets them, and ``compute()`` runs without a sync of its own."""
        if self.finished:
            return self.result
        metric = self.metric
        if self.synced is not None:
            self.synced.set()
            self.synced = None  # its entries, and the receive buffers they view, are not held while it computes
            internals.set_flags(metric, is_synced=True, to_sync=False)
        batch_val = metric.compute()
        self.restore()
        internals.set_flags(metric, forward_cache=batch_val)
        self.finished, self.result = True, batch_val
        return batch_val

    def restore(self) -> None:
        """torchmetrics' "restore context" lines: the accumulated states, ``_update_count`` and the flags."""
        metric = self.metric
        internals.put(metric, self.cache)
        internals.set_flags(metric, update_count=self.update_count, is_synced=False, should_unsync=True, computed=None)
        internals.set_flags(
            metric, to_sync=metric.sync_on_compute, enable_grad=False, compute_on_cpu=self.compute_on_cpu
        )
        if metric.compute_on_cpu:
            internals.move_list_states_to_cpu(metric)


@functools.cache
def _probe() -> Any:
    return torch.zeros((), requires_grad=True)


def _next_node() -> int | None:
    """The sequence number of the next autograd node made on this thread (``None``: grad mode is off)."""
    if not torch.is_grad_enabled():
        return None
    # torch 2.0's nodes made in C++ do not tell their sequence number: every state counts as older
    return internals.sequence_nr(_probe().view(()).grad_fn, sys.maxsize - 1) + 1


def _older(value: Any, first: int) -> bool:
    """Whether ``value`` is a tensor with a graph that was made before node ``first`` (an input, a leaf)."""
    if not getattr(value, "requires_grad", False):
        return False
    node = value.grad_fn
    return node is None or internals.sequence_nr(node, 0) < first


def _alias_older(metric: Any, first: int) -> None:
    """Give each batch state that is a tensor made before node ``first`` (an input kept as it is) an alias made now,
    where torchmetrics' own sync would consume it (docs/design.md, "The fused step": aliases of older tensors)."""
    for attr in internals.defaults(metric):
        value = getattr(metric, attr)
        if isinstance(value, list):
            if any(_older(each, first) for each in value):
                internals.put(metric, {attr: [each.view_as(each) if _older(each, first) else each for each in value]})
        elif _older(value, first):
            internals.put(metric, {attr: value.view_as(value)})


class _Done(NamedTuple):
    """A member that ran its own ``forward`` whole at its place (it joins no exchange): its result, handed back."""

    metric: Any
    result: Any

    def finish(self) -> Any:
        return self.result


class _Step:
    """One collection step: the members, and each one's state between the two halves (see the module docstring)."""

    def __init__(self, members: Members, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.members, self.args, self.kwargs = members, args, kwargs
        self.pending: dict[int, _Pending] = {}
        self.steps: dict[int, _Pending | _Done] = {}  # by member index
        # the list states several members hold as one object (a compute group's, linked by items())
        seen: set[int] = set()
        self.shared: set[int] = set()
        for _, metric in members:
            for attr, default in internals.defaults(metric).items():
                # a list state (one whose default is a tensor never holds a list)
                if isinstance(default, list) and isinstance(value := getattr(metric, attr), list):
                    (self.shared if id(value) in seen else seen).add(id(value))

    def begin(self, i: int) -> None:
        """The first half of member ``i``'s ``forward``, which joins an exchange: torchmetrics' lines up to
        ``batch_val = self.compute()``."""
        metric = self.members[i][1]
        kwargs = internals.filter_kwargs(metric, self.kwargs)
        metric.update(*self.args, **kwargs)  # global accumulation
        update_count = internals.flag(metric, "update_count")
        compute_on_cpu = metric.compute_on_cpu
        # should_unsync: the states are restored below, not by compute()'s unsync
        internals.set_flags(metric, to_sync=metric.dist_sync_on_step, should_unsync=False, compute_on_cpu=False)
        cache = internals.copy_state_dict(metric)
        internals.set_flags(metric, enable_grad=True)  # allow grads for batch computation
        metric.reset()
        first = _next_node()
        metric.update(*self.args, **kwargs)
        if first is not None:
            _alias_older(metric, first)
        # a list another member holds becomes its own: torchmetrics (1.4 on) clears a list in place in reset(), which
        # the next member's first half runs before this member computes
        if self.shared:
            for attr in internals.defaults(metric):
                value = getattr(metric, attr)
                if isinstance(value, list) and id(value) in self.shared:
                    setattr(metric, attr, list(value))
        self.pending[id(metric)] = self.steps[i] = _Pending(metric, update_count, compute_on_cpu, cache)

    def run(self, i: int) -> None:
        """Member ``i``'s own ``forward``, whole, with its hooks (it joins no exchange)."""
        metric = self.members[i][1]
        self.steps[i] = _Done(metric, metric(*self.args, **internals.filter_kwargs(metric, self.kwargs)))

    def synced(self, outcome: Any) -> None:
        """Hand each member the exchange synced its batch states."""
        for synced in outcome.take():
            self.pending[id(synced.metric)].synced = synced

    def forward(self, original: Method, metrics: Any, codes: list[int], aside_here: bool) -> Any:
        """The collection's ``forward``: the first halves, the exchange, torchmetrics' own ``forward`` to collect; on
        failure every member begun is put back as after its update of this batch."""
        mode = _engine.effective_mode()
        # staged: every member joins or issues no collective, so the first halves run before the exchange in the
        # collection's order (so an input's gradients are summed in torchmetrics' order); else, and where this rank
        # runs torchmetrics' own path, it sends its member table alone first
        staged = not aside_here and all(forms.kind(code) in (forms.JOINED, forms.QUIET) for code in codes)
        members, args, kwargs = self.members, self.args, self.kwargs
        try:
            if staged:
                for i, code in enumerate(codes):
                    self.begin(i) if code == forms.JOINS else self.run(i)
            outcome = collection.sync_members(members, mode, codes, staged, aside_here)
            self.synced(outcome)
            if not outcome.everywhere:
                # some rank has a member the exchange does not take over: from the same tables, every rank runs each
                # member in order, the ones that join everywhere up to their compute(), every other member whole (its
                # sync where every rank issues it, at its place), then a second exchange for the ones that join
                with collection.torchmetrics_sync(outcome.own_sync):
                    if not staged and not outcome.joins:
                        return original(metrics, *args, **kwargs)
                    for i in range(len(members)):
                        if not staged:
                            self.begin(i) if i in outcome.joins else self.run(i)
                        elif i not in outcome.joins and codes[i] == forms.JOINS:
                            self.steps[i].finish()  # its sync differs between ranks: torchmetrics' own, now
                if outcome.joins:
                    again = [forms.JOINS if i in outcome.joins else forms.RAN for i in range(len(members))]
                    self.synced(collection.sync_members(members, mode, again))
            return self.collect(original, metrics)
        except BaseException:
            for begun in self.pending.values():
                if not begun.finished:  # a finished one was restored by its finish()
                    begun.restore()
            raise

    def collect(self, original: Method, metrics: Any) -> Any:
        """torchmetrics' own collection ``forward``, each member's ``forward`` handing back what it has done (in call
        order, for an object held under several keys)."""
        queues: dict[int, list[_Pending | _Done]] = {}
        for each in self.steps.values():
            queues.setdefault(id(each.metric), []).append(each)
        stood_in: list[Any] = []
        aside: list[tuple[Any, str, Any]] = []  # the hooks of a member that ran its own forward: they ran with it
        try:
            for queue in queues.values():
                metric = queue[0].metric
                internals.stand_in(metric, "forward", functools.partial(_next, queue))  # what Module.__call__ runs
                stood_in.append(metric)
                if any(isinstance(each, _Done) for each in queue):
                    for name in internals.HOOKS:
                        if getattr(metric, name, None):
                            aside.append((metric, name, getattr(metric, name)))
                            setattr(metric, name, type(aside[-1][2])())
            return original(metrics, *self.args, **self.kwargs)
        finally:
            for metric in stood_in:
                internals.stand_down(metric, "forward")
            for metric, name, hooks in aside:
                setattr(metric, name, hooks)


def _next(queue: list[_Pending | _Done], *_: Any, **__: Any) -> Any:
    return queue.pop(0).finish()


def _fused(
    original: Method, metrics: Any, members: Members, codes: list[int], aside_here: bool, /, *args: Any, **kwargs: Any
) -> Any:
    return _Step(members, args, kwargs).forward(original, metrics, codes, aside_here)


def _replacement(original: Method) -> Method:
    @functools.wraps(original)  # name, doc, __wrapped__ = the original, restored by uninstall
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _engine.effective_sync() != "fused":
            return original(self, *args, **kwargs)
        # a rank that steps aside still takes part in the exchange, so that every rank steps aside with it
        unrecognised = recognise.stepping_aside(recognise.STEP)
        if _compile.is_compiling():  # under torch.compile: one graph break, the whole of it runs eagerly
            adapted = functools.partial(collection.adapt, _fused, original, self, unrecognised, True, *args, **kwargs)
            return _compile.run_eagerly(adapted)
        return collection.adapt(_fused, original, self, unrecognised, True, *args, **kwargs)

    return forward


#: ``MetricCollection.forward``, replaced by ``SITE.install()`` and put back, the very same object, on ``uninstall()``
SITE = Site("torchmetrics.collections", "MetricCollection", "forward", STEP_MARK, _replacement)
