"""Which members of a ``MetricCollection`` the fused exchange takes over (:data:`JOINS`, an allowlist), why not
the others, in one of four kinds (:func:`kind`), and :func:`detail`, a member's sync-relevant facts for ranks to
compare. Imports neither torch nor torchmetrics at import time. docs/fused-sync.md#which-members-it-takes-over says
which; docs/design.md#members-and-their-forms why.
"""

from __future__ import annotations

import collections
import functools
import zlib
from collections.abc import Iterator
from typing import Any

from torchmetrics_gradpatch.fused import internals

#: the forms, by code (a code travels between ranks in the member table: these values are the wire's)
JOINS, NO_SYNC, NO_STEP_SYNC, NOT_DISTRIBUTED, OWN_GROUP, SYNCED = range(6)
OWN_SYNC_FN, OWN_SYNC_DIST, HOLDS_METRICS, OVERRIDES, MODULE_HOOKS, GLOBAL_HOOKS, DUPLICATE, NOT_A_METRIC = range(6, 14)
RAN = 14  # a step's member that has run its own forward before a second exchange

JOINED, QUIET, OTHER_GROUP, RAISES, OWN_PATH = "joins", "quiet", "other group", "raises", "own path"
#: each form's kind (a quiet member issues no collective) and how errors name it
_FORMS = {
    JOINS: (JOINED, "joins the collection's exchange"),
    NO_SYNC: (QUIET, "does not sync on compute (sync_on_compute=False)"),
    NO_STEP_SYNC: (QUIET, "does not sync on step (dist_sync_on_step=False)"),
    NOT_DISTRIBUTED: (QUIET, "is not distributed (its distributed_available_fn)"),
    OWN_GROUP: (OTHER_GROUP, "syncs over a process group of its own"),
    SYNCED: (RAISES, "is synced already"),
    OWN_SYNC_FN: (OWN_PATH, "syncs with a dist_sync_fn of its own"),
    OWN_SYNC_DIST: (OWN_PATH, "overrides _sync_dist"),
    HOLDS_METRICS: (OWN_PATH, "holds other metrics (a wrapper)"),
    OVERRIDES: (OWN_PATH, "overrides a method the fused sync re-implements"),
    MODULE_HOOKS: (OWN_PATH, "has module hooks"),
    GLOBAL_HOOKS: (OWN_PATH, "runs under global module hooks"),
    DUPLICATE: (OWN_PATH, "is held by the collection under another key too"),
    NOT_A_METRIC: (OWN_PATH, "is not a torchmetrics Metric"),
    RAN: (QUIET, "has run its own forward in this step"),
}
_KINDS = {code: form_kind for code, (form_kind, _) in _FORMS.items()}  # read per member on every sync: one lookup


def kind(code: int) -> str:
    """What becomes of a member of this form: :data:`JOINED`, :data:`QUIET`, :data:`OTHER_GROUP`, :data:`RAISES`,
    or :data:`OWN_PATH` (torchmetrics' own path over the default group, assumed to issue collectives)."""
    return _KINDS.get(code, OWN_PATH)


def describe(code: int) -> str:
    """The form as errors name it."""
    return _FORMS[code][1] if code in _FORMS else f"form {code}"


def inside(module: Any) -> Iterator[Any]:
    """Every module inside ``module``, depth first, each once (``Module.modules()`` hashes a Metric by its states)."""
    seen = {id(module)}
    stack = list(internals.children(module).values())
    while stack:
        each = stack.pop()
        if each is not None and id(each) not in seen:
            seen.add(id(each))
            yield each
            stack.extend(internals.children(each).values())


@functools.cache
def _torch_and_torchmetrics() -> tuple[Any, Any, Any, Any]:  # imported on first use, once
    import torch
    import torch.distributed as dist
    import torchmetrics.utilities.distributed as tm_distributed
    from torchmetrics import Metric

    return dist, Metric, tm_distributed, torch.nn.Module


def form(metric: Any, on_step: bool, duplicate: bool, hooked: bool) -> int:
    """:data:`JOINS` where ``metric`` joins the exchange of ``compute()`` (``on_step``: of a step's ``forward``),
    else why not, in the order of torchmetrics' own tests; ``hooked``: global module hooks are registered."""
    dist, Metric, tm_distributed, _ = _torch_and_torchmetrics()  # noqa: N806 (the class)

    if not isinstance(metric, Metric):
        return NOT_A_METRIC
    if internals.children(metric) and any(isinstance(inner, Metric) for inner in inside(metric)):
        return HOLDS_METRICS  # wrappers, CompositionalMetric: the Metrics inside sync themselves, in their order
    if internals.own_sync_dist(type(metric), Metric):
        return OWN_SYNC_DIST
    if internals.overrides(metric, Metric):
        return OVERRIDES
    # torchmetrics' own tests, in its order: forward raises on a synced metric first; compute() checks _to_sync
    if on_step:
        if internals.flag(metric, "is_synced"):
            return SYNCED
        if not metric.dist_sync_on_step:
            return NO_STEP_SYNC
    elif not internals.flag(metric, "to_sync"):
        return NO_SYNC
    elif internals.flag(metric, "is_synced"):
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
    if internals.hooked(metric):
        return MODULE_HOOKS
    if hooked:
        return GLOBAL_HOOKS
    return JOINS


def detail(metric: Any) -> int:
    """A digest of how ``metric`` and every Metric inside it sync (classes, sync functions, groups, flags, hooks)."""
    dist, Metric, tm_distributed, Module = _torch_and_torchmetrics()  # noqa: N806 (the classes)
    facts: list[str] = []
    for each in (metric, *inside(metric)) if isinstance(metric, Module) else (metric,):
        if isinstance(each, Metric):
            fn, group = getattr(each, "dist_sync_fn", None), getattr(each, "process_group", None)
            own_fn = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
            sync = "gather" if fn in (None, tm_distributed.gather_all_tensors) else own_fn
            world = "world" if group in (None, dist.group.WORLD) else "own group"
            on_step, to_sync = getattr(each, "dist_sync_on_step", False), internals.flag(each, "to_sync", False)
            flags = (on_step, to_sync, internals.flag(each, "is_synced", False), internals.hooked(each))
            facts.append("|".join([type(each).__qualname__, sync, world, *(str(bool(f)) for f in flags)]))
    return zlib.crc32("/".join(facts).encode())


def forms_of(members: list[tuple[str, Any]], on_step: bool = False) -> list[int]:
    """Each member's :func:`form`; an object held under several keys is a duplicate under each."""
    hooked = internals.global_hooks()
    counts = collections.Counter(id(metric) for _, metric in members)
    return [form(metric, on_step, counts[id(metric)] > 1, hooked) for _, metric in members]


def computes_anew(metric: Any) -> bool:
    """Whether ``compute()`` of ``metric`` computes anew, and so may sync: no cached result where torchmetrics caches
    one; where the class leaves ``compute`` unwrapped (wrappers, ``CompositionalMetric``), a Metric inside does."""
    Metric = _torch_and_torchmetrics()[1]  # noqa: N806 (the class)

    if not isinstance(metric, Metric):
        return True
    if internals.caches_compute(type(metric), Metric):
        return internals.flag(metric, "computed", None) is None
    stack = list(internals.children(metric).values())
    while stack:  # the Metrics right inside it, through plain modules (a ModuleList of copies)
        each = stack.pop()
        if isinstance(each, Metric):
            if computes_anew(each):
                return True
        elif each is not None:
            stack.extend(internals.children(each).values())
    return False
