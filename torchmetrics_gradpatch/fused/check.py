"""Check mode: every fused sync and step also runs torchmetrics' own sync on the same states, and compares.

While check mode is on (``patch(check=True)``, ``patched(check=True)``, ``TORCHMETRICS_GRADPATCH_CHECK=1``), each
run of the fused sync (:func:`run`) is followed by torchmetrics' own path on what the fused run started from:

1. every Metric's attributes (its ``__dict__``, every tensor and list in it copied, objects that Metrics share
   shared in the copy, graphs kept) and the random state (torch's, CUDA's where initialised, Python's and NumPy's
   where imported) are taken before the fused run;
2. the fused run's result and attributes are kept, the ones taken before put back, and torchmetrics' own path
   runs (every Metric syncing with torchmetrics' own ``_sync_dist`` and this package's gather);
3. the two are compared bit for bit (the result, every state, ``_update_count``, ``_forward_cache``,
   ``_computed`` and the sync flags), the fused run's result, attributes and random state are put back, and the
   ranks exchange what they found (one collective; a second where some rank found a difference): every rank
   raises the same :class:`~torchmetrics_gradpatch.FusedSyncError`, naming the rank, the Metric, the state and
   the first difference, or every rank returns the fused result.

Before step 2 the ranks learn whether the fused run raised on any of them (one collective): where it did, no rank
runs torchmetrics' path (the rank that raised would not join its collectives) and every rank goes on as the fused
sync alone leaves it, the error raised where it was raised. Gradients are not compared: backward runs after the
sync returns.

Costs: torchmetrics' own sync beside the fused one, a copy of every state, two collectives, and module hooks run
twice in a step.
Every rank must run with the same check setting (a rank that checks issues collectives its peers do not).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchmetrics_gradpatch._errors import FusedSyncError

__all__ = ["difference", "run"]

T = TypeVar("T")
_FLAGS = ("_update_count", "_forward_cache", "_computed", "_is_synced", "_should_unsync", "_to_sync", "_cache")


def _rng() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call,unused-ignore]
    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), cuda, random.getstate(), numpy.random.get_state() if numpy is not None else None


def _set_rng(state: tuple[Any, ...]) -> None:
    cpu, cuda, python, numpy = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    if numpy is not None:
        sys.modules["numpy"].random.set_state(numpy)


def _metrics(root: Any) -> list[tuple[str, Any]]:
    """Every Metric in ``root`` (a Metric or a collection, ``root`` too), each once, by its path."""
    from torchmetrics import Metric

    found, seen, stack = [], set(), [(type(root).__name__, root)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, Metric):
            found.append((path, module))
        stack.extend((name if module is root else f"{path}.{name}", m) for name, m in module._modules.items() if m)
    return found


def _clone(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` with every tensor and list copied; an object met before is the same copy (so aliasing stays)."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        copy: Any = value.clone()  # a state with a graph keeps it: the reference syncs what the fused sync synced
    elif isinstance(value, list):
        copy = []
        memo[id(value)] = copy
        copy.extend(_clone(v, memo) for v in value)
        return copy
    else:
        return value
    memo[id(value)] = copy
    return copy


@dataclass
class _Taken:
    """Every Metric's attributes (its ``__dict__``): as they are (the fused run's, put back as they are) or with
    every tensor and list copied (what both runs start from; objects that Metrics share are shared in the copy)."""

    metrics: list[tuple[str, Any, dict[str, Any]]]

    @classmethod
    def of(cls, root: Any, clone: bool) -> _Taken:
        memo: dict[int, Any] = {}
        taken = []
        for path, metric in _metrics(root):
            attributes = dict(vars(metric))
            if clone:
                attributes = {name: _clone(value, memo) for name, value in attributes.items()}
            taken.append((path, metric, attributes))
        return cls(taken)

    def put(self) -> None:
        for _, metric, attributes in self.metrics:
            vars(metric).clear()
            vars(metric).update(attributes)

    def compared(self) -> dict[str, dict[str, Any]]:
        """What is compared: every Metric's states, and the flags torchmetrics' paths set."""
        return {
            path: {name: attributes.get(name) for name in (*attributes.get("_defaults", {}), *_FLAGS)}
            for path, _, attributes in self.metrics
        }


def difference(a: Any, b: Any) -> str | None:
    """How ``a`` (the fused run's) first differs from ``b`` (torchmetrics'), bit for bit; ``None`` when alike."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
            return f"{a.dtype} {list(a.shape)} where torchmetrics' is {b.dtype} {list(b.shape)}"
        if a.requires_grad != b.requires_grad:
            return f"requires_grad={a.requires_grad} where torchmetrics' is {b.requires_grad}"
        x, y = a.detach().contiguous(), b.detach().contiguous()
        if x.numel() == 0:
            return None
        bytes_x, bytes_y = x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
        if torch.equal(bytes_x, bytes_y):
            return None
        at = int((bytes_x != bytes_y).nonzero()[0]) // x.element_size()
        index: list[int] = []
        rest = at
        for size in reversed(x.shape):
            index.insert(0, rest % size)
            rest //= size
        mine, theirs = x.reshape(-1)[at].item(), y.reshape(-1)[at].item()
        return f"at index {index}: {mine!r} where torchmetrics' is {theirs!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"keys {sorted(map(str, a))} where torchmetrics' are {sorted(map(str, b))}"
        for key in a:
            found = difference(a[key], b[key])
            if found is not None:
                return f"[{key!r}] {found}"
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return f"{len(a)} elements where torchmetrics' has {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = difference(x, y)
            if found is not None:
                return f"[{i}] {found}"
        return None
    if type(a) is not type(b):
        return f"a {type(a).__name__} where torchmetrics' is a {type(b).__name__}"
    try:
        return None if bool(a == b) else f"{a!r} where torchmetrics' is {b!r}"
    except Exception:  # what cannot be compared is not judged
        return None


def _first(what: str, fused: tuple[Any, _Taken], reference: tuple[Any, _Taken]) -> str | None:
    found = difference(fused[0], reference[0])
    if found is not None:
        return f"{what}'s result: {found}"
    mine = fused[1].compared()
    for path, states in reference[1].compared().items():
        for name, value in states.items():
            if name == "_cache":
                continue  # holds the local states as each path copied them; unsync() puts back equal states
            found = difference(mine.get(path, {}).get(name), value)
            if found is not None:
                return f"{path!r}, {'state' if not name.startswith('_') else 'attribute'} {name!r}: {found}"
    return None


def _device(group: Any) -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None


def _anywhere(mine: bool, group: Any) -> bool:
    """Whether ``mine`` holds on some rank of ``group`` (one collective, on every rank)."""
    found = torch.tensor([int(mine)], device=_device(group))
    every = [torch.empty_like(found) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, found, group)
    return any(int(f) for f in every)


def _agree(text: str | None, what: str, group: Any) -> None:
    """Every rank learns every rank's finding (one collective, two where one differs) and raises alike."""
    from torchmetrics_gradpatch.fused.sync import gather_texts

    if not _anywhere(text is not None, group):
        return
    texts = gather_texts(text or "", group, dist.get_world_size(group), _device(group))
    differing = [(r, t) for r, t in enumerate(texts) if t]
    rank, first = differing[0]
    raise FusedSyncError(
        f"torchmetrics_gradpatch: check mode: the fused sync of {what} differs from torchmetrics' own sync on "
        f"rank(s) {[r for r, _ in differing]}; on rank {rank}, {first}. Every rank raised this error after the "
        "same exchange; the states hold the fused sync's result. Sync with torchmetrics' own path "
        "(sync='torchmetrics') for this workload, and report the difference."
    )


def run(what: str, root: Any, fused: Callable[[], T], reference: Callable[[], Any], group: Any = None) -> T:
    """``fused()``, checked against ``reference()`` run from the same states and random state (see the module
    docstring); ``root`` is the Metric or collection both change, ``what`` how errors name it. A collective over
    ``group`` (default: the world): every rank of it checks."""
    before, rng = _Taken.of(root, clone=True), _rng()
    try:
        result = fused()
    except Exception:
        # the fused run raised here (a member's compute() that fails on this rank alone, say): no rank runs the
        # reference, whose collectives this rank would not join, and each goes on as the fused sync alone leaves it
        with contextlib.suppress(Exception):  # a group that cannot carry this any more: the first error tells why
            _anywhere(True, group)
        raise
    if _anywhere(False, group):
        return result
    after, rng_after = _Taken.of(root, clone=False), _rng()
    try:
        before.put()
        _set_rng(rng)
        try:
            expected = reference()
        except Exception as error:  # torchmetrics' own path raises where the fused sync returned
            text: str | None = f"torchmetrics' own path raised {type(error).__name__}: {error}"
        else:
            text = _first(what, (result, after), (expected, _Taken.of(root, clone=False)))
    finally:
        after.put()
        _set_rng(rng_after)
    _agree(text, what, group)
    return result
