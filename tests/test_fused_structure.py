"""The fused sync when ranks hold differently shaped states: it syncs to what one process would get, or every rank
raises the same error within seconds. torchmetrics' own sync hangs or desyncs in these cases; the bounded
demonstration below runs it on a gloo group with a short timeout.

Every case runs on 2 and 3 pooled ranks; each rank regenerates every rank's data, so it checks its own result
against the one-process answer it computes itself. A randomized test draws Metrics mixing reduced and gathered
states, with and without per-rank differences, and checks each against torchmetrics' own sync or the one error.
"""

from __future__ import annotations

import math
import random
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from tests._rank_tools import EMPTY_CAT_PLACEHOLDER, calls, every_rank
from tests._ranks import run_ranks
from tests._tensors import gloo_dtypes
from tests.test_fused import ORIGINAL_SYNC_DIST, Probe, same, states, values, worlds
from torchmetrics_gradpatch import fused as _fused
from torchmetrics_gradpatch._errors import FusedSyncError, GradModeMismatchError
from torchmetrics_gradpatch.fused import reduced

ERROR_BOUND_S = 5.0
TIMEOUT = 60


def lists_of_lengths(rank: int, lengths: list[int], shape_of: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    return [values(rank, k, shape_of(rank, k), dtype) for k in range(lengths[rank])]


def one_list_state(reduction: Any, rank: int, content: list[torch.Tensor]) -> Probe:
    metric = Probe({"x": ([], reduction)})
    metric.x = content
    return metric


def _lists_of_different_lengths_sync_element_by_element(rank: int, world_size: int) -> None:
    lengths = [1, 3, 2][:world_size]
    shape_of = lambda r, k: (r + 1, k + 1)  # noqa: E731 - every element of its own shape
    everyone = [lists_of_lengths(r, lengths, shape_of, torch.float32) for r in range(world_size)]
    metric = one_list_state(None, rank, everyone[rank])
    before = calls()
    _fused.fused_sync(metric)
    assert calls() - before == 2
    # element 0 of every rank, then element 1 of every rank that has one, ...: torchmetrics' order at equal lengths
    expected = [everyone[r][k] for k in range(max(lengths)) for r in range(world_size) if k < lengths[r]]
    assert same(metric.x, expected)


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_lists_of_different_lengths_sync_element_by_element(world_size: int) -> None:
    run_ranks(_lists_of_different_lengths_sync_element_by_element, world_size, timeout=TIMEOUT)


def _an_empty_cat_list_contributes_nothing(
    rank: int, world_size: int, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    content = {r: [] if r == 1 else [values(r, k, shape, dtype) for k in range(r + 1)] for r in range(world_size)}
    metric = one_list_state("cat", rank, content[rank])
    _fused.fused_sync(metric)
    expected = torch.cat([t for r in range(world_size) for t in content[r]])  # one process, rank order
    assert same(metric.x, expected)
    if EMPTY_CAT_PLACEHOLDER and len(shape) == 1 and dtype == torch.float32:
        # torchmetrics' own sync completes here (its float32 placeholder meets 1-d float32 data): the same bits
        reference = one_list_state("cat", rank, content[rank])
        ORIGINAL_SYNC_DIST(reference, gather_all_tensors)
        assert same(metric.x, reference.x)


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("shape", [(3,), (3, 2)], ids=["1-d", "2-d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_an_empty_cat_list_contributes_nothing(world_size: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    run_ranks(_an_empty_cat_list_contributes_nothing, world_size, shape, dtype, timeout=TIMEOUT)


def _every_rank_empty_is_torchmetrics_own_result(rank: int, world_size: int, reduction: Any) -> None:
    fused, reference = one_list_state(reduction, rank, []), one_list_state(reduction, rank, [])
    ORIGINAL_SYNC_DIST(reference, gather_all_tensors)  # completes on every torchmetrics line
    _fused.fused_sync(fused)
    assert same(fused.x, reference.x)


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("reduction", ["cat", None])
def test_every_rank_empty_is_torchmetrics_own_result(world_size: int, reduction: Any) -> None:
    run_ranks(_every_rank_empty_is_torchmetrics_own_result, world_size, reduction, timeout=TIMEOUT)


def _zero_d_and_one_d_cat_pieces_concatenate(rank: int, world_size: int) -> None:
    # rank 0 holds one 0-d tensor (sent as it is), the others several (concatenated to 1-d first)
    content = {r: [values(r, k, (), torch.float64) for k in range(1 if r == 0 else r + 1)] for r in range(world_size)}
    metric = one_list_state("cat", rank, content[rank])
    _fused.fused_sync(metric)
    assert same(metric.x, torch.stack([t for r in range(world_size) for t in content[r]]))


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_zero_d_and_one_d_cat_pieces_concatenate(world_size: int) -> None:
    run_ranks(_zero_d_and_one_d_cat_pieces_concatenate, world_size, timeout=TIMEOUT)


def _never_updated_rank(rank: int, world_size: int) -> None:
    from torchmetrics.regression import MeanSquaredError, SpearmanCorrCoef

    rank = dist.get_rank()
    data = {r: (values(r, 0, (4,), torch.float32), values(r, 1, (4,), torch.float32)) for r in range(world_size)}
    fused = [MeanSquaredError(), SpearmanCorrCoef()]
    reference = MeanSquaredError()
    for metric in [*fused, reference]:
        if rank != 0:  # rank 0 never updates
            metric.update(*data[rank])
    ORIGINAL_SYNC_DIST(reference, gather_all_tensors)
    for metric in fused:
        _fused.fused_sync(metric)
    for name, value in states(reference).items():  # torchmetrics' own sync completes for MeanSquaredError
        assert same(getattr(fused[0], name), value), name
    preds = torch.cat([data[r][0] for r in range(1, world_size)])
    assert same(fused[1].preds, preds)  # SpearmanCorrCoef's cat list: the updated ranks' samples, in rank order


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_never_updated_rank(world_size: int) -> None:
    run_ranks(_never_updated_rank, world_size, timeout=TIMEOUT)


def _tensor_state(rank: int, bad: int, good: torch.Tensor, odd: torch.Tensor) -> Probe:
    metric = Probe({"x": (torch.zeros(()), "sum"), "y": (torch.zeros(()), "sum")})
    metric.x, metric.y = torch.ones(()), (odd if rank == bad else good)
    return metric


BAD_CASES = {
    "tensor dtype": lambda rank: _tensor_state(rank, 1, torch.ones(3), torch.ones(3, dtype=torch.float64)),
    "tensor ndim": lambda rank: _tensor_state(rank, 0, torch.ones(3), torch.ones(3, 1)),
    "tensor shape": lambda rank: _tensor_state(rank, 1, torch.ones(3), torch.ones(4)),
    "cat dtype": lambda rank: one_list_state("cat", rank, [torch.ones(2, dtype=torch.int32 if rank else torch.int64)]),
    "cat trailing size": lambda rank: one_list_state("cat", rank, [torch.ones(2, 3 + (rank == 1))]),
    "cat ndim": lambda rank: one_list_state("cat", rank, [torch.ones((2, 3) if rank == 0 else (2,))]),
    "not a tensor": lambda rank: one_list_state(None, rank, [torch.ones(1), 2.0] if rank == 1 else [torch.ones(1)]),
    "another metric": lambda rank: Probe({"x": (torch.zeros(()), "sum" if rank == 0 else "max")}),
}


def _the_same_error_on_every_rank_within_seconds(rank: int, world_size: int, case: str) -> None:
    metric = BAD_CASES[case](rank)
    before = states(metric)
    started = time.monotonic()
    try:
        _fused.fused_sync(metric)
        outcome = "synced"
    except FusedSyncError as error:
        outcome = str(error)
    elapsed = time.monotonic() - started
    outcomes = every_rank(outcome)
    assert outcome.startswith("torchmetrics_gradpatch: fused sync of"), outcome
    assert outcomes == [outcome] * world_size  # the same message on every rank
    assert elapsed < ERROR_BOUND_S
    assert all(same(getattr(metric, k), v) or getattr(metric, k) is v for k, v in before.items())  # unchanged
    follow_up = one_list_state("cat", rank, [torch.ones(1)])
    _fused.fused_sync(follow_up)  # the group is in step: the next sync works
    assert same(follow_up.x, torch.ones(world_size))


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_the_same_error_on_every_rank_within_seconds(world_size: int, case: str) -> None:
    run_ranks(_the_same_error_on_every_rank_within_seconds, world_size, case, timeout=TIMEOUT)


def _a_state_one_rank_cannot_prepare(rank: int, world_size: int) -> None:
    # rank 1's cat list does not concatenate: torchmetrics' own sync raises there alone and leaves the others waiting
    widths = [3, 4 if rank == 1 else 3]
    metric = one_list_state("cat", rank, [values(rank, k, (2, width), torch.float32) for k, width in enumerate(widths)])
    before = states(metric)
    started = time.monotonic()
    with pytest.raises(FusedSyncError) as caught:
        _fused.fused_sync(metric)
    elapsed, outcome = time.monotonic() - started, str(caught.value)
    assert every_rank(outcome) == [outcome] * world_size  # the same message on every rank
    assert "rank(s) [1] could not prepare" in outcome and "RuntimeError" in outcome, outcome
    assert isinstance(caught.value.__cause__, RuntimeError) == (rank == 1)  # the failing rank's own error, chained
    assert elapsed < ERROR_BOUND_S
    assert all(same(getattr(metric, k), v) for k, v in before.items())  # unchanged
    follow_up = one_list_state("cat", rank, [torch.ones(1)])
    _fused.fused_sync(follow_up)  # the group is in step: the next sync works
    assert same(follow_up.x, torch.ones(world_size))


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_a_state_one_rank_cannot_prepare_raises_on_every_rank(world_size: int) -> None:
    run_ranks(_a_state_one_rank_cannot_prepare, world_size, timeout=TIMEOUT)


def _global_mode_grad_mode_mismatch_raises_on_every_rank(rank: int, world_size: int) -> None:
    metric = Probe({"x": (torch.zeros(()), "sum")})
    metric.x = torch.ones((), requires_grad=True) * 2
    mismatch = pytest.raises(GradModeMismatchError, match=r"Rank\(s\) \[0\] synced with grad mode off")
    with torch.set_grad_enabled(rank != 0), mismatch:
        _fused.fused_sync(metric, mode="global")
    follow_up = one_list_state("cat", rank, [torch.ones(1)])
    _fused.fused_sync(follow_up)
    assert same(follow_up.x, torch.ones(world_size))


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_global_mode_grad_mode_mismatch_raises_on_every_rank(world_size: int) -> None:
    run_ranks(_global_mode_grad_mode_mismatch_raises_on_every_rank, world_size, timeout=TIMEOUT)


# Only the wait that never ends has to outlast it: the ranks meet in a barrier of the default group (its long
# timeout) before creating the group and again before the sync, so what does complete starts within
# milliseconds on every rank, however loaded the machine (the ranks' start-up is behind them).
HANG_TIMEOUT_S = 1.5


def _torchmetrics_sync_on_short_timeout(metric: Metric) -> str:
    dist.barrier()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=HANG_TIMEOUT_S))
    dist.barrier()
    started = time.monotonic()
    try:
        ORIGINAL_SYNC_DIST(metric, gather_all_tensors, process_group=group)
        return "returned"
    except RuntimeError as error:  # gloo's timeout
        return f"raised after {time.monotonic() - started:.0f} s: {str(error).splitlines()[0][:60]}"


TORCHMETRICS_HANGS = {
    "lists of different lengths": lambda rank: one_list_state(None, rank, [torch.ones(2)] * (rank + 1)),
    # without the placeholder an empty cat list sends nothing; with it torchmetrics' sync completes
    "an empty cat list": lambda rank: one_list_state("cat", rank, [] if rank == 0 else [torch.ones(2)]),
}


def _torchmetrics_own_sync_hangs_where_fused_syncs(rank: int, world_size: int, case: str) -> None:
    fused = TORCHMETRICS_HANGS[case](rank)
    _fused.fused_sync(fused)  # first, while the group is in step
    outcomes = every_rank(_torchmetrics_sync_on_short_timeout(TORCHMETRICS_HANGS[case](rank)))
    # some rank returned while another waited for it until the timeout: a hang without one
    assert "returned" in outcomes and any(o.startswith("raised") for o in outcomes), outcomes
    assert len(fused.x) == (sum(r + 1 for r in range(world_size)) if case.startswith("lists") else 2 * (world_size - 1))


# Fresh ranks: torchmetrics' sync times out inside a gloo group, which leaves that group broken on some ranks.
@pytest.mark.parametrize("world_size", [pytest.param(n, id=f"{n}ranks") for n in (2, 3)])
@pytest.mark.parametrize(
    "case",
    [
        "lists of different lengths",
        pytest.param(
            "an empty cat list",
            marks=pytest.mark.skipif(
                EMPTY_CAT_PLACEHOLDER,
                reason="torchmetrics >= 1.4 on torch >= 2.1 completes it; compared bit for bit above",
            ),
        ),
    ],
)
def test_torchmetrics_own_sync_hangs_where_fused_syncs(world_size: int, case: str) -> None:
    run_ranks(_torchmetrics_own_sync_hangs_where_fused_syncs, world_size, case, timeout=90, fresh=True)


# --- one error, one text ------------------------------------------------------------------------------------------


def _another_class_names_each_rank(rank: int, world_size: int) -> None:
    from torchmetrics.aggregation import MeanMetric, SumMetric

    metric = MeanMetric() if rank == 0 else SumMetric()
    metric.update(torch.ones(2))
    with pytest.raises(FusedSyncError) as caught:
        _fused.fused_sync(metric)
    text = str(caught.value)
    assert every_rank(text) == [text] * world_size  # one rank's log suffices
    for r, held in enumerate((MeanMetric(), SumMetric())):  # state names differ by line (0.11: "value")
        states = ", ".join(f"{name}: sum" for name in held._defaults)
        assert f"rank {r}: {type(held).__name__} ({states})" in text, text


def test_another_class_names_each_rank_in_one_text() -> None:
    run_ranks(_another_class_names_each_rank, 2, timeout=TIMEOUT)


# --- randomized structures: reduced and gathered states, ranks that agree and ranks that do not ---------------------

#: (reduction, dtypes drawn from, tensor or list); "big" tensor states are reduced when every rank proposes alike
KINDS = [
    ("sum", ["int64", "int32", "uint8", "bool"], "tensor"),
    ("max", ["int64", "int32", "int8", "float32", "float64", "float16", "bfloat16"], "tensor"),
    ("min", ["int64", "uint8", "float32", "float64", "bfloat16"], "tensor"),
    ("sum", ["float32", "float64"], "tensor"),  # a floating-point sum: gathered
    ("mean", ["float32"], "tensor"),
    ("cat", ["float32", "int64"], "list"),
    (None, ["float64", "int32"], "list"),
]
PERTURBATIONS = ["none", "none", "dtype", "shape", "nan"]


def _group_of(reduction: str, dtype: torch.dtype) -> tuple[str, str] | None:
    """The all_reduce group a big tensor state with no perturbation goes to (``None``: gathered)."""
    if reduction == "sum":
        return ("sum", "int64") if not dtype.is_floating_point else None
    if reduction in ("max", "min"):
        return (
            ("max", "int64")
            if not dtype.is_floating_point
            else ("max", str(dtype if dtype == torch.float64 else "f32"))
        )
    return None


def draw(seed: int, world_size: int, usable: set[str]) -> tuple[list[tuple[Any, str, str, tuple[int, ...]]], str, int]:
    """The same structure on every rank from ``seed``: states (reduction, dtype, kind, shape), a perturbation and
    the rank it applies to."""
    rng = random.Random(seed)
    spec = []
    for _ in range(rng.randint(2, 6)):
        reduction, dtypes, kind = rng.choice(KINDS)
        choices = [d for d in dtypes if d in usable]
        if not choices:
            continue
        shape = (rng.randint(1, 40), rng.randint(1, 4)) if rng.random() < 0.7 else ()
        spec.append((reduction, rng.choice(choices), kind, shape))
    return spec, rng.choice(PERTURBATIONS), rng.randrange(world_size)


def randomized_metric(rank: int, spec: list[Any], perturbation: str, odd: int) -> Probe:
    specs = {}
    for i, (reduction, dtype_name, kind, shape) in enumerate(spec):
        specs[f"s{i}"] = (torch.zeros(shape, dtype=getattr(torch, dtype_name)) if kind == "tensor" else [], reduction)
    metric = Probe(specs)
    for i, (_, dtype_name, kind, shape) in enumerate(spec):
        dtype = getattr(torch, dtype_name)
        if kind == "tensor":
            value = values(rank, i, shape, dtype)
            if value.is_floating_point():
                value = torch.where(value == 0, torch.ones_like(value), value)  # no -0.0 unless perturbed
            if rank == odd and perturbation == "nan" and value.is_floating_point():
                value.view(-1)[0] = float("nan")
            setattr(metric, f"s{i}", value)
        else:
            rows = shape[0] + rank if shape else 1  # cat lists: uneven rows per rank, equal lengths
            setattr(metric, f"s{i}", [values(rank, 10 * i + k, (rows, *shape[1:]), dtype) for k in range(2)])
    tensors = [i for i, state in enumerate(spec) if state[2] == "tensor"]
    if rank == odd and perturbation in ("dtype", "shape") and tensors:
        i = tensors[0]
        current = getattr(metric, f"s{i}")
        if perturbation == "dtype":
            setattr(metric, f"s{i}", current.to(torch.float64 if current.dtype != torch.float64 else torch.float32))
        else:
            setattr(metric, f"s{i}", torch.cat([current.reshape(-1), current.reshape(-1)[:1]]))
    return metric


def _randomized(rank: int, world_size: int, seed: int) -> None:
    from tests.test_fused import torchmetrics_sync

    usable = set(gloo_dtypes())
    spec, perturbation, odd = draw(seed, world_size, usable)
    breaks = perturbation in ("dtype", "shape") and any(state[2] == "tensor" for state in spec)
    threshold = reduced.REDUCE_MIN_BYTES
    reduced.REDUCE_MIN_BYTES = 64  # most tensor states here are reduced; put back below
    try:
        fused = randomized_metric(rank, spec, perturbation, odd)
        before_states = states(fused)
        before = calls()
        try:
            _fused.fused_sync(fused)
            outcome = "synced"
        except FusedSyncError as error:
            outcome = str(error)
        count = calls() - before
    finally:
        reduced.REDUCE_MIN_BYTES = threshold
    outcomes = every_rank(outcome)
    assert outcomes == [outcome] * world_size, (seed, outcomes)
    if breaks:
        assert outcome.startswith("torchmetrics_gradpatch: fused sync of state 's"), (seed, outcome)
        assert all(same(getattr(fused, k), v) or getattr(fused, k) is v for k, v in before_states.items())
        return
    assert outcome == "synced", (seed, spec, outcome)
    expected = randomized_metric(rank, spec, perturbation, odd)
    torchmetrics_sync(expected)
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), (seed, name, spec)
    groups, floats = set(), False
    for reduction, dtype_name, kind, shape in spec:
        dtype = getattr(torch, dtype_name)
        group = _group_of(reduction, dtype) if kind == "tensor" else None
        if group is not None and max(1, math.prod(shape)) * torch.empty((), dtype=dtype).element_size() >= 64:
            groups.add(group)
            floats = floats or dtype.is_floating_point
    if perturbation == "nan" and floats:
        groups = set()  # one rank's NaN: its proposal differs, so every state is gathered
    assert count == 2 + len(groups), (seed, spec, count, groups)


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("seed", range(16))
def test_randomized_structures(world_size: int, seed: int) -> None:
    run_ranks(_randomized, world_size, seed, timeout=TIMEOUT)
