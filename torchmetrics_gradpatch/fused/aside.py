"""Where the fused sync steps aside: each part of it runs only while every torchmetrics function whose lines it
re-implements or relies on is recognised by its content (:mod:`torchmetrics_gradpatch.fused.recognise`).

:data:`PARTS` names the parts and their functions. :func:`stepping_aside` says whether a part steps aside now: then
torchmetrics' own path runs there, with this package's gather (a torchmetrics release that changed one of those
functions, or another tool's replacement of one, is never bypassed). The first time a function is seen
unrecognised (each live object once), one ``RuntimeWarning`` names it and what steps aside; :func:`aside` is what
``status()`` reports. Every rank must run the same torchmetrics (each decides alone, from its own functions).

Cost while everything is recognised: one look at the live objects per call (:func:`recognise.unrecognised`).
"""

from __future__ import annotations

import operator
import sys
import warnings
from typing import Any

from torchmetrics_gradpatch.fused import recognise

__all__ = ["COMPUTE", "PARTS", "SINGLE", "STEP", "aside", "stepping_aside"]

SINGLE = "the fused sync of one Metric"
COMPUTE = "MetricCollection.compute's one exchange"
STEP = "MetricCollection.forward's one exchange"

_SINGLE = ("Metric._sync_dist", "Metric.sync", "Metric.unsync", "Metric._copy_state_dict", "dim_zero_cat")
_COMPUTE = (
    *_SINGLE,
    "Metric._wrap_compute",
    "Metric.sync_context",
    "MetricCollection.compute",
    "MetricCollection._compute_and_reduce",
    "MetricCollection.items",
    "MetricCollection._compute_groups_create_state_ref",
)
_STEP = (
    *_COMPUTE,
    "Metric.forward",
    "Metric._forward_full_state_update",
    "Metric.reset",
    "Metric._move_list_states_to_cpu",
    "Metric._filter_kwargs",
    "MetricCollection.forward",
)
#: part -> the functions (keys of :data:`recognise.TARGETS`) whose lines it re-implements or relies on
PARTS: dict[str, tuple[str, ...]] = {SINGLE: _SINGLE, COMPUTE: _COMPUTE, STEP: _STEP}

#: key -> the live object last warned of (held, so that a new object never shares an old one's id)
_warned: dict[str, object] = {}


def _qualified(key: str) -> str:
    target = recognise.TARGETS[key]
    return f"{target.module}.{key}"


#: where each key's function lives (its class's or module's namespace, by key order), once torchmetrics is imported
_places: list[tuple[Any, str]] = []
#: the live objects and code of the last look, and what was not recognised then
_last: list[Any] = [None, ()]


def _unrecognised() -> tuple[str, ...]:
    """:func:`recognise.unrecognised` of every key, looked up again only when a live object or its code changed
    since the last call (a few dict reads: a sync asks at every call)."""
    if not _places:
        for key in recognise.KEYS:
            target = recognise.TARGETS[key]
            module = sys.modules.get(target.module)
            holder = getattr(module, target.owner, None) if target.owner else module
            if holder is None:
                return tuple(recognise.unrecognised())  # not imported yet: nothing to keep
            _places.append((vars(holder), target.name))
    live = [namespace.get(name) for namespace, name in _places]
    live += [getattr(obj, "__code__", None) for obj in live]
    last = _last[0]
    if last is None or not all(map(operator.is_, live, last)):  # the same objects: nothing to look up
        _last[:] = [live, tuple(recognise.unrecognised())]
    return _last[1]  # type: ignore[no-any-return]


def aside() -> dict[str, tuple[str, ...]]:
    """Each function not recognised now (its qualified name), with the parts that step aside for it."""
    missing = _unrecognised()
    return {_qualified(key): tuple(part for part, keys in PARTS.items() if key in keys) for key in missing}


def stepping_aside(part: str) -> bool:
    """Whether ``part`` steps aside now (one of its functions is not recognised); warns once per function seen."""
    missing = [key for key in _unrecognised() if key in PARTS[part]]
    for key in missing:
        live = recognise.snapshot((key,))[0]
        if _warned.get(key, _warned) is not live:
            _warned[key] = live
            parts = ", ".join(name for name, keys in PARTS.items() if key in keys)
            warnings.warn(
                f"torchmetrics_gradpatch: the fused sync does not recognise {_qualified(key)} (its lines are not "
                "those of any torchmetrics release this package knows: a newer torchmetrics, or another tool's "
                f"replacement); it steps aside from {parts}: torchmetrics' own path runs there, with this package's "
                "gather. status() lists what it steps aside from.",
                RuntimeWarning,
                stacklevel=4,
            )
    return bool(missing)
