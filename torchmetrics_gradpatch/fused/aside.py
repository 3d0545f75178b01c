"""Where the fused sync steps aside: each part of it runs only while every module it depends on is recognised whole
(:mod:`torchmetrics_gradpatch.fused.recognise`).

:data:`PARTS` names the parts and the modules each depends on. :func:`stepping_aside` says whether a part steps aside
now: then torchmetrics' own path runs there, with this package's gather (a torchmetrics release that changed one of
those modules, another tool's replacement or wrapper of anything in them, a rebinding of a name they import, is never
bypassed). The first time something is seen unrecognised (each live object once), one ``RuntimeWarning`` names it
(``torchmetrics.metric.dim_zero_cat is not recognised``) and what steps aside; :func:`aside` is what ``status()``
reports. This is the local decision; the exchange makes every rank follow a rank that steps aside.

Cost while everything is recognised: one look at the live objects per call, by identity
(:func:`recognise.unrecognised`).
"""

from __future__ import annotations

import sys
import warnings

from torchmetrics_gradpatch.fused import recognise

__all__ = ["COMPUTE", "PARTS", "SINGLE", "STEP", "aside", "forget", "stepping_aside"]

SINGLE = "the fused sync of one Metric"
COMPUTE = "MetricCollection.compute's one exchange"
STEP = "MetricCollection.forward's one exchange"

#: What a Metric's sync reads: metric.py, the reductions and ``_flatten`` of utilities/data.py, the gather of
#: utilities/distributed.py, and ``apply_to_collection`` where metric.py finds it (torchmetrics.utilities on 0.11,
#: lightning_utilities on 1.x).
_SINGLE = (
    "torchmetrics.metric",
    "torchmetrics.utilities.data",
    "torchmetrics.utilities.distributed",
    "torchmetrics.utilities",
    "lightning_utilities.core.apply_func",
    "lightning_utilities",
)
#: part -> the modules (of :data:`recognise.MODULES`) whose lines it reproduces or whose behaviour it assumes
PARTS: dict[str, tuple[str, ...]] = {
    SINGLE: _SINGLE,
    COMPUTE: (*_SINGLE, "torchmetrics.collections"),
    STEP: (*_SINGLE, "torchmetrics.collections"),
}

#: name -> the live object last warned of (held, so that a new object never shares an old one's id). A cache.
_warned: dict[str, object] = {}


def _module_of(name: str) -> str:
    """The module of :data:`recognise.MODULES` that ``name`` (a module, or a binding in one) belongs to."""
    return max((module for module in recognise.MODULES if name == module or name.startswith(module + ".")), key=len)


def _live(name: str) -> object:
    """What ``name`` holds now: the module, or the object its namespace (or its class's) binds."""
    module = _module_of(name)
    found: object = sys.modules.get(module)
    for part in name[len(module) + 1 :].split(".") if name != module else ():
        found = vars(found).get(part) if hasattr(found, "__dict__") else None
    return found


def _parts(name: str) -> tuple[str, ...]:
    module = _module_of(name)
    return tuple(part for part, modules in PARTS.items() if module in modules)


def aside() -> dict[str, tuple[str, ...]]:
    """Each thing not recognised now (a module, or a binding as ``module.name``), with the parts that step aside
    for it."""
    return {name: _parts(name) for name in recognise.unrecognised()}


def stepping_aside(part: str) -> bool:
    """Whether ``part`` steps aside now (a module it depends on is not recognised whole); warns once per live
    object seen."""
    missing = [name for name in recognise.unrecognised() if _module_of(name) in PARTS[part]]
    for name in missing:
        live = _live(name)
        if _warned.get(name, _warned) is not live:
            _warned[name] = live
            warnings.warn(
                f"torchmetrics_gradpatch: {name} is not recognised (it is not what the source of a release this "
                "package knows makes of it: a newer torchmetrics, or another tool's replacement, wrapper or "
                f"rebinding); the fused sync steps aside from {', '.join(_parts(name))}: torchmetrics' own path "
                "runs there, with this package's gather. status() lists what it steps aside from.",
                RuntimeWarning,
                stacklevel=4,
            )
    return bool(missing)


def forget() -> None:
    """Forget which unrecognised objects were warned of (``fused.reset``): each is warned of again."""
    _warned.clear()
