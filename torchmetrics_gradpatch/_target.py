"""What the patch targets: torchmetrics' own gather, the paths that reach it, and whether it is one we know.

Contract: it only looks, and raises :class:`UnsupportedVersionError` naming why not. torchmetrics' own function is
the one defined in ``torchmetrics.utilities.distributed``, so another tool's function in the module attribute is
not patched while another path still holds torchmetrics' (docs/design.md).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from torchmetrics_gradpatch._errors import UnsupportedVersionError

TARGET_MODULE = "torchmetrics.utilities.distributed"
TARGET_NAME = "gather_all_tensors"


def _unwrap(obj: Any) -> Any:
    try:
        return inspect.unwrap(obj) if callable(obj) else obj
    except ValueError:  # a __wrapped__ cycle: report the object itself
        return obj


def held_functions(module: types.ModuleType) -> dict[str, Any]:
    """What each path torchmetrics uses to reach its gather holds now, looked through wrappers (docs/design.md)."""
    held = {f"{TARGET_MODULE}.{TARGET_NAME}": _unwrap(getattr(module, TARGET_NAME, None))}
    metric = sys.modules.get("torchmetrics.metric")
    if metric is not None:
        held[f"torchmetrics.metric.{TARGET_NAME}"] = _unwrap(vars(metric).get(TARGET_NAME))
        sync_dist = getattr(getattr(metric, "Metric", None), "_sync_dist", None)
        defaults = getattr(sync_dist, "__defaults__", None) or ()
        if defaults:
            held["torchmetrics.Metric._sync_dist default dist_sync_fn"] = _unwrap(defaults[0])
    return held


def own_function(module: types.ModuleType) -> Any:
    """torchmetrics' own gather: what the module attribute holds, unless that is a Python function defined
    elsewhere (another tool's replacement) and another path still holds the function defined in ``module``.

    Anything else the attribute holds (nothing, a builtin, a function defined in ``module``) is returned as it is,
    for :func:`recognise` to judge.
    """
    held = list(held_functions(module).values())
    first = held[0]
    if isinstance(first, types.FunctionType) and first.__globals__ is not vars(module):
        for function in held[1:]:
            if isinstance(function, types.FunctionType) and function.__globals__ is vars(module):
                return function
    return first


def describe(obj: Any) -> str:
    """A short name for what a path holds: ``module.qualname`` of a function, else its type."""
    name = getattr(obj, "__qualname__", None)
    if isinstance(name, str):
        return f"{getattr(obj, '__module__', None) or '?'}.{name}"
    return f"a {type(obj).__name__} object"


def recognise(module: types.ModuleType, torchmetrics_version: str, *, native: bool = False) -> types.FunctionType:
    """Return torchmetrics' own gather function, or raise :class:`UnsupportedVersionError` naming why not.

    ``native``: the installed torchmetrics keeps the graph itself, so only the global mode needs the function;
    the message then says that local mode still works.
    """
    where = f"torchmetrics {torchmetrics_version} ({TARGET_MODULE}.{TARGET_NAME})"
    if native:
        advice = (
            "torchmetrics_gradpatch cannot install its global mode on this torchmetrics (it knows torchmetrics 0.11 "
            "to 1.9); nothing was patched. The local mode needs no patch here (torchmetrics >= 1.6 keeps the "
            "graph itself) and keeps working: use patch() / patched() without mode='global'."
        )
    else:
        advice = "torchmetrics_gradpatch supports torchmetrics 0.11 to 1.9; nothing was patched."
    function = own_function(module)
    if function is None:
        raise UnsupportedVersionError(f"{where}: the function does not exist. {advice}")
    if not isinstance(function, types.FunctionType):
        raise UnsupportedVersionError(f"{where}: expected a Python function, found {type(function).__name__}. {advice}")
    code = function.__code__
    plain_positional = not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    if not (
        plain_positional
        and (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount) == (2, 0, 0)
        and code.co_varnames[:2] == ("result", "group")
        and function.__defaults__ == (None,)
        and not code.co_freevars
    ):
        raise UnsupportedVersionError(
            f"{where}: unrecognised signature {TARGET_NAME}{inspect.signature(function)}; expected "
            f"{TARGET_NAME}(result, group=None). {advice}"
        )
    return function
