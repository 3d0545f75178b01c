"""One exchange per ``MetricCollection`` step: under the fused sync, ``forward`` syncs its step-syncing members at once.

``SITE.install()`` replaces the class attribute ``torchmetrics.MetricCollection.forward`` (on every torchmetrics line
from 0.11 to 1.9 it calls each member as ``m(*args, **m._filter_kwargs(**kwargs))`` and builds the result dict);
``SITE.uninstall()`` puts the very same object back. While the engine's effective sync is ``"fused"`` and a process
group is up, the replacement runs torchmetrics' own ``Metric._forward_full_state_update`` (the path every member
with ``dist_sync_on_step=True`` takes) in two halves around one exchange:

1. for each member that joins, in the collection's order: the lines before ``batch_val = self.compute()`` (the
   update on the accumulated states, the flags, the saved states, ``reset()``, the update on the batch alone);
2. one exchange of every joining member's batch states (:func:`torchmetrics_gradpatch.fused.collection.sync_members`,
   the exchange ``compute()`` uses: the member table and every state, over the default group);
3. torchmetrics' own collection ``forward``, with each joining member's ``forward`` standing in (an instance
   attribute, for this one call) for the lines from ``compute()`` on: the exchange's synced batch states are set,
   its own ``compute()`` runs without a sync of its own (so no copy of the batch states is kept for an ``unsync()``
   that ``forward`` never calls), then the saved states, ``_update_count`` and flags are restored and
   ``_forward_cache`` set, as torchmetrics does.

A member that does not join and issues no collective (:mod:`torchmetrics_gradpatch.fused.forms`: it does not sync
on step, or is not distributed) runs its own ``forward`` (and its hooks) in step 1, at its place in the collection's
order, and step 3 collects its result. Every update therefore runs in torchmetrics' order, which keeps gradients
bit for bit: backward sums the gradients an input gets from several members in the order their graphs were made.
A batch state that is a tensor made before its member's update (an input kept as it is) is replaced by an alias
made right after that update, where torchmetrics' own sync would consume it (:func:`_alias_older`).

Why two halves and not each member's own ``forward`` with its sync recorded: a member's ``compute()`` goes on
with its synced states the moment its sync returns, so one exchange for all needs every member's batch states
before any member computes. The halves are torchmetrics' lines, the same on every line but one (the saved states
are ``_copy_state_dict()`` from 1.4 on, the state objects themselves before), so forward values, the states after
each step, gradients (local and global mode, one backward node for the whole exchange) and the epoch-end
``compute()`` are torchmetrics' own, bit for bit. A member whose ``full_state_update`` is false takes this path
too when it syncs on step (torchmetrics sends every ``dist_sync_on_step`` member through
``_forward_full_state_update``).

A rank that runs torchmetrics' own ``forward`` whole (a class it does not trust, or a function it does not
recognise: :func:`torchmetrics_gradpatch.fused.collection.members_of`) sends its member table alone, flagged; then no
member joins on any rank, and every rank runs each member whole, or finishes the ones it began, in order.
A rank holding any other member (one not taken over that may issue collectives: a wrapper, hooks, its own
``dist_sync_fn`` or group, a synced member) runs no member first: it sends its member table alone in the exchange's
first collective, which its peers issue after their first halves (they issue none before it). From every rank's
table, alike on every rank: where every rank ran its first halves, the exchange completes as above; else every rank
runs each member in order (the ones taken over on every rank up to their ``compute()``, the others whole, with
torchmetrics' own ``_sync_dist`` where the ranks' forms differ), then a second exchange syncs the ones taken over.
Ranks whose forms differ so that torchmetrics' own sync would wait raise the same
:class:`~torchmetrics_gradpatch.FusedSyncError` after the same collectives, every member begun put back as after
its update of this batch. A rank where no member syncs on step runs no exchange, as torchmetrics' own ``forward``
issues no collective there.

Compute groups: ``forward``'s ``reset()`` gives each member states of its own for the batch (a group's shared state
crosses once in ``compute()`` only); a list state that members share is taken apart after each first half, since
torchmetrics 1.4 on clears a list in place in ``reset()``. Under ``torch.compile`` the whole of it runs behind one
graph break. In check mode the step is compared with torchmetrics' own (:mod:`torchmetrics_gradpatch.fused.check`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchmetrics_gradpatch import _compile, _engine
from torchmetrics_gradpatch._site import Site
from torchmetrics_gradpatch.fused import aside, forms

__all__ = ["SITE"]

_MARK = "__torchmetrics_gradpatch_step__"  # set on our replacement, so it is told apart from another tool's


@functools.cache
def _sync() -> Any:
    """:mod:`torchmetrics_gradpatch.fused.sync` (it imports torch), imported at the first step."""
    from torchmetrics_gradpatch.fused import sync

    return sync


@functools.cache
def _copies_states() -> bool:
    """Whether this torchmetrics' forward saves the accumulated states as copies (``_copy_state_dict``, 1.4 on)."""
    import torchmetrics
    from packaging.version import Version

    return Version(torchmetrics.__version__).release >= (1, 4)


@dataclass
class _Pending:
    """A member between the two halves of torchmetrics' ``_forward_full_state_update``: what the first saved."""

    metric: Any
    update_count: int
    compute_on_cpu: bool
    cache: dict[str, Any]
    reduce: Callable[[], None] | None = field(default=None)
    finished: bool = False
    result: Any = None

    @classmethod
    def begin(cls, metric: Any, args: tuple[Any, ...], kwargs: dict[str, Any], copies: bool) -> _Pending:
        """torchmetrics' lines up to ``batch_val = self.compute()`` (attributes set through
        :func:`~torchmetrics_gradpatch.fused.sync.put`)."""
        put = _sync().put
        metric.update(*args, **kwargs)  # global accumulation
        update_count = metric._update_count
        compute_on_cpu = metric.compute_on_cpu
        # _should_unsync: the states are restored below, not by compute()'s unsync
        flags = {"_to_sync": metric.dist_sync_on_step, "_should_unsync": False, "compute_on_cpu": False}
        _sync().put_all(metric, flags)
        cache = metric._copy_state_dict() if copies else {attr: getattr(metric, attr) for attr in metric._defaults}
        put(metric, "_enable_grad", True)  # allow grads for batch computation
        metric.reset()
        first = _next_node()
        metric.update(*args, **kwargs)
        if first is not None:
            _alias_older(metric, first)
        return cls(metric, update_count, compute_on_cpu, cache)

    def finish(self, *_: Any, **__: Any) -> Any:
        """torchmetrics' lines from ``batch_val = self.compute()`` on; stands in for the member's ``forward`` (its
        arguments were used by :meth:`begin`). Once finished, it returns that value again.

        Where the exchange synced the member, its synced batch states are set first, as its ``sync()`` would set
        them (``_is_synced``), and its ``compute()`` runs without a sync of its own. What that skips is the copy
        of the batch states ``sync()`` keeps for ``unsync()``, which ``forward`` never calls (it restores the
        accumulated states itself); else the member syncs in its ``compute()``."""
        if self.finished:
            return self.result
        metric = self.metric
        if self.reduce is not None:
            self.reduce()
            _sync().put_all(metric, {"_is_synced": True, "_to_sync": False})
        batch_val = metric.compute()
        self.restore()
        _sync().put(metric, "_forward_cache", batch_val)
        self.finished, self.result = True, batch_val
        return batch_val

    def restore(self) -> None:
        """torchmetrics' "restore context" lines: the accumulated states, ``_update_count`` and the flags."""
        metric = self.metric
        put_all = _sync().put_all
        put_all(metric, self.cache)
        put_all(
            metric,
            {
                "_update_count": self.update_count,
                "_is_synced": False,
                "_should_unsync": True,
                "_to_sync": metric.sync_on_compute,
                "_computed": None,
                "_enable_grad": False,
                "compute_on_cpu": self.compute_on_cpu,
            },
        )
        if metric.compute_on_cpu:
            metric._move_list_states_to_cpu()


@functools.cache
def _probe() -> Any:
    import torch

    return torch.zeros((), requires_grad=True)


_UNNUMBERED = -1  # torch 2.0's nodes made in C++ do not tell their sequence number: every state counts as older


def _next_node() -> int | None:
    """The sequence number of the next autograd node made on this thread (``None`` where grad mode is off: then
    the second half makes no node either)."""
    import torch

    if not torch.is_grad_enabled():
        return None
    numbered = getattr(_probe().view(()).grad_fn, "_sequence_nr", None)
    return _UNNUMBERED if numbered is None else int(numbered()) + 1


def _older(value: Any, first: int) -> bool:
    """Whether ``value`` is a tensor with a graph that was made before node ``first`` (an input, a leaf)."""
    if not getattr(value, "requires_grad", False):
        return False
    node = value.grad_fn
    return node is None or first == _UNNUMBERED or node._sequence_nr() < first


def _alias_older(metric: Any, first: int) -> None:
    """Give each batch state of ``metric`` that is a tensor made before its batch update (an input it keeps as it
    is, as ``CatMetric`` and the ``cat`` states of ``CosineSimilarity`` do) a node of its own, made now.

    Backward sums the gradients that such a tensor gets from several members in the order their nodes were made.
    In torchmetrics' ``forward`` this member's sync consumes the tensor before the next member's update does; here
    it syncs after every member's update, so it consumes an alias (a view, which passes its gradient on as it is)
    made at the place torchmetrics' sync has. A state made by the update itself is consumed by this member's sync
    alone, in either order, and stays as it is (on torch 2.0, which cannot tell, it is aliased too: an alias
    changes no gradient)."""
    for attr in metric._defaults:
        value = getattr(metric, attr)
        if isinstance(value, list):
            if any(_older(each, first) for each in value):
                _sync().put(metric, attr, [each.view_as(each) if _older(each, first) else each for each in value])
        elif _older(value, first):
            _sync().put(metric, attr, value.view_as(value))


@dataclass
class _Done:
    """A member that ran its own ``forward`` (it opts out) in the collection's order: its result, and its hooks, put
    aside while torchmetrics' collection ``forward`` calls it again to collect that result."""

    metric: Any
    result: Any
    hooks: dict[str, Any] = field(default_factory=dict)

    def finish(self, *_: Any, **__: Any) -> Any:
        return self.result


def _shared_lists(members: list[tuple[str, Any]]) -> set[int]:
    """The list states that several members hold as one object (a compute group's, linked by ``items()``)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, metric in members:
        for attr, default in getattr(metric, "_defaults", {}).items():
            if isinstance(default, list):  # a list state (one whose default is a tensor never holds a list)
                value = getattr(metric, attr)
                if isinstance(value, list):
                    (shared if id(value) in seen else seen).add(id(value))
    return shared


def _own_lists(metric: Any, shared: set[int]) -> None:
    """Give ``metric`` its batch list states as lists of its own where another member holds the same list object.

    torchmetrics (1.4 on) clears a list state in place in ``reset()``, and in its ``forward`` each member computes
    before the next member's ``reset()``; here every member's first half runs first, so the next member's
    ``reset()`` would empty this member's batch list before it computes. The tensors are the same; the list
    object the next member updates is left as torchmetrics leaves it.
    """
    for attr in metric._defaults:
        value = getattr(metric, attr)
        if isinstance(value, list) and id(value) in shared:
            setattr(metric, attr, list(value))


class _Step:
    """One collection step: the members, and each one's state between the two halves (see the module docstring)."""

    def __init__(self, members: list[tuple[str, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.members, self.args, self.kwargs = members, args, kwargs
        self.copies, self.shared = _copies_states(), _shared_lists(members)
        self.pending: dict[int, _Pending] = {}
        self.steps: dict[int, _Pending | _Done] = {}  # by member index

    def begin(self, i: int) -> None:
        """The first half of member ``i``'s ``forward``, which joins an exchange."""
        metric = self.members[i][1]
        begun = _Pending.begin(metric, self.args, metric._filter_kwargs(**self.kwargs), self.copies)
        if self.shared:
            _own_lists(metric, self.shared)
        self.pending[id(metric)] = self.steps[i] = begun

    def run(self, i: int) -> None:
        """Member ``i``'s own ``forward``, whole, with its hooks (it joins no exchange)."""
        metric = self.members[i][1]
        self.steps[i] = _Done(metric, metric(*self.args, **metric._filter_kwargs(**self.kwargs)))

    def record(self, metric: Any, reduce: Callable[[], None]) -> None:
        self.pending[id(metric)].reduce = reduce

    def restore(self) -> None:
        """Every joining member not finished yet, as after its update of this batch (its accumulated states kept)."""
        for begun in self.pending.values():
            if not begun.finished:
                begun.restore()

    def collect(self, original: Callable[..., Any], collection: Any) -> Any:
        """torchmetrics' own collection ``forward``, each member's ``forward`` standing in with what it has done (in
        call order, for an object the collection holds under several keys)."""
        queues: dict[int, list[_Pending | _Done]] = {}
        for each in self.steps.values():
            queues.setdefault(id(each.metric), []).append(each)
        stood_in: list[_Pending | _Done] = []
        try:
            for queue in queues.values():
                metric = queue[0].metric
                metric.__dict__["forward"] = functools.partial(_next, queue)  # what Module.__call__ runs for it now
                stood_in.append(queue[0])
                for each in queue:
                    if isinstance(each, _Done):  # its hooks ran with its own forward
                        for name in forms.HOOKS:
                            if getattr(metric, name, None):
                                each.hooks[name] = getattr(metric, name)
                                setattr(metric, name, type(each.hooks[name])())
            return original(collection, *self.args, **self.kwargs)
        finally:
            for each in stood_in:
                del each.metric.__dict__["forward"]
            for each in self.steps.values():
                if isinstance(each, _Done):
                    for name, hooks in each.hooks.items():
                        setattr(each.metric, name, hooks)


def _next(queue: list[_Pending | _Done], *_: Any, **__: Any) -> Any:
    return queue.pop(0).finish()


def _forward(original: Callable[..., Any], collection: Any, unrecognised: bool, *args: Any, **kwargs: Any) -> Any:
    """The collection's ``forward`` with one exchange for every member that joins (see the module docstring);
    ``unrecognised``: a torchmetrics function it relies on is not recognised here."""
    import torch.distributed as dist

    from torchmetrics_gradpatch.fused import collection as fc

    if not (dist.is_available() and dist.is_initialized()):
        return original(collection, *args, **kwargs)
    members, aside_here = fc.members_of(collection, unrecognised)
    codes = forms.forms_of(members, on_step=True)
    if not fc.syncs_here(members, codes, on_step=True):
        return original(collection, *args, **kwargs)
    if not _engine.effective_check():
        return _exchange_and_forward(original, collection, members, codes, aside_here, args, kwargs)
    from torchmetrics_gradpatch.fused import check

    return check.run(
        "a MetricCollection's forward",
        collection,
        lambda: _exchange_and_forward(original, collection, members, codes, aside_here, args, kwargs),
        lambda: fc.torchmetrics_own(original, collection, *args, **kwargs),
    )


def _exchange_and_forward(
    original: Callable[..., Any],
    collection: Any,
    members: list[tuple[str, Any]],
    codes: list[int],
    aside_here: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    from torchmetrics_gradpatch.fused import collection as fc

    mode = _engine.effective_mode()
    # staged: every member joins or issues no collective, so the first halves run before the exchange, in the
    # collection's order (every graph node is made in torchmetrics' order, so the gradients that an input gets from
    # several members are summed in its order too); else this rank sends its member table alone first. A rank that
    # runs torchmetrics' own path (aside_here) sends it alone too, and then no member joins on any rank.
    staged = not aside_here and all(forms.kind(code) in (forms.JOINED, forms.QUIET) for code in codes)
    step = _Step(members, args, kwargs)
    try:
        if staged:
            for i, code in enumerate(codes):
                step.begin(i) if code == forms.JOINS else step.run(i)
        outcome = fc.sync_members(members, mode, codes, step.record, staged, aside_here)
        if not outcome.everywhere:
            # some rank has a member the exchange does not take over: from the same tables, every rank runs each
            # member in order, the ones that join everywhere up to their compute(), every other member whole (its
            # sync where every rank issues it, at its place), then a second exchange for the ones that join
            with outcome.torchmetrics_sync():
                if not staged and not outcome.joins:
                    return original(collection, *args, **kwargs)
                for i in range(len(members)):
                    if i in outcome.joins:
                        if not staged:
                            step.begin(i)
                    elif not staged:
                        step.run(i)
                    elif codes[i] == forms.JOINS:
                        step.steps[i].finish()  # its sync differs between ranks: torchmetrics' own, now
            if outcome.joins:
                again = [forms.JOINS if i in outcome.joins else forms.RAN for i in range(len(members))]
                fc.sync_members(members, mode, again, step.record)
    except BaseException:
        step.restore()
        raise
    try:
        return step.collect(original, collection)
    except BaseException:
        step.restore()  # a member's compute() failed: the others as after their update of this batch
        raise


def _replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)  # name, doc, __wrapped__ = the original, restored by uninstall
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _engine.effective_sync() != "fused":
            return original(self, *args, **kwargs)
        # a rank that steps aside still takes part in the exchange, so that every rank steps aside with it
        unrecognised = aside.stepping_aside(aside.STEP)
        if _compile.is_compiling():  # under torch.compile: one graph break, the whole of it runs eagerly
            return _compile.run_eagerly(functools.partial(_forward, original, self, unrecognised, *args, **kwargs))
        return _forward(original, self, unrecognised, *args, **kwargs)

    return forward


#: ``MetricCollection.forward``, replaced by ``SITE.install()`` (now, or when ``torchmetrics.collections`` is
#: imported; idempotent) and put back, the very same object, by ``SITE.uninstall()``
SITE = Site("torchmetrics.collections", "MetricCollection", "forward", _MARK, _replacement)
