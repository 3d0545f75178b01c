"""The fused sync steps aside from torchmetrics code it does not recognise whole, on real gloo ranks.

Each case changes what the fused sync relies on the way a tool or a new release would, without a word: a transparent
wrapper bound where ``torchmetrics.metric`` imports ``dim_zero_cat`` (``mock.patch(..., wraps=...)``, before or after
the metrics are made), ``dim_zero_sum`` or ``_flatten`` recompiled with one more line (bound everywhere torchmetrics
binds it, or in ``utilities/data.py`` only), ``Metric._sync_dist`` rebuilt from its own code with another
``_flatten`` bound (under the package's replacements, as a new release would be). Then a collection's training steps,
its ``compute()`` and a Metric's own sync run under the fused sync and under torchmetrics' own: the values and
gradients are the same bit for bit, the changed function runs as often under both (torchmetrics' own path ran where
it depends on it), one ``RuntimeWarning`` names each thing not recognised, ``status()`` says what stepped aside, and
once put back (the original objects, by identity) nothing steps aside.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
import textwrap
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
from torchmetrics import MeanSquaredError, MetricCollection

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from tests.test_fused import same
from tests.test_fused_forms import batch, comparable
from tests.test_fused_step import Rows, alike
from torchmetrics_gradpatch import _syncs
from torchmetrics_gradpatch.fused import recognise

DATA = "torchmetrics.utilities.data"


def _recording(function: Any, calls: list[str], where: str, **bound: Any) -> Any:
    """``function`` recompiled from its own source with a first line that appends its name to ``calls`` (its source
    written to ``where``, so it has one), in a copy of its namespace with ``bound`` bound."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    node.body.insert(0, ast.parse(f"_tmgp_calls.append({function.__name__!r})").body[0])
    source = ast.unparse(ast.fix_missing_locations(tree))
    with open(where, "w", encoding="utf-8") as out:
        out.write(source)
    namespace = {**function.__globals__, **bound, "_tmgp_calls": calls}
    exec(compile(source, where, "exec"), namespace)
    made = namespace[function.__name__]
    changed = types.FunctionType(made.__code__, namespace, function.__name__, function.__defaults__)
    changed.__qualname__ = function.__qualname__
    return changed


@contextlib.contextmanager
def _bound_everywhere(name: str, value: Any, only_data: bool = False) -> Iterator[None]:
    """``value`` in place of ``utilities/data.py``'s ``name`` wherever a recognised module binds that object (in
    ``utilities/data.py`` alone with ``only_data``); the originals put back after, checked by identity."""
    original = vars(sys.modules[DATA])[name]
    modules = [sys.modules[module] for module in recognise.MODULES if module in sys.modules]
    holders = [module for module in modules if vars(module).get(name) is original]
    holders = holders if not only_data else [sys.modules[DATA]]
    for module in holders:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module in holders:
            setattr(module, name, original)
        assert all(vars(module)[name] is original for module in holders)


@contextlib.contextmanager
def _sync_dist_rebuilt(value: Any) -> Iterator[None]:
    """``value`` as ``Metric._sync_dist``, the package's replacements wrapping it (as they would a new release's)."""
    from torchmetrics.metric import Metric

    tg.unpatch()  # the originals in place, so the replacements wrap the changed function when they come back
    original = vars(Metric)["_sync_dist"]
    Metric._sync_dist = value  # type: ignore[method-assign]
    try:
        yield
    finally:
        tg.unpatch()
        Metric._sync_dist = original  # type: ignore[method-assign]
        assert vars(Metric)["_sync_dist"] is original


def _change(case: str, calls: list[str], where: str) -> tuple[Callable[[], Any], tuple[str, ...]]:
    """The context manager that makes ``case``'s change, and what is then not recognised."""
    data = sys.modules[DATA]
    if case.startswith("metric.py's dim_zero_cat wrapped"):
        wrapped = functools.partial(mock.patch, "torchmetrics.metric.dim_zero_cat", wraps=data.dim_zero_cat)
        return wrapped, ("torchmetrics.metric.dim_zero_cat",)
    if case == "dim_zero_sum changed everywhere":
        changed = _recording(data.dim_zero_sum, calls, where)
        return functools.partial(_bound_everywhere, "dim_zero_sum", changed), (f"{DATA}.dim_zero_sum",)
    if case == "dim_zero_max changed in utilities/data.py":
        changed = _recording(data.dim_zero_max, calls, where)
        modules = [name for name in recognise.MODULES if name != DATA and name in sys.modules]
        not_origin = tuple(
            f"{name}.dim_zero_max"
            for name in modules
            if vars(sys.modules[name]).get("dim_zero_max") is data.dim_zero_max
        )
        return functools.partial(_bound_everywhere, "dim_zero_max", changed, True), (
            f"{DATA}.dim_zero_max",
            *not_origin,
        )
    if case == "_flatten changed everywhere":
        changed = _recording(data._flatten, calls, where)
        return functools.partial(_bound_everywhere, "_flatten", changed), (f"{DATA}._flatten",)
    assert case == "_sync_dist rebuilt with another _flatten"
    sync_dist = _syncs.original_sync_dist()
    recording_flatten = _recording(data._flatten, calls, where)
    namespace = {**sync_dist.__globals__, "_flatten": recording_flatten}
    rebuilt = types.FunctionType(sync_dist.__code__, namespace, sync_dist.__name__, sync_dist.__defaults__)
    rebuilt.__qualname__ = sync_dist.__qualname__
    return functools.partial(_sync_dist_rebuilt, rebuilt), ("torchmetrics.metric.Metric._sync_dist",)


CASES = [
    "metric.py's dim_zero_cat wrapped before the metrics are made",
    "metric.py's dim_zero_cat wrapped after the metrics are made",
    "dim_zero_sum changed everywhere",
    "dim_zero_max changed in utilities/data.py",
    "_flatten changed everywhere",
    "_sync_dist rebuilt with another _flatten",
]


def workload(rank: int, sync: str, mode: str, change: Callable[[], Any], before: bool) -> tuple[list[Any], int, Any]:
    """Two training steps of a collection and its compute(), then a Metric's forward and compute() on its own, with
    ``change`` made before the metrics are (``before``) or after; how often the changed function ran (a mock's
    count, else -1), and ``status()`` while changed."""
    record: list[Any] = []
    with contextlib.ExitStack() as stack:
        made = stack.enter_context(change()) if before else None
        metrics = MetricCollection(
            {"mse": MeanSquaredError(dist_sync_on_step=True), "rows": Rows(dist_sync_on_step=True)},
            compute_groups=False,
        )
        alone = Rows(dist_sync_on_step=True)
        if not before:
            made = stack.enter_context(change())
        with tg.patched(sync=sync, mode=mode):
            for k in range(2):
                preds, target = batch(rank, 3, k)
                leaf = preds.clone().requires_grad_()
                values = metrics(leaf, target)
                (values["mse"] + values["rows"]).backward()
                record.append((comparable(values), leaf.grad))
            record.append(comparable(metrics.compute()))
            preds, target = batch(rank, 4, 0)
            leaf = preds.clone().requires_grad_()
            alone(leaf, target).backward()
            record.append((comparable(alone.compute()), leaf.grad))
        return record, (made.call_count if isinstance(made, mock.Mock) else -1), tg.status()


def _steps_aside(rank: int, world_size: int, case: str, where: str) -> None:
    modes = ("local", "global") if case.startswith("_sync_dist") else ("local",)
    before = "after" not in case
    originals = {name: vars(sys.modules[name]).copy() for name in recognise.MODULES if name in sys.modules}
    for mode in modes:
        runs = {}
        for sync in ("torchmetrics", "fused"):
            calls: list[str] = []
            change, expected = _change(case, calls, f"{where}.{sync}.{rank}.py")
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                record, mocked, status = workload(rank, sync, mode, change, before)
            runs[sync] = (record, mocked if mocked >= 0 else len(calls), [str(w.message) for w in seen], status)
        (expected_values, ran, _, _), (got, ran_fused, warned, status) = runs["torchmetrics"], runs["fused"]
        for k, (a, b) in enumerate(zip(got, expected_values, strict=True)):
            if isinstance(b, tuple):
                assert alike(a[0], b[0]) and same(a[1], b[1]), (case, mode, k, a, b)
            else:
                assert alike(a, b), (case, mode, k, a, b)
        # torchmetrics' own path ran wherever it depends on what changed
        assert ran_fused == ran, (case, mode, ran_fused, ran)
        # it runs on torchmetrics' own path but where metric.py still binds the original (max), or the metrics made
        # before the wrapper hold the original as their reduction
        assert ran > 0 or case.startswith("dim_zero_max") or "after" in case, (case, ran)
        for name in expected:
            mentions = [text for text in warned if f"{name} is not recognised" in text and "steps aside" in text]
            assert len(mentions) == 1, (case, name, warned)
        assert status.stepped_aside == {name: tuple(recognise.PARTS) for name in expected}, status.stepped_aside
        assert f"steps aside:      {expected[0]} is not recognised" in str(status)
    # put back: the very objects, and nothing steps aside
    for name, namespace in originals.items():
        live = vars(sys.modules[name])
        assert all(live.get(key) is value for key, value in namespace.items()), name
    assert tg.status().stepped_aside == {}


@pytest.mark.parametrize("case", CASES)
def test_what_is_not_recognised_makes_the_fused_sync_step_aside(case: str, tmp_path: Any) -> None:
    run_ranks(_steps_aside, 2, case, str(tmp_path / "changed"), timeout=180)


def test_every_part_relies_on_the_modules_it_reproduces() -> None:
    assert (
        set(recognise.PARTS[recognise.SINGLE])
        < set(recognise.PARTS[recognise.COMPUTE])
        == set(recognise.PARTS[recognise.STEP])
    )
    assert set(recognise.PARTS[recognise.STEP]) == set(recognise.MODULES)


def test_everything_recognised_steps_aside_from_nothing() -> None:
    assert "torchmetrics.metric" in sys.modules  # the look is at torchmetrics' live modules
    assert tg.status().stepped_aside == {} and not any(recognise.stepping_aside(part) for part in recognise.PARTS)
