"""torchmetrics' and torch's private names: the one module of the fused sync that reads or writes them, each with
what it assumes. torchmetrics' mean what the recognised sources make them mean (:mod:`.recognise`), and where that
changed between releases the release comes from recognition too (:func:`release`). docs/design.md ("torchmetrics'
and torch's internals") lists them, with how each is checked.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from packaging.version import Version

from torchmetrics_gradpatch.fused import recognise

# Metric's attributes that forward(), sync(), unsync() and compute() read and set (0.11 to main): plain attributes
# in the instance's __dict__ (Module.__setattr__ stores them there)
_NAMED = ("to_sync", "should_unsync", "is_synced", "computed", "update_count", "forward_cache", "enable_grad")
FLAGS = {name: f"_{name}" for name in _NAMED} | {"compute_on_cpu": "compute_on_cpu"}
#: Metric methods whose lines the fused sync reproduces or whose behaviour it assumes (``__setattr__``: how
#: :func:`put` stores plain attributes): a class replacing one is not taken over (:mod:`.forms`).
METHODS: tuple[str, ...] = ("forward", "_forward_full_state_update", "sync", "unsync", "sync_context", "_wrap_compute")
METHODS += ("_wrap_update", "__call__", "__setattr__")
#: Metric methods that, set on an instance, stand in for its class's (a member holding one is not taken over).
INSTANCE_METHODS = ("forward", "_forward_full_state_update", "_sync_dist", "sync", "unsync", "sync_context", "reset")
#: torch.nn.Module's own hook dictionaries, and the global ones of torch.nn.modules.module (every torch 2.x).
HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
GLOBAL_HOOKS = tuple(f"_global{name}" for name in HOOKS)


def reductions(metric: Any) -> dict[str, Any]:
    """``state -> reduction`` in ``add_state`` order: what ``_sync_dist`` syncs, in its order (none: not a Metric)."""
    return getattr(metric, "_reductions", {})


def defaults(metric: Any) -> dict[str, Any]:
    """``state -> default``: every state, whatever its reduction (none: not a Metric)."""
    return getattr(metric, "_defaults", {})


def children(module: Any) -> dict[str, Any]:
    """A module's direct children (a collection's members, by key)."""
    return module._modules  # type: ignore[no-any-return]


def flag(metric: Any, name: str, *default: Any) -> Any:
    """A flag of :data:`FLAGS`, by its name there (``default`` where the instance lacks it)."""
    return getattr(metric, FLAGS[name], *default)


def own_sync_dist(cls: Any, base: Any) -> bool:
    """Whether ``cls`` replaces ``base``'s ``_sync_dist`` (it may post-process there: MeanAveragePrecision does)."""
    return cls._sync_dist is not base._sync_dist


def caches_compute(cls: Any, base: Any) -> bool:
    """Whether ``cls`` keeps ``base``'s ``_wrap_compute``: its ``compute()`` caches a result and syncs."""
    return cls._wrap_compute is base._wrap_compute


def overrides(metric: Any, base: type) -> bool:
    """Whether ``metric``'s class replaces one of ``base``'s :data:`METHODS` (compared by identity), or the instance
    holds one of :data:`INSTANCE_METHODS`."""
    cls = type(metric)
    replaced = any(getattr(cls, name) is not getattr(base, name) for name in METHODS)
    return replaced or any(map(metric.__dict__.__contains__, INSTANCE_METHODS))


def held_in(attributes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's buffers and (a Metric's) ``state -> default``, from its ``__dict__`` or a copy of it."""
    return attributes.get("_buffers", {}), attributes.get("_defaults", {})


def put(module: Any, values: dict[str, Any]) -> None:
    """Set plain attributes (states, flags) as ``Module.__setattr__`` stores them, without its checks (a step sets
    hundreds); a name the instance lacks, or a parameter, buffer or module, goes through ``setattr``."""
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
    """``sync()``'s copy of the local states for ``unsync()`` (``unsync()`` and ``reset()`` clear it)."""
    cache = getattr(metric, "_cache", None)
    return cache if isinstance(cache, dict) else None


def copies_states() -> bool:
    """Whether ``sync()`` and ``forward()`` keep copies of the states (1.4 on), not the state objects."""
    return release() >= _V1_4


def copy_state_dict(metric: Any) -> dict[str, Any]:
    """What ``sync()`` and ``forward()`` keep of the states (the class's ``_copy_state_dict``, or the states)."""
    if copies_states():
        return type(metric)._copy_state_dict(metric)  # type: ignore[no-any-return]
    return {attr: getattr(metric, attr) for attr in metric._defaults}


def placeholder_rule(metric: Any) -> bool:
    """Whether ``_sync_dist`` puts ``tensor([])`` in for an empty ``cat`` list: from 1.4 on, where torch >= 2.1."""
    made = release()
    if made < _V1_4:
        return False
    if made < _V1_4_1:  # 1.4.0 reads the module's _TORCH_GREATER_EQUAL_2_1, later ones the instance's
        return bool(sys.modules["torchmetrics.metric"]._TORCH_GREATER_EQUAL_2_1)
    return bool(metric._TORCH_GREATER_EQUAL_2_1)


def filter_kwargs(metric: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments a collection's ``forward`` passes to the member."""
    return metric._filter_kwargs(**kwargs)  # type: ignore[no-any-return]


def move_list_states_to_cpu(metric: Any) -> None:
    """What ``forward()`` does last where ``compute_on_cpu`` is set."""
    metric._move_list_states_to_cpu()


def stand_in(metric: Any, name: str, method: Any) -> None:
    """Put ``method`` on the instance over the class's ``name`` until :func:`stand_down`: ``sync()``, ``forward()``
    and ``Module.__call__`` look ``_sync_dist``, ``_copy_state_dict`` and ``forward`` up there."""
    metric.__dict__[name] = method


def stand_down(metric: Any, name: str) -> None:
    del metric.__dict__[name]


def set_state_is_copy(collection: Any, value: bool) -> None:
    """While set, ``MetricCollection.compute()`` does not link compute groups' states again."""
    collection._state_is_copy = value


def hooked(module: Any) -> bool:
    """Whether ``module`` has hooks of its own."""
    return any(getattr(module, name, None) for name in HOOKS)


def global_hooks() -> bool:
    """Whether global module hooks are registered (``torch.nn.modules.module.register_module_*_hook``)."""
    import torch.nn.modules.module as module

    return any(getattr(module, name, None) for name in GLOBAL_HOOKS)


def sequence_nr(node: Any, default: int) -> int:
    """An autograd node's sequence number (torch 2.1 on; ``default`` where torch 2.0's nodes lack it)."""
    numbered = getattr(node, "_sequence_nr", None)
    return default if numbered is None else int(numbered())


def copy_all(into: list[Any], values: list[Any]) -> None:
    """``into[i].copy_(values[i])`` for every ``i``: one ``_foreach_copy_`` (torch 2.1 on), else a loop."""
    copy = _foreach_copy()
    if copy is not None and into:
        copy(into, values)
    else:
        for view, value in zip(into, values, strict=True):
            view.copy_(value)


@functools.cache
def _foreach_copy() -> Any:
    import torch

    return getattr(torch, "_foreach_copy_", None)


_V1_4, _V1_4_1 = Version("1.4"), Version("1.4.1")


def release() -> Version:
    """The first torchmetrics release whose ``torchmetrics.metric`` source is the live one's (``main``: newer than
    every release). Raises ``LookupError`` where it is not recognised."""
    return _release_of(sys.modules.get("torchmetrics.metric"))


@functools.lru_cache(maxsize=1)
def _release_of(module: object) -> Version:  # keyed by the live module: read once per module (asked at every sync)
    releases = recognise.release_of("torchmetrics.metric")
    if not releases:
        raise LookupError("torchmetrics.metric is not recognised")
    first = releases.split(",")[0].split("-")[0].strip()
    return Version("999") if first == "main" else Version(first)


forget = _release_of.cache_clear  # forget the release read (``fused.reset``)
