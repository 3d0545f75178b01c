"""The fused sync steps aside from torchmetrics code it does not recognise, on real gloo ranks.

For every torchmetrics function the fused sync re-implements or relies on, a changed one is simulated: the
function recompiled from its own source with one more line (which records each call), installed where torchmetrics
defines it, under the package's replacements as a new release would be. Then a collection's training steps, its
``compute()`` and a Metric's own sync run under the fused sync and under torchmetrics' own: the values and
gradients are the same bit for bit, the changed function runs as often under both (torchmetrics' own path ran
where it depends on it), one ``RuntimeWarning`` names it, and ``status()`` says what stepped aside.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
import textwrap
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from torchmetrics import MeanSquaredError, MetricCollection

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from tests.test_fused import same
from tests.test_fused_forms import batch, comparable
from tests.test_fused_step import Rows, alike
from torchmetrics_gradpatch.fused import aside, recognise


def _changed(key: str, calls: list[str], where: str) -> Any:
    """``key``'s live function recompiled from its own source with a first line that appends ``key`` to ``calls``
    (its source written to ``where``, so it has one; decorators applied again)."""
    target = recognise.TARGETS[key]
    owner = sys.modules[target.module]
    live = vars(getattr(owner, target.owner) if target.owner else owner)[target.name]
    function = inspect.unwrap(live)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    node.decorator_list = []
    node.body.insert(0, ast.parse(f"_tmgp_calls.append({key!r})").body[0])
    if "__class__" in function.__code__.co_freevars:  # super() needs the class cell: compile inside a class body
        tree = ast.Module(body=[ast.ClassDef("_C", [], [], [node], [])], type_ignores=[])
    source = ast.unparse(ast.fix_missing_locations(tree))
    with open(where, "w", encoding="utf-8") as out:
        out.write(source)
    namespace = {**function.__globals__, "_tmgp_calls": calls}
    exec(compile(source, where, "exec"), namespace)
    made = namespace[target.name] if "_C" not in namespace else vars(namespace["_C"])[target.name]
    code = made.__code__
    changed = types.FunctionType(code, namespace, function.__name__, function.__defaults__, function.__closure__)
    changed.__kwdefaults__ = function.__kwdefaults__
    changed.__qualname__ = function.__qualname__
    return contextlib.contextmanager(changed) if live is not function else changed


@contextlib.contextmanager
def installed(key: str, calls: list[str], where: str) -> Iterator[None]:
    """``key``'s changed function in place of torchmetrics' own, the package's replacements wrapping it."""
    target = recognise.TARGETS[key]
    owner = sys.modules[target.module]
    holder = getattr(owner, target.owner) if target.owner else owner
    tg.unpatch()  # the originals in place, so the replacements wrap the changed function when they come back
    original = vars(holder)[target.name]
    setattr(holder, target.name, _changed(key, calls, where))
    try:
        yield
    finally:
        tg.unpatch()
        setattr(holder, target.name, original)


#: what the workload calls (torchmetrics' metric module holds its own dim_zero_cat; no state is held on the CPU)
CALLED = [key for key in recognise.KEYS if key not in ("dim_zero_cat", "Metric._move_list_states_to_cpu")]


def workload(rank: int, sync: str, mode: str) -> list[Any]:
    """Two training steps of a collection and its compute(), then a Metric's forward and compute() on its own."""
    record: list[Any] = []
    metrics = MetricCollection(
        {"mse": MeanSquaredError(dist_sync_on_step=True), "rows": Rows(dist_sync_on_step=True)}, compute_groups=False
    )
    alone = Rows(dist_sync_on_step=True)
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
    return record


def _steps_aside(rank: int, world_size: int, key: str, where: str) -> None:
    if recognise.digest_of(key) == recognise.ABSENT:
        pytest.skip(f"{key} does not exist in torchmetrics here")
    modes = ("local", "global") if key in ("Metric._sync_dist", "Metric.forward") else ("local",)
    for mode in modes:
        runs = {}
        for sync in ("torchmetrics", "fused"):
            calls: list[str] = []
            with installed(key, calls, f"{where}.{sync}.{rank}.py"), warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                runs[sync] = (workload(rank, sync, mode), len(calls), [str(w.message) for w in seen])
                status = tg.status()
        (expected, ran, _), (got, ran_fused, warned) = runs["torchmetrics"], runs["fused"]
        for k, (a, b) in enumerate(zip(got, expected, strict=True)):
            if isinstance(b, tuple):
                assert alike(a[0], b[0]) and same(a[1], b[1]), (key, mode, k, a, b)
            else:
                assert alike(a, b), (key, mode, k, a, b)
        # torchmetrics' own path ran wherever it depends on the function
        assert ran_fused == ran and (ran > 0 or key not in CALLED), (key, mode, ran_fused, ran)
        qualified = f"{recognise.TARGETS[key].module}.{key}"
        mentions = [text for text in warned if qualified in text and "steps aside" in text]
        assert len(mentions) == 1, (key, warned)
        parts = tuple(part for part, keys in aside.PARTS.items() if key in keys)
        assert status.stepped_aside == {qualified: parts}, status.stepped_aside
        assert f"steps aside:      {qualified} is not recognised" in str(status)
    assert tg.status().stepped_aside == {}


@pytest.mark.parametrize("key", recognise.KEYS)
def test_a_changed_function_makes_the_fused_sync_step_aside(key: str, tmp_path: Any) -> None:
    run_ranks(_steps_aside, 2, key, str(tmp_path / "changed"), timeout=120)


def test_every_part_relies_on_what_it_re_implements() -> None:
    assert set(aside.PARTS[aside.SINGLE]) < set(aside.PARTS[aside.COMPUTE]) < set(aside.PARTS[aside.STEP])
    assert set(aside.PARTS[aside.STEP]) == set(recognise.KEYS)


def test_everything_recognised_steps_aside_from_nothing() -> None:
    assert "torchmetrics.metric" in sys.modules  # the look is at torchmetrics' live functions
    assert tg.status().stepped_aside == {} and not any(aside.stepping_aside(part) for part in aside.PARTS)
