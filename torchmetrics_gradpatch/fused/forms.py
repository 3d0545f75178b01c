"""Which members of a ``MetricCollection`` the fused exchange takes over, and what torchmetrics does with the others.

The exchange takes a member over only in the one form its tests show to give torchmetrics' own result: an allowlist,
not a list of exceptions. :func:`form` gives :data:`JOINS` for a Metric

* of a class that overrides none of the methods the fused path re-implements or relies on (:data:`OWN_METHODS`),
  with no other Metric inside it (a wrapper, a ``CompositionalMetric``) and none of those methods set on the
  instance;
* held once by the collection (not the same object under a second key);
* with no module hooks of its own and no global module hooks registered;
* that syncs (on compute, or on step) over the default group with torchmetrics' own gather;

and, for everything else, the reason torchmetrics' own path applies (the same tests its own ``compute()`` or
``forward`` makes, in that order). Every reason falls in one of four kinds (:func:`kind`): the member issues no
collective (:data:`QUIET`), syncs over a process group of its own (:data:`OTHER_GROUP`), raises as synced already
(:data:`RAISES`), or runs its own path over the default group (:data:`OWN_PATH`), which may issue collectives there:
a form not proven is assumed to, so that a rank never skips an exchange its peers run.

:func:`detail` is a digest of the sync-relevant facts of a member and of every Metric inside it; ranks whose members
agree in form but not in detail run torchmetrics' own sync for that member. This module imports neither torch nor
torchmetrics at import time.
"""

from __future__ import annotations

import collections
import functools
import operator
import zlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "HOOKS",
    "JOINED",
    "JOINS",
    "OTHER_GROUP",
    "OWN_METHODS",
    "OWN_PATH",
    "QUIET",
    "RAISES",
    "computes_anew",
    "describe",
    "detail",
    "form",
    "forms_of",
    "global_hooks",
    "inside",
    "kind",
]

JOINS = 0
# issue no collective
NO_SYNC, NO_STEP_SYNC, NOT_DISTRIBUTED = 1, 2, 3
# sync over a group of their own, or raise
OWN_GROUP, SYNCED = 4, 5
# run their own path over the default group
OWN_SYNC_FN, OWN_SYNC_DIST, HOLDS_METRICS, OVERRIDES, MODULE_HOOKS, GLOBAL_HOOKS, DUPLICATE, NOT_A_METRIC = range(6, 14)
# a step's member that has run its own forward before a second exchange
RAN = 14

JOINED, QUIET, OTHER_GROUP, RAISES, OWN_PATH = "joins", "quiet", "other group", "raises", "own path"
_KINDS = {
    JOINS: JOINED,
    NO_SYNC: QUIET,
    NO_STEP_SYNC: QUIET,
    NOT_DISTRIBUTED: QUIET,
    RAN: QUIET,
    OWN_GROUP: OTHER_GROUP,
    SYNCED: RAISES,
}
_TEXTS = {
    JOINS: "joins the collection's exchange",
    NO_SYNC: "does not sync on compute (sync_on_compute=False)",
    NO_STEP_SYNC: "does not sync on step (dist_sync_on_step=False)",
    NOT_DISTRIBUTED: "is not distributed (its distributed_available_fn)",
    OWN_GROUP: "syncs over a process group of its own",
    SYNCED: "is synced already",
    OWN_SYNC_FN: "syncs with a dist_sync_fn of its own",
    OWN_SYNC_DIST: "overrides _sync_dist",
    HOLDS_METRICS: "holds other metrics (a wrapper)",
    OVERRIDES: "overrides a method the fused sync re-implements",
    MODULE_HOOKS: "has module hooks",
    GLOBAL_HOOKS: "runs under global module hooks",
    DUPLICATE: "is held by the collection under another key too",
    NOT_A_METRIC: "is not a torchmetrics Metric",
    RAN: "has run its own forward in this step",
}

#: ``Metric`` methods a member's class (or the member itself) must not replace to join: the fused path re-implements
#: their lines (``_sync_dist``, ``_forward_full_state_update``) or calls them expecting torchmetrics' own behaviour.
OWN_METHODS = (
    "forward",
    "_forward_full_state_update",
    "sync",
    "unsync",
    "sync_context",
    "_wrap_compute",
    "_wrap_update",
    "__call__",
    "__setattr__",  # the fused step sets a member's plain attributes as Module.__setattr__ stores them
)
_OWN = operator.attrgetter(*OWN_METHODS)
_INSTANCE = ("forward", "_forward_full_state_update", "_sync_dist", "sync", "unsync", "sync_context", "reset")
#: a module's own hook dictionaries (``torch.nn.Module``'s attributes)
HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOKED = operator.attrgetter(*HOOKS)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def kind(code: int) -> str:
    """What becomes of a member of this form: :data:`JOINED`, or one of the four kinds of torchmetrics' own path."""
    return _KINDS.get(code, OWN_PATH)


def describe(code: int) -> str:
    """The form as errors name it."""
    return _TEXTS.get(code, f"form {code}")


def global_hooks() -> bool:
    """Whether global module hooks are registered (``torch.nn.modules.module.register_module_*_hook``)."""
    import torch.nn.modules.module as tm

    return any(getattr(tm, name, None) for name in _GLOBAL_HOOKS)


def inside(module: Any) -> Iterator[Any]:
    """Every module inside ``module``, depth first, each once: ``Module.modules()`` without its set of modules,
    which hashes a Metric by its states."""
    seen = {id(module)}
    stack = list(module._modules.values())
    while stack:
        each = stack.pop()
        if each is not None and id(each) not in seen:
            seen.add(id(each))
            yield each
            stack.extend(each._modules.values())


@functools.cache
def _torch_and_torchmetrics() -> tuple[Any, Any, Any]:
    """``torch.distributed``, ``torchmetrics.Metric`` and ``torchmetrics.utilities.distributed``, imported at the
    first call (a form is asked for every member at every sync)."""
    import torch.distributed as dist
    import torchmetrics.utilities.distributed as tm_distributed
    from torchmetrics import Metric

    return dist, Metric, tm_distributed


def _proven_class(metric: Any) -> int:
    """JOINS where the member's class and instance replace nothing the fused path relies on, else the reason."""
    Metric = _torch_and_torchmetrics()[1]  # noqa: N806 (the class)

    cls = type(metric)
    if metric._modules and any(isinstance(inner, Metric) for inner in inside(metric)):
        return HOLDS_METRICS  # wrappers, CompositionalMetric: the Metrics inside sync themselves, in their order
    if cls._sync_dist is not Metric.__dict__["_sync_dist"]:
        return OWN_SYNC_DIST  # it may post-process (MeanAveragePrecision does)
    if _OWN(cls) != _OWN(Metric):  # functions compare by identity
        return OVERRIDES
    if any(map(metric.__dict__.__contains__, _INSTANCE)):
        return OVERRIDES
    return JOINS


def form(metric: Any, on_step: bool = False, duplicate: bool = False, hooked: bool | None = None) -> int:
    """Whether ``metric`` joins the exchange (:data:`JOINS`), else why not: for ``compute()``, or (``on_step``) for
    the ``forward`` of a step, where the batch states sync when ``dist_sync_on_step`` is set.

    ``duplicate``: the collection holds this object under an earlier key too; ``hooked``: global module hooks are
    registered (default: looked up).
    """
    dist, Metric, tm_distributed = _torch_and_torchmetrics()  # noqa: N806 (the class)

    if not isinstance(metric, Metric):
        return NOT_A_METRIC
    proven = _proven_class(metric)
    if proven != JOINS:
        return proven
    # torchmetrics' own tests, in its order: forward raises on a synced metric first; compute() checks _to_sync
    if on_step:
        if metric._is_synced:
            return SYNCED
        if not metric.dist_sync_on_step:
            return NO_STEP_SYNC
    elif not metric._to_sync:
        return NO_SYNC
    elif metric._is_synced:
        return SYNCED
    available = metric.distributed_available_fn
    if not (callable(available) and available()):
        return NOT_DISTRIBUTED
    if duplicate:
        return DUPLICATE
    if metric.dist_sync_fn not in (None, tm_distributed.gather_all_tensors):
        return OWN_SYNC_FN
    if metric.process_group not in (None, dist.group.WORLD):
        return OWN_GROUP
    if any(_HOOKED(metric)):
        return MODULE_HOOKS
    if global_hooks() if hooked is None else hooked:
        return GLOBAL_HOOKS
    return JOINS


def _name(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def detail(metric: Any) -> int:
    """A digest of what decides how ``metric`` and every Metric inside it sync: their classes, sync functions,
    groups, sync flags and hooks. Equal on ranks that hold alike."""
    import torch.distributed as dist
    import torchmetrics.utilities.distributed as tm_distributed
    from torchmetrics import Metric

    facts: list[str] = []
    for each in (metric, *inside(metric)) if hasattr(metric, "_modules") else (metric,):
        if not isinstance(each, Metric):
            continue
        fn = getattr(each, "dist_sync_fn", None)
        group = getattr(each, "process_group", None)
        facts.append(
            "|".join(
                (
                    type(each).__qualname__,
                    "gather" if fn in (None, tm_distributed.gather_all_tensors) else _name(fn),
                    "world" if group in (None, dist.group.WORLD) else "own group",
                    str(bool(getattr(each, "dist_sync_on_step", False))),
                    str(bool(getattr(each, "_to_sync", False))),
                    str(bool(getattr(each, "_is_synced", False))),
                    str(any(getattr(each, name, None) for name in HOOKS)),
                )
            )
        )
    return zlib.crc32("/".join(facts).encode())


def forms_of(members: list[tuple[str, Any]], on_step: bool = False) -> list[int]:
    """Each member's form (:func:`form`) for ``compute()`` or (``on_step``) the
    step's ``forward``: an object held under several keys is a duplicate under each (torchmetrics runs it whole
    at each of its places)."""
    hooked = global_hooks()
    counts = collections.Counter(id(metric) for _, metric in members)
    twice = {key for key, count in counts.items() if count > 1}
    return [form(metric, on_step, id(metric) in twice, hooked) for _, metric in members]


def computes_anew(metric: Any) -> bool:
    """Whether ``compute()`` of ``metric`` computes anew, and so may sync: it holds no cached result where
    torchmetrics caches one. A Metric whose class leaves ``compute`` unwrapped (torchmetrics' wrappers and
    ``CompositionalMetric`` from 1.0 on: no cache, no sync of their own) computes anew where a Metric inside it does."""
    Metric = _torch_and_torchmetrics()[1]  # noqa: N806 (the class)

    if not isinstance(metric, Metric):
        return True
    if type(metric)._wrap_compute is Metric._wrap_compute:
        return getattr(metric, "_computed", None) is None
    stack = list(metric._modules.values())
    while stack:  # the Metrics right inside it, through plain modules (a ModuleList of copies)
        each = stack.pop()
        if isinstance(each, Metric):
            if computes_anew(each):
                return True
        elif each is not None:
            stack.extend(each._modules.values())
    return False
