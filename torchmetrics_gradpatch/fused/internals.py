"""torchmetrics' and torch's private names: the one module of the fused sync that reads or writes them.

What each assumes is said beside it. torchmetrics' are checked by recognition: the fused sync runs only where
``torchmetrics.metric``, ``torchmetrics.collections`` and what they import are, live, what a known release's source
makes of them (:mod:`.recognise`), so these names mean what those sources make them mean; where that changed between
releases, the release comes from the same recognition (:func:`release`), never from a version number or a probe.
torch's are checked as noted. Listed in docs/design.md ("torchmetrics' and torch's internals").
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from packaging.version import Version

from torchmetrics_gradpatch.fused import recognise

# Metric's attributes that forward(), sync(), unsync() and compute() read and set (metric.py, 0.11 to main):
# the sync flags, compute()'s cached result, sync()'s copy of the local states for unsync(), forward()'s
# bookkeeping. They are plain attributes (Module.__setattr__ stores them in the instance's __dict__).
FLAGS = {
    "to_sync": "_to_sync",
    "should_unsync": "_should_unsync",
    "is_synced": "_is_synced",
    "computed": "_computed",
    "update_count": "_update_count",
    "forward_cache": "_forward_cache",
    "enable_grad": "_enable_grad",
    "compute_on_cpu": "compute_on_cpu",
}
#: Metric methods whose lines the fused sync reproduces or whose behaviour it assumes: a class replacing one is not
#: taken over (:mod:`.forms`).
METHODS = (
    "forward",
    "_forward_full_state_update",
    "sync",
    "unsync",
    "sync_context",
    "_wrap_compute",
    "_wrap_update",
    "__call__",
    "__setattr__",  # plain attributes are stored as Module.__setattr__ stores them (put)
)
#: Metric methods that, set on an instance, stand in for its class's (a member holding one is not taken over).
INSTANCE_METHODS = ("forward", "_forward_full_state_update", "_sync_dist", "sync", "unsync", "sync_context", "reset")
#: torch.nn.Module's own hook dictionaries, and the global ones of torch.nn.modules.module (every torch 2.x).
HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
GLOBAL_HOOKS = tuple(f"_global{name}" for name in HOOKS)


def reductions(metric: Any) -> dict[str, Any]:
    """``state -> reduction`` in ``add_state`` order (``_reductions``): what ``_sync_dist`` syncs, in its order (none
    for another object)."""
    return getattr(metric, "_reductions", {})


def defaults(metric: Any) -> dict[str, Any]:
    """``state -> default`` (``_defaults``): every state, whatever its reduction (none for another module)."""
    return getattr(metric, "_defaults", {})


def children(module: Any) -> dict[str, Any]:
    """A module's direct children (torch's ``Module._modules``; a collection's members, by key)."""
    return module._modules  # type: ignore[no-any-return]


def flag(metric: Any, name: str, *default: Any) -> Any:
    """A flag of :data:`FLAGS`, by its name there (``default`` where the instance lacks it)."""
    return getattr(metric, FLAGS[name], *default)


def replaces(cls: type, base: type, names: tuple[str, ...] = METHODS) -> bool:
    """Whether class ``cls`` replaces one of ``base``'s methods ``names`` (plain functions: compared by identity)."""
    return any(getattr(cls, name) is not getattr(base, name) for name in names)


def own_sync_dist(cls: type, base: type) -> bool:
    """Whether ``cls`` replaces ``base``'s ``_sync_dist`` (it may post-process there: MeanAveragePrecision does)."""
    return replaces(cls, base, ("_sync_dist",))


def caches_compute(cls: type, base: type) -> bool:
    """Whether ``cls`` keeps ``base``'s ``_wrap_compute``: its ``compute()`` caches a result and syncs."""
    return not replaces(cls, base, ("_wrap_compute",))


def stands_in(metric: Any) -> bool:
    """Whether ``metric`` holds one of :data:`INSTANCE_METHODS` on the instance (``__dict__``)."""
    return any(map(metric.__dict__.__contains__, INSTANCE_METHODS))


def buffers_in(attributes: dict[str, Any]) -> dict[str, Any]:
    """A module's buffers from its ``__dict__`` or a copy of it (torch's ``_buffers``, every torch 2.x)."""
    return attributes.get("_buffers", {})  # type: ignore[no-any-return]


def defaults_in(attributes: dict[str, Any]) -> dict[str, Any]:
    """A Metric's ``state -> default`` from its ``__dict__`` or a copy of it (``_defaults``)."""
    return attributes.get("_defaults", {})  # type: ignore[no-any-return]


def put(module: Any, values: dict[str, Any]) -> None:
    """Set plain attributes (states, flags) as ``Module.__setattr__`` stores them, without its checks (a step sets
    hundreds); a name the instance does not hold yet, or a parameter, buffer or module, goes through ``setattr``."""
    attributes = module.__dict__
    for name, value in values.items():
        if name in attributes and type(value) in _plain():
            attributes[name] = value
        else:
            setattr(module, name, value)


def set_flags(metric: Any, **flags: Any) -> None:
    """Set flags of :data:`FLAGS`, by their names there (:func:`put`)."""
    put(metric, {FLAGS[name]: value for name, value in flags.items()})


@functools.cache
def _plain() -> frozenset[type]:
    import torch

    return frozenset((torch.Tensor, bool, int, float, str, type(None), list, dict, tuple))


def sync_cache(metric: Any) -> dict[str, Any] | None:
    """``sync()``'s copy of the local states for ``unsync()`` (``_cache``; ``unsync()`` and ``reset()`` clear it)."""
    cache = getattr(metric, "_cache", None)
    return cache if isinstance(cache, dict) else None


def copies_states() -> bool:
    """Whether ``sync()`` and ``forward()`` keep copies of the states (``_copy_state_dict``, 1.4 on), not the state
    objects themselves."""
    return release() >= Version("1.4")


def copy_state_dict(metric: Any) -> dict[str, Any]:
    """What ``sync()`` and ``forward()`` keep of the states (the class's ``_copy_state_dict``, or the states)."""
    if copies_states():
        return type(metric)._copy_state_dict(metric)  # type: ignore[no-any-return]
    return {attr: getattr(metric, attr) for attr in metric._defaults}


def placeholder_rule(metric: Any) -> bool:
    """Whether ``_sync_dist`` puts ``tensor([])`` in for an empty ``cat`` list: from 1.4 on, where torch >= 2.1
    (1.4.0 reads the module's ``_TORCH_GREATER_EQUAL_2_1``, 1.4.1 on the instance's)."""
    made = release()
    if made < Version("1.4"):
        return False
    if made < Version("1.4.1"):
        return bool(sys.modules["torchmetrics.metric"]._TORCH_GREATER_EQUAL_2_1)
    return bool(metric._TORCH_GREATER_EQUAL_2_1)


def filter_kwargs(metric: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments a collection's ``forward`` passes to the member (``_filter_kwargs``)."""
    return metric._filter_kwargs(**kwargs)  # type: ignore[no-any-return]


def move_list_states_to_cpu(metric: Any) -> None:
    """What ``forward()`` does last where ``compute_on_cpu`` is set."""
    metric._move_list_states_to_cpu()


def stand_in(metric: Any, name: str, method: Any) -> None:
    """Put ``method`` on the instance over the class's ``name`` (``_sync_dist``, ``_copy_state_dict``, ``forward``)
    until :func:`stand_down`: what ``sync()``, ``forward()`` and ``Module.__call__`` look up on the instance."""
    metric.__dict__[name] = method


def stand_down(metric: Any, name: str) -> None:
    del metric.__dict__[name]


def set_state_is_copy(collection: Any, value: bool) -> None:
    """``MetricCollection._state_is_copy``: while set, ``compute()`` does not link compute groups' states again."""
    collection._state_is_copy = value


def hooks_of(module: Any) -> tuple[Any, ...]:
    return tuple(getattr(module, name, None) for name in HOOKS)


def global_hooks() -> bool:
    """Whether global module hooks are registered (``torch.nn.modules.module.register_module_*_hook``)."""
    import torch.nn.modules.module as module

    return any(getattr(module, name, None) for name in GLOBAL_HOOKS)


def sequence_nr(node: Any) -> int | None:
    """An autograd node's sequence number (``_sequence_nr()``, torch 2.1 on; ``None`` where torch 2.0's C++ nodes
    lack it: callers then assume the worst)."""
    numbered = getattr(node, "_sequence_nr", None)
    return None if numbered is None else int(numbered())


def copy_all(into: list[Any], values: list[Any]) -> None:
    """``into[i].copy_(values[i])`` for every ``i``: one call of torch's ``_foreach_copy_`` (2.1 on), else a loop."""
    import torch

    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None and into:
        copy(into, values)
    else:
        for view, value in zip(into, values, strict=True):
            view.copy_(value)


def release() -> Version:
    """The first torchmetrics release whose ``torchmetrics.metric`` source is the live one's (``main``: newer than
    every release). Raises ``LookupError`` where it is not recognised (the fused sync steps aside there)."""
    return _first(recognise.release_of("torchmetrics.metric"))


@functools.lru_cache(maxsize=16)
def _first(releases: str) -> Version:
    if not releases:
        raise LookupError("torchmetrics.metric is not recognised")
    first = releases.split(",")[0].split("-")[0].strip()
    return Version("999") if first == "main" else Version(first)
