"""Check mode: :func:`run` runs the fused path, then torchmetrics' own path from the same start, compares the two
(:func:`difference`) and goes on with the fused run's objects; a difference on any rank raises the same
``FusedSyncError`` on every rank. docs/design.md#members-and-their-forms says how;
docs/fused-sync.md#adopting-it-safely-a-short-run-with-the-check-mode-on what is compared and what it costs.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import os
import random
import struct
import sys
import traceback
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torchmetrics import Metric

from torchmetrics_gradpatch import _gather
from torchmetrics_gradpatch._errors import FusedSyncError, GradModeMismatchError
from torchmetrics_gradpatch.fused import internals
from torchmetrics_gradpatch.fused.exchange import CheckSettingError, gather_texts, uneven_lists

T = TypeVar("T")
#: the flags torchmetrics' paths set, compared (not ``_cache``: the local states as each path copied them)
_FLAGS = [
    internals.FLAGS[n] for n in ("update_count", "forward_cache", "computed", "is_synced", "should_unsync", "to_sync")
]
# what a rank's fused run did: returned; raised in the Metrics' own code (update, compute, hooks); raised in the
# fused exchange itself (what the check is for: torchmetrics' path has no such step); refused (its own error)
_RETURNED, _RAISED, _BROKE, _REFUSED = 0, 1, 2, 3
_EXCHANGE = ("exchange", "wire", "large", "reduced", "transit", "grad")  # the fused exchange's modules
_EXCHANGE_FILES = tuple(f"{os.sep}fused{os.sep}{name}.py" for name in _EXCHANGE)
_Rng = list[tuple[Callable[[Any], Any], Any]]
_Taken = list[tuple[str, torch.nn.Module, dict[str, Any]]]
_Run = tuple[Any, BaseException | None, _Taken]  # a run's result, error and modules' attributes


def _rng() -> _Rng:
    """The random states, each with its setter: torch's, Python's, CUDA's where initialised, NumPy's where imported."""
    states: _Rng = [(torch.set_rng_state, torch.get_rng_state()), (random.setstate, random.getstate())]
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call,unused-ignore]
        states.append((torch.cuda.set_rng_state_all, torch.cuda.get_rng_state_all()))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states.append((numpy.random.set_state, numpy.random.get_state()))
    return states


def _copy(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` with every tensor and mutable container in it copied, modules and other objects kept (a module is
    put back in place by :func:`_put`); an object met before is the same copy (aliasing stays)."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, (torch.nn.Module, str, bytes, int, float, type(None))):
        return value
    if isinstance(value, torch.nn.Parameter):
        made: Any = torch.nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
    elif isinstance(value, torch.Tensor):
        made = value.clone()  # a state with a graph keeps it: the reference syncs what the fused sync synced
    elif isinstance(value, (list, dict, collections.deque)):
        made = copy.copy(value)  # the same type (an OrderedDict, a defaultdict with its factory, a deque's maxlen)
        memo[id(value)] = made
        if isinstance(made, dict):
            for key in made:
                made[key] = _copy(value[key], memo)
        else:
            made.clear()
            made.extend(_copy(v, memo) for v in value)
        return made
    elif isinstance(value, (set, bytearray)):
        made = copy.copy(value)  # elements of a set are hashable: taken as they are
    elif type(value) is tuple:
        made = tuple(_copy(v, memo) for v in value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        made = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(made, f.name, _copy(getattr(value, f.name), memo))
    else:
        return value
    memo[id(value)] = made
    return made


def _take(root: torch.nn.Module) -> _Taken:
    """Each module in ``root``'s tree once, by path (``root``'s: its class name), with its attributes (``__dict__``)."""
    return [(name or type(root).__name__, module, dict(vars(module))) for name, module in root.named_modules()]


def _put(taken: _Taken, rng: _Rng) -> None:
    for _, module, attributes in taken:
        vars(module).clear()
        vars(module).update(attributes)
    for set_state, state in rng:
        set_state(state)


def _compared(taken: _Taken) -> dict[str, dict[str, Any]]:
    """Every module's buffers, every Metric's states and :data:`_FLAGS`, by module path."""
    found: dict[str, dict[str, Any]] = {}
    for path, module, attributes in taken:
        buffers, defaults = internals.held_in(attributes)
        found[path] = {f"buffer {n!r}": v for n, v in buffers.items()}
        if isinstance(module, Metric):
            found[path].update({f"state {n!r}": attributes.get(n) for n in defaults})
            found[path].update({f"attribute {n!r}": attributes.get(n) for n in _FLAGS})
    return found


def _tensors(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """How tensor ``a`` differs from ``b``: dtype, shape, device, ``requires_grad``, then the bytes."""
    if (a.dtype, tuple(a.shape), a.device) != (b.dtype, tuple(b.shape), b.device):
        return f"{a.dtype} {list(a.shape)} on {a.device} where torchmetrics' is {b.dtype} {list(b.shape)} on {b.device}"
    if a.requires_grad != b.requires_grad:
        return f"requires_grad={a.requires_grad} where torchmetrics' is {b.requires_grad}"
    x, y = (t.detach().resolve_conj().resolve_neg() for t in (a, b))  # a byte view refuses conj and neg views
    x, y = ((t if t.layout == torch.strided else t.to_dense()).contiguous() for t in (x, y))
    if x.numel() == 0:
        return None
    bytes_x, bytes_y = x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
    if torch.equal(bytes_x, bytes_y):
        return None
    at = int((bytes_x != bytes_y).nonzero()[0]) // x.element_size()
    index = [at // math.prod(x.shape[d + 1 :]) % x.shape[d] for d in range(x.dim())]
    mine, theirs = x.reshape(-1)[at].item(), y.reshape(-1)[at].item()
    return f"at index {index}: {mine!r} where torchmetrics' is {theirs!r}"


def difference(a: Any, b: Any, unchecked: list[str] | None = None) -> str | None:
    """How ``a`` (the fused run's) first differs from ``b`` (torchmetrics'), bit for bit; ``None`` when alike. A
    value it cannot judge (no attributes, and an ``==`` that raises or compares identity only) is described in
    ``unchecked``; without that list, it counts as a difference."""
    cannot: list[str] = []
    seen: set[tuple[int, int]] = set()  # pairs under comparison: a cycle is not followed twice

    def first(pairs: Iterable[tuple[str, Any, Any]]) -> str | None:
        for at, a, b in pairs:
            if a is b or (id(a), id(b)) in seen:
                continue
            seen.add((id(a), id(b)))
            try:
                found = one(at, a, b)
            finally:
                seen.discard((id(a), id(b)))
            if found is not None:
                return found
        return None

    def one(at: str, a: Any, b: Any) -> str | None:
        where = f"{at} " if at else ""
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            found = _tensors(a, b)
            return None if found is None else where + found
        if type(a) is not type(b):
            return f"{where}a {type(a).__name__} where torchmetrics' is a {type(b).__name__}"
        if isinstance(a, (float, complex)):  # by their bits: NaN equals NaN, -0.0 is not 0.0
            alike = struct.pack("<dd", a.real, a.imag) == struct.pack("<dd", b.real, b.imag)
            return None if alike else f"{where}{a!r} where torchmetrics' is {b!r}"
        if isinstance(a, (bool, int, str, bytes, type, types.FunctionType, types.BuiltinFunctionType, set, frozenset)):
            return None if a == b else f"{where}{a!r} where torchmetrics' is {b!r}"
        if hasattr(a, "tobytes") and hasattr(a, "dtype") and hasattr(a, "shape"):  # a NumPy array or scalar
            alike = (str(a.dtype), a.shape, a.tobytes()) == (str(b.dtype), b.shape, b.tobytes())
            return None if alike else f"{where}{a!r} where torchmetrics' is {b!r}"
        if isinstance(a, dict):
            if a.keys() != b.keys():
                return f"{where}keys {sorted(map(str, a))} where torchmetrics' are {sorted(map(str, b))}"
            return first((f"{at}[{key!r}]", a[key], b[key]) for key in a)
        if isinstance(a, (list, tuple, collections.deque)):
            if len(a) != len(b):
                return f"{where}{len(a)} elements where torchmetrics' has {len(b)}"
            return first((f"{at}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b, strict=True)))
        if dataclasses.is_dataclass(a):
            names = [f.name for f in dataclasses.fields(a)]
        else:
            names = [*getattr(a, "__dict__", {}), *(s for c in type(a).__mro__ for s in getattr(c, "__slots__", ()))]
        if names:  # an object: its attributes, one by one
            unset = object()
            return first((f"{at}.{n}", getattr(a, n, unset), getattr(b, n, unset)) for n in dict.fromkeys(names))
        try:
            alike = bool(a == b)
        except Exception as error:
            why = f"== raised {type(error).__name__}"
        else:
            why = "== compares identity only"
            if alike or getattr(type(a), "__eq__", None) is not object.__eq__:
                return None if alike else f"{where}{a!r} where torchmetrics' is {b!r}"
        cannot.append(f"{at or 'the result'} (a {type(a).__name__}: {why})")
        return None

    found = first([("", a, b)])
    if found is None and cannot:
        if unchecked is None:
            return f"cannot be compared: {cannot[0]}"
        unchecked.extend(cannot)
    return found


def _first(what: str, fused: _Run, reference: _Run, unchecked: list[str]) -> str | None:
    """The first difference between the two runs: their outcomes, results, then every module's compared values."""
    (result, error, after), (expected, expected_error, taken) = fused, reference
    if error is not None or expected_error is not None:
        if type(error) is type(expected_error) and str(error) == str(expected_error):
            return None  # both raised alike: the fused run's error goes up, as torchmetrics' would
        outcomes = ["returned" if e is None else f"raised {type(e).__name__}: {e}" for e in (error, expected_error)]
        return f"{what} {outcomes[0]} where torchmetrics' own path {outcomes[1]}"
    found = difference(result, expected, unchecked)
    if found is not None:
        return f"{what}'s result: {found}"
    mine, theirs = _compared(after), _compared(taken)
    for path in dict.fromkeys([*theirs, *mine]):
        ours, others = mine.get(path, {}), theirs.get(path, {})
        for name in dict.fromkeys([*others, *ours]):
            found = difference(ours.get(name), others.get(name), unchecked)
            if found is not None:
                return f"{path!r}, {name}: {found}"
    return None


def _facts(mine: list[int], group: Any) -> list[list[int]]:
    """Every rank's ``mine`` (as many small integers on every rank): one collective, on the group's device."""
    found = torch.tensor(mine, dtype=torch.int64, device=_gather.staging_device(group))
    return _gather.exchange(found, group, dist.get_world_size(group)).tolist()


def _not_checked(what: str, why: str) -> None:
    text = f"torchmetrics_gradpatch: check mode: the fused sync of {what} was not checked: {why}."
    warnings.warn(f"{text} The fused result is returned.", RuntimeWarning, stacklevel=4)


def run(what: str, root: Any, fused: Callable[[], T], reference: Callable[[], Any], group: Any = None) -> T:
    """``fused()``, checked against ``reference()`` from the same start; ``root``: the Metric or collection both
    change, ``what``: how messages name it. Collective over ``group`` (default: the world): every rank checks."""
    before, rng = _copy(_take(root), {}), _rng()  # the start: its modules kept, their attributes copied
    nested = bool(uneven_lists)  # inside another check's fused run (a member's own sync): that check warns
    uneven: list[tuple[Any, str]] = []
    uneven_lists.append(uneven)
    result: Any = None
    error: Exception | None = None  # torchmetrics' path runs only where no rank refused, waits or raised alone
    try:
        result = fused()
    except CheckSettingError:
        raise  # raised on every rank at the exchange: a peer that does not check issues no check collective
    except Exception as raised:
        error = raised
    finally:
        uneven_lists.pop()
    frames = traceback.walk_tb(error.__traceback__) if error is not None else ()
    in_exchange = any(f.f_code.co_filename.endswith(_EXCHANGE_FILES) for f, _ in frames)
    refused = isinstance(error, (FusedSyncError, GradModeMismatchError))
    kind = _REFUSED if refused else _RETURNED if error is None else _BROKE if in_exchange else _RAISED
    facts = _facts([kind, int(bool(uneven))], group)
    lengths_differ = any(row[1] for row in facts)
    if lengths_differ and not nested:
        paths = {id(module): path for path, module, _ in before}
        named = sorted({f"{paths.get(id(m), type(m).__name__)}.{attr}" for m, attr in uneven}) or ["(on another rank)"]
        _not_checked(
            what,
            f"the ranks hold list state(s) {named} with different numbers of elements, which torchmetrics' own sync "
            "gathers one by one and would wait on forever",
        )
    raised_ranks = [r for r, row in enumerate(facts) if row[0] == _RAISED]
    partly = 0 < len(raised_ranks) < len(facts)
    if partly and not nested:
        _not_checked(
            what,
            f"it raised on rank(s) {raised_ranks} only, where torchmetrics' own path can leave the other ranks waiting",
        )
    if not (any(row[0] == _REFUSED for row in facts) or lengths_differ or partly):  # else: as the fused run left it
        after, rng_after = _take(root), _rng()
        unchecked: list[str] = []
        try:
            _put(before, rng)
            expected, expected_error = None, None
            try:
                expected = reference()
            except Exception as raised:
                expected_error = raised
            theirs = _take(root)
            text = _first(what, (result, error, after), (expected, expected_error, theirs), unchecked)
        finally:
            _put(after, rng_after)
        # every rank learns every rank's finding (one collective, three where one differs) and raises alike
        if any(row[0] for row in _facts([int(text is not None)], group)):
            texts = gather_texts(text or "", group, dist.get_world_size(group), _gather.staging_device(group))
            ranks = [r for r, t in enumerate(texts) if t]
            raise FusedSyncError(
                f"torchmetrics_gradpatch: check mode: the fused sync of {what} differs from torchmetrics' own sync "
                f"on rank(s) {ranks}; on rank {ranks[0]}, {texts[ranks[0]]}. Every rank raised this error after "
                "the same exchange; the states hold the fused sync's result. Sync with torchmetrics' own path "
                "(sync='torchmetrics') for this workload, and report the difference."
            ) from error
        if unchecked:
            more = len(dict.fromkeys(unchecked)) - 1
            _not_checked(what, f"{unchecked[0]}{f' and {more} more value(s)' if more else ''} cannot be compared")
    if error is not None:
        raise error
    return result  # type: ignore[no-any-return]
