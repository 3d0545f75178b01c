"""Large ``cat`` states under the fused sync, on real gloo ranks: torchmetrics' values bit for bit, one collective
for all of them, and no byte allocated for them beyond the synced states themselves (and alignment).

The threshold is set low in the ranks (``large.LARGE_MIN_BYTES``), so small tensors exercise the large path. The
bytes come from the module's own allocation hook (``large.on_buffer``): exact, not resident memory. The collectives
are counted with the process group's sequence number, against the same sync with the large path off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torchmetrics import CatMetric, MetricCollection, SumMetric
from torchmetrics.utilities.data import dim_zero_cat

import torchmetrics_gradpatch as tg
from tests._patch_state import forget_capacities
from tests._rank_tools import calls
from tests._ranks import run_ranks
from tests._tensors import gloo_dtypes
from tests.test_fused import Probe, same, states, torchmetrics_sync, values, worlds
from torchmetrics_gradpatch import _bytes
from torchmetrics_gradpatch import fused as _fused
from torchmetrics_gradpatch.fused import large
from torchmetrics_gradpatch.fused import wire as fp
from torchmetrics_gradpatch.fused.sync import placeholder_rule

THRESHOLD = 64  # bytes: a rank whose cat states hold this many sends them apart, in these tests


# name -> states: (dtype, trailing shape, rows per rank "r0/r1/r2": "," between a rank's tensors, "-" none)
CASES: dict[str, list[tuple[torch.dtype, tuple[int, ...], str]]] = {
    "uneven float32 rows, one rank with an empty list": [(torch.float32, (), "40/-/90")],
    "multi-dim int64 rows, several tensors per rank": [(torch.int64, (3, 2), "4,7/5,1,2/9")],
    "0-d elements concatenated in step 1": [(torch.float64, "0-d", "12/20/7")],  # type: ignore[list-item]
    "bool and bfloat16": [(torch.bool, (5,), "30/70/20"), (torch.bfloat16, (), "50/10/41")],
    "one rank large, the others small": [(torch.float32, (2,), "64/1/3")],
}


def build(rank: int, spec: list[Any], extra: bool = False) -> Probe:
    """A Metric with the case's ``cat`` list states (rank ``rank``'s data); with ``extra``, small states beside."""
    specs: dict[str, tuple[Any, Any]] = {f"c{i}": ([], "cat") for i in range(len(spec))}
    if extra:
        specs.update({"total": (torch.zeros(3), "sum"), "few": ([], "cat")})
    metric = Probe(specs)
    for i, (dtype, trailing, rows) in enumerate(spec):
        field = rows.split("/")[rank]
        if field == "-":
            pieces = []
        elif trailing == "0-d":
            pieces = [values(rank, 100 * i + k, (), dtype) for k in range(int(field))]
        else:
            pieces = [values(rank, 100 * i + k, (int(n), *trailing), dtype) for k, n in enumerate(field.split(","))]
        setattr(metric, f"c{i}", pieces)
    if extra:
        metric.total = values(rank, 7, (3,), torch.float32)
        metric.few = [values(rank, 8, (2,), torch.float32)]
    return metric


@contextlib.contextmanager
def threshold(nbytes: int) -> Iterator[list[torch.Tensor]]:
    """The large path from ``nbytes`` on, every buffer it allocates recorded."""
    allocated: list[torch.Tensor] = []
    saved = large.LARGE_MIN_BYTES, large.on_buffer
    large.LARGE_MIN_BYTES, large.on_buffer = nbytes, allocated.append
    try:
        yield allocated
    finally:
        large.LARGE_MIN_BYTES, large.on_buffer = saved


@contextlib.contextmanager
def payload_sizes() -> Iterator[list[int]]:
    """Record the size of every payload this rank packs."""
    sizes: list[int] = []
    real = fp.pack

    def pack(*args: Any, **kwargs: Any) -> torch.Tensor:
        buffer = real(*args, **kwargs)
        sizes.append(buffer.numel())
        return buffer

    fp.pack = pack
    try:
        yield sizes
    finally:
        fp.pack = real


def fused_counted(metric: Any, mode: str = "local") -> int:
    """The collectives of one fused sync of ``metric``, as its group's first exchange (every count alike)."""
    forget_capacities()
    before = calls()
    _fused.fused_sync(metric, mode=mode)
    return calls() - before


def _large_cat_states(rank: int, world_size: int, case: str, extra: bool) -> None:
    spec = CASES[case]
    expected, baseline, fused = (build(rank, spec, extra) for _ in range(3))
    empty = any(rows.split("/")[r] == "-" for _, _, rows in spec for r in range(world_size))
    gathered = set(gloo_dtypes())
    if (empty and not placeholder_rule(expected)) or any(
        str(s[0]).removeprefix("torch.") not in gathered for s in spec
    ):
        # torchmetrics' own sync cannot be the reference here: it desyncs on an empty cat list (before 1.4, or on
        # torch 2.0), and gloo does not gather bool or bfloat16 on torch 2.0 and 2.1 (the fused sync sends bytes).
        # The reference is one process holding every rank's data, the empty ranks contributing nothing
        for name in states(expected):
            held = [getattr(build(r, spec, extra), name) for r in range(world_size)]
            setattr(expected, name, dim_zero_cat([dim_zero_cat(h) for h in held if h]))
    else:
        torchmetrics_sync(expected)
    with threshold(1 << 40):  # the large path off: every state in the payload
        base = fused_counted(baseline)
    with threshold(THRESHOLD) as allocated, payload_sizes() as packed:
        count = fused_counted(fused)
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), (name, getattr(fused, name), value)
        assert same(getattr(baseline, name), value), name
    # one collective for the large states, into one buffer that is their synced values: not a byte more
    assert count == base + 1 and len(allocated) == 1, (count, base, allocated)
    (buffer,) = allocated
    results = [getattr(fused, name) for name in states(fused) if name != "total"]  # every cat state: one rank's
    # cat states add up to the threshold in every case, and a state one rank sends apart is concatenated in place
    assert buffer.numel() == sum(_bytes.aligned(r.numel() * r.element_size()) for r in results), buffer.numel()
    assert all(r.untyped_storage().data_ptr() == buffer.data_ptr() for r in results)
    # the large states left the payload: what remains is the description and the small states
    assert max(packed) < 1024, packed


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("case", list(CASES))
def test_large_cat_states_bit_identical_in_one_collective_no_byte_beyond_the_result(world_size: int, case: str) -> None:
    run_ranks(_large_cat_states, world_size, case, case.startswith("one rank"), timeout=120)


def _a_graph_keeps_the_state_on_the_pieces_path(rank: int, world_size: int, mode: str) -> None:
    def make() -> Probe:
        metric = Probe({"c": ([], "cat")})
        data = values(rank, 1, (40 if rank == 0 else 3, 2), torch.float64)
        # rank 0's tensors are large (two, joined in the buffer), rank 1's has a graph
        metric.c = [data[:15], data[15:]] if rank == 0 else [data.requires_grad_()]
        return metric

    expected, baseline, fused = make(), make(), make()
    with tg.patched(mode=mode):
        torchmetrics_sync(expected)
    with threshold(1 << 40):
        base = fused_counted(baseline, mode)
    with threshold(THRESHOLD) as allocated:
        count = fused_counted(fused, mode)
    assert same(fused.c, expected.c) and same(baseline.c, expected.c)
    assert fused.c.requires_grad == expected.c.requires_grad == (rank == 1 or mode == "global")
    # rank 0's piece crossed apart in one collective; the state is concatenated by step 3, keeping the graph
    assert count == base + 1 and [b.numel() for b in allocated] == [40 * 2 * 8], (count, base, allocated)
    for metric in (fused, baseline):
        if metric.c.requires_grad:
            metric.c.sum().backward()


@pytest.mark.parametrize("mode", ["local", "global"])
def test_a_graph_keeps_the_state_on_the_pieces_path(mode: str) -> None:
    run_ranks(_a_graph_keeps_the_state_on_the_pieces_path, 2, mode, timeout=120)


def _collection_with_large_members(rank: int, world_size: int) -> None:
    def make() -> MetricCollection:
        metrics = MetricCollection({"a": CatMetric(), "b": CatMetric(), "n": SumMetric()})
        metrics["a"].update(values(rank, 1, (50 + 30 * rank,), torch.float32))
        metrics["b"].update(values(rank, 2, (3,), torch.float32))  # small on every rank: rides the payload
        metrics["n"].update(values(rank, 3, (4,), torch.float32))
        return metrics

    expected, baseline, fused = make(), make(), make()
    with tg.patched(sync="torchmetrics"):
        reference = expected.compute()
    with threshold(1 << 40), tg.patched(sync="fused"):
        forget_capacities()
        before = calls()
        plain = baseline.compute()
        base = calls() - before
    cached: list[bool] = []  # per state joined in place: sync()'s cache of it holds the local tensors, no copies
    release = large.release_cache

    def spy(metric: Any, attrs: Any) -> None:  # runs as each member's synced states are set
        for attr in attrs:
            pairs = zip(metric._cache[attr], getattr(metric, attr), strict=True)
            cached.append(all(c.data_ptr() == t.data_ptr() for c, t in pairs))
        release(metric, attrs)

    large.release_cache = spy
    try:
        with threshold(THRESHOLD) as allocated, tg.patched(sync="fused"):
            forget_capacities()
            before = calls()
            result = fused.compute()
            count = calls() - before
    finally:
        large.release_cache = release
    assert all(same(result[k], reference[k]) and same(plain[k], reference[k]) for k in reference)
    assert count == base + 1 and len(allocated) == 1, (count, base, allocated)
    assert cached and all(cached), cached  # "a" and "b" (a rank's cat states count together): no copy made


def test_collection_with_large_members() -> None:
    run_ranks(_collection_with_large_members, 3, timeout=120)


def _metric_sync_keeps_no_copy_of_the_states_sent_apart(rank: int, world_size: int) -> None:
    spec = [*CASES["multi-dim int64 rows, several tensors per rank"], (torch.float32, (), "40/3/90")]
    expected, fused = build(rank, spec, extra=True), build(rank, spec, extra=True)
    local = {name: list(value) if isinstance(value, list) else value for name, value in states(fused).items()}
    torchmetrics_sync(expected)
    with threshold(THRESHOLD), tg.patched(sync="fused"):
        fused.sync()
        assert fused._is_synced and all(same(getattr(fused, k), v) for k, v in states(expected).items())
        # the cache holds the local tensors themselves for the states sent apart, not copies
        for name in ("c0", "c1"):
            cached, held = fused._cache[name], local[name]
            assert [c.untyped_storage().data_ptr() for c in cached] == [t.untyped_storage().data_ptr() for t in held]
        fused.unsync()
    assert all(same(getattr(fused, k), v) for k, v in local.items())


def test_metric_sync_keeps_no_copy_of_the_states_sent_apart() -> None:
    run_ranks(_metric_sync_keeps_no_copy_of_the_states_sent_apart, 3, timeout=120)
