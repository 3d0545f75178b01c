"""The fused sync against torchmetrics' own sync, on real gloo ranks: values bit for bit, two collectives for a
group's first exchange (plus one per operation and dtype of the states it reduces; tests/test_fused_steady.py counts
the steady ones), gradients, and CPU-held states crossing in chunks.

Each rank builds the same Metric twice from the same data, syncs one with torchmetrics' own ``_sync_dist`` (the
original method, with torchmetrics' gather) and the other with the fused sync, and compares every state's dtype,
shape and bytes. Collectives are counted with the process group's sequence number, which counts every collective
whatever API issued it. Gradients are checked against the same loss computed in one process from every rank's
data (each rank regenerates every rank's data from the same seeds). Rank bodies are the ``_``-prefixed functions
beside each test, run by ``tests._ranks.run_ranks``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from tests._patch_state import reset_patch_state
from tests._rank_tools import calls, destroy_subgroup
from tests._ranks import run_ranks
from tests._tensors import gloo_dtypes
from torchmetrics_gradpatch import _gather, _syncs
from torchmetrics_gradpatch import fused as _fused
from torchmetrics_gradpatch._errors import FusedSyncError
from torchmetrics_gradpatch.fused import transit

ORIGINAL_SYNC_DIST = _syncs.original_sync_dist()  # torchmetrics' own, also while the patch has replaced it


def fused_installed() -> bool:
    """Whether ``Metric._sync_dist`` is the package's replacement running the fused sync."""
    return _syncs.installed() == "fused"


class Probe(Metric):
    """A Metric whose states are whatever ``specs`` says: name -> (default, dist_reduce_fx)."""

    full_state_update = False

    def __init__(self, specs: dict[str, tuple[Any, Any]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name, (default, reduction) in specs.items():
            self.add_state(name, default=default, dist_reduce_fx=reduction)

    def update(self) -> None:  # states are set directly by the tests
        pass

    def compute(self) -> None:
        pass


def same(a: Any, b: Any) -> bool:
    """Bit for bit: the same type, and for tensors the same dtype, shape and bytes (lists element by element)."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8)
    )


def values(rank: int, seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s data for one state: reproducible on every rank."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, generator=generator).to(dtype)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def prod0(x: torch.Tensor) -> torch.Tensor:  # a custom reduction on a stacked tensor state
    return x.prod(dim=0)


def sum_list(xs: list[torch.Tensor]) -> torch.Tensor:  # a custom reduction on a list state
    return torch.stack([x.sum() for x in xs]).sum()


# name -> (reduction, kind, dtype, shape); kind "tensor" or "list:<lengths by rank>"
STATE_CASES: dict[str, list[tuple[Any, str, torch.dtype, tuple[int, ...]]]] = {
    "builtin reductions, float32 n-d": [(r, "tensor", torch.float32, (3, 4)) for r in ("sum", "mean", "max", "min")],
    "builtin reductions, 0-d": [(r, "tensor", torch.float64, ()) for r in ("sum", "mean", "max", "min")],
    "integer, bool and half dtypes": [
        ("sum", "tensor", torch.int64, (5,)),
        ("max", "tensor", torch.int32, (2, 2)),
        ("min", "tensor", torch.int8, ()),
        ("sum", "tensor", torch.bool, (3,)),
        ("sum", "tensor", torch.float16, (4,)),
        ("mean", "tensor", torch.bfloat16, (2, 3)),
        ("max", "tensor", torch.float64, (1,)),
    ],
    "cat on tensor states, reduction None": [
        ("cat", "tensor", torch.float32, (2, 3)),
        (None, "tensor", torch.int64, (4,)),
    ],
    "cat list states": [
        ("cat", "list:1,3,2", torch.float32, (2, 3)),
        ("cat", "list:2,2,2", torch.int64, (3,)),
        ("cat", "list:1,1,1", torch.float64, ()),
        ("cat", "list:3,2,2", torch.bfloat16, ()),
    ],
    "dist_reduce_fx=None lists": [
        (None, "list:2,2,2", torch.float32, (3,)),
        (None, "list:1,1,1", torch.int32, (2, 2)),
        (None, "list:3,3,3", torch.float16, ()),
    ],
    "custom callables": [
        (prod0, "tensor", torch.float64, (3,)),
        (sum_list, "list:2,2,2", torch.float32, (4,)),
    ],
}


def build(rank: int, case: list[tuple[Any, str, torch.dtype, tuple[int, ...]]], **kwargs: Any) -> Probe:
    """The case's Metric with rank ``rank``'s data in every state."""
    specs: dict[str, tuple[Any, Any]] = {}
    for i, (reduction, kind, dtype, shape) in enumerate(case):
        default = torch.zeros(shape, dtype=dtype) if kind == "tensor" else []
        specs[f"s{i}"] = (default, reduction)
    metric = Probe(specs, **kwargs)
    for i, (_, kind, dtype, shape) in enumerate(case):
        if kind == "tensor":
            setattr(metric, f"s{i}", values(rank, i, shape, dtype))
        else:
            length = int(kind.split(":")[1].split(",")[rank])
            setattr(metric, f"s{i}", [values(rank, 10 * i + k, shape, dtype) for k in range(length)])
    return metric


def states(metric: Metric) -> dict[str, Any]:
    return {name: getattr(metric, name) for name in metric._defaults}


def torchmetrics_sync(metric: Metric, group: Any = None) -> None:
    ORIGINAL_SYNC_DIST(metric, gather_all_tensors, process_group=group)


def comparable(spec: list[Any]) -> list[Any]:
    """The states of ``spec`` whose dtype this torch's gloo gathers: torchmetrics' own sync, the reference, raises
    "Invalid scalar type" on the others (bfloat16 on torch 2.0 and 2.1, bool on 2.0)."""
    usable = set(gloo_dtypes())
    return [state for state in spec if str(state[2]).removeprefix("torch.") in usable]


def worlds(*sizes: int) -> list[Any]:
    """One parameter per world size."""
    return [pytest.param(n, id=f"{n}ranks") for n in sizes]


def _values_bit_identical(rank: int, world_size: int, case: str) -> None:
    spec = comparable(STATE_CASES[case])
    expected, fused = build(rank, spec), build(rank, spec)
    torchmetrics_sync(expected)
    before = calls()
    _fused.fused_sync(fused)
    assert calls() - before == 2
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), (name, getattr(fused, name), value)


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("case", list(STATE_CASES))
def test_values_bit_identical_and_two_collectives(world_size: int, case: str) -> None:
    run_ranks(_values_bit_identical, world_size, case, timeout=60)


def test_install_restores_the_identical_original() -> None:
    import torchmetrics_gradpatch as tg

    tg.unpatch()  # the patch in force replaces _sync_dist too (a graph break under torch.compile)
    assert Metric.__dict__["_sync_dist"] is ORIGINAL_SYNC_DIST
    _syncs.install("fused")
    try:
        replacement = Metric.__dict__["_sync_dist"]
        assert replacement is not ORIGINAL_SYNC_DIST and fused_installed()
        assert replacement.__defaults__ == ORIGINAL_SYNC_DIST.__defaults__  # torchmetrics' gather stays the default
        _syncs.install("fused")  # idempotent: not wrapped twice
        assert Metric.__dict__["_sync_dist"] is replacement
    finally:
        _syncs.uninstall()
    assert Metric.__dict__["_sync_dist"] is ORIGINAL_SYNC_DIST and not fused_installed()
    with pytest.raises(ValueError, match="'fast' is not a sync strategy"):
        _syncs.install("fast")
    reset_patch_state()


def real_metrics(rank: int) -> dict[str, tuple[Callable[[], Metric], tuple[torch.Tensor, ...]]]:
    """Real torchmetrics Metrics and rank ``rank``'s (uneven) batch for each."""
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.regression import MeanSquaredError, SpearmanCorrCoef

    n = 4 + rank
    generator = torch.Generator().manual_seed(rank)
    regression = (torch.randn(n, generator=generator), torch.randn(n, generator=generator))
    classes = (torch.randn(n, 5, generator=generator).softmax(-1), torch.randint(0, 5, (n,), generator=generator))
    return {
        "MeanSquaredError": (MeanSquaredError, regression),
        "MulticlassAccuracy(macro)": (lambda: MulticlassAccuracy(num_classes=5, average="macro"), classes),
        "SpearmanCorrCoef (cat lists)": (SpearmanCorrCoef, regression),
    }


def _real_metrics_sync_through_sync(rank: int, world_size: int, name: str) -> None:
    import torchmetrics_gradpatch as tg

    make, batch = real_metrics(rank)[name]
    expected, fused, custom = make(), make(), make()
    for metric in (expected, fused, custom):
        metric.update(*batch)
        metric.update(*batch)  # two updates: cat lists hold two tensors
    before = calls()
    with tg.patched(sync="torchmetrics"):  # the reference, also where TORCHMETRICS_GRADPATCH_SYNC=fused
        assert not fused_installed()
        expected.sync()
    tm_calls = calls() - before
    _syncs.install("fused")
    try:
        before = calls()
        fused.sync()  # Metric.sync -> _sync_dist(torchmetrics' gather): fused
        assert calls() - before == 2
        before = calls()
        custom.sync(dist_sync_fn=lambda t, group=None: gather_all_tensors(t, group))  # a custom function
        assert calls() - before == tm_calls  # torchmetrics' own path
    finally:
        _syncs.uninstall()
    for name_, value in states(expected).items():
        assert same(getattr(fused, name_), value), name_
        assert same(getattr(custom, name_), value), name_


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("name", ["MeanSquaredError", "MulticlassAccuracy(macro)", "SpearmanCorrCoef (cat lists)"])
def test_real_metrics_sync_through_sync(world_size: int, name: str) -> None:
    run_ranks(_real_metrics_sync_through_sync, world_size, name, timeout=60)


def _subgroup(rank: int, world_size: int) -> None:
    group = dist.new_group([0, 2])
    if rank == 1:
        return  # not a member: it takes part in new_group only
    case = comparable(STATE_CASES["cat list states"] + STATE_CASES["builtin reductions, float32 n-d"])
    expected, fused = build(rank // 2, case), build(rank // 2, case)
    torchmetrics_sync(expected, group)
    before, world_before = calls(group), calls()
    _fused.fused_sync(fused, process_group=group)
    assert (calls(group) - before, calls() - world_before) == (2, 0)
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), name
    destroy_subgroup(group)  # the warm ranks stay


def test_subgroup() -> None:
    run_ranks(_subgroup, 3, timeout=60)


class OwnSync(Probe):
    """Overrides ``_sync_dist`` and calls ``super()`` (as MeanAveragePrecision does), then post-processes."""

    def _sync_dist(self, dist_sync_fn: Any = gather_all_tensors, process_group: Any = None) -> None:
        super()._sync_dist(dist_sync_fn=dist_sync_fn, process_group=process_group)
        self.extra = self.s0 * 2


def _override_calling_super(rank: int, world_size: int) -> None:
    case = STATE_CASES["builtin reductions, 0-d"] + STATE_CASES["dist_reduce_fx=None lists"]
    specs = {f"s{i}": (torch.zeros(()) if k == "tensor" else [], r) for i, (r, k, _, _) in enumerate(case)}
    expected, fused = OwnSync(specs), OwnSync(specs)
    for metric in (expected, fused):
        for name, value in states(build(rank, case)).items():
            setattr(metric, name, value)
    first = not fused_installed()  # else (TORCHMETRICS_GRADPATCH_SYNC=fused) expected.sync() is the first exchange
    expected.sync()
    _syncs.install("fused")
    try:
        before = calls()
        fused.sync()
        assert calls() - before == (2 if first else 1)
    finally:
        _syncs.uninstall()
    for name, value in [*states(expected).items(), ("extra", expected.extra)]:
        assert same(getattr(fused, name), value), name


def test_override_calling_super() -> None:
    run_ranks(_override_calling_super, 2, timeout=60)


class WeightedLoss(Metric):
    """A loss whose value depends on every state kind and on the order of the gathered samples."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__(dist_sync_on_step=True)
        self.add_state("sse", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("largest", torch.tensor(-1e9, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("preds", [], dist_reduce_fx="cat")
        self.add_state("sums", [], dist_reduce_fx=None)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.sse = self.sse + ((preds - target) ** 2).sum()
        self.n = self.n + preds.numel()
        self.largest = torch.maximum(self.largest, preds.max())
        self.preds.append(preds.reshape(-1, 1) * 1.0)  # 2-d cat rows
        self.sums.append(preds.sum().reshape(1))

    def compute(self) -> torch.Tensor:
        return weighted(self.sse, self.n, self.largest, _cat(self.preds), self.sums)


def _cat(x: Any) -> torch.Tensor:
    return torch.cat(x) if isinstance(x, list) else x


def weighted(sse: torch.Tensor, n: torch.Tensor, largest: torch.Tensor, rows: torch.Tensor, sums: Any) -> torch.Tensor:
    order = torch.arange(1, rows.shape[0] + 1, dtype=rows.dtype).reshape(-1, 1)
    lists = sum(((i + 2) * s.sum() for i, s in enumerate(sums)), torch.zeros((), dtype=rows.dtype))
    return sse / n + 0.5 * largest + (order * rows**3).sum() / 10 + lists


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s uneven batch: ``2 + rank`` samples."""
    generator = torch.Generator().manual_seed(rank + 7)
    n = 2 + rank
    return torch.randn(n, generator=generator, dtype=torch.float64), torch.randn(
        n, generator=generator, dtype=torch.float64
    )


def reference_grads(world_size: int) -> list[torch.Tensor]:
    """The gradient of the same loss over every rank's samples, in one process, split by rank."""
    batches = [batch(r) for r in range(world_size)]
    preds = [p.clone().requires_grad_() for p, _ in batches]
    targets = torch.cat([t for _, t in batches])
    everything = torch.cat(preds)
    loss = weighted(
        ((everything - targets) ** 2).sum(),
        torch.tensor(everything.numel()),
        everything.max(),
        everything.reshape(-1, 1),
        [p.sum().reshape(1) for p in preds],
    )
    loss.backward()
    return [p.grad for p in preds]  # type: ignore[misc]


def _gradients_against_one_process(rank: int, world_size: int, mode: str) -> None:
    preds, target = batch(rank)
    preds.requires_grad_()
    _syncs.install("fused", mode=mode)
    try:
        metric = WeightedLoss()
        before = calls()
        loss = metric(preds, target)
        assert calls() - before == 2
        before = calls()
        loss.backward()
        assert calls() - before == (1 if mode == "global" else 0)  # one backward collective for every state
    finally:
        _syncs.uninstall()
    scale = world_size if mode == "global" else 1  # global: every rank's (equal) loss reaches every rank's preds
    torch.testing.assert_close(preds.grad, scale * reference_grads(world_size)[rank], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("mode", ["local", "global"])
def test_gradients_against_one_process(world_size: int, mode: str) -> None:
    run_ranks(_gradients_against_one_process, world_size, mode, timeout=60)


def _global_mode_with_a_rank_without_graph(rank: int, world_size: int) -> None:
    preds, target = batch(rank)
    if rank != 1:
        preds.requires_grad_()  # rank 1's states have no graph: it still takes part in the backward
    _syncs.install("fused", mode="global")
    try:
        loss = WeightedLoss()(preds, target)
        assert loss.requires_grad
        before = calls()
        loss.backward()
        assert calls() - before == 1
    finally:
        _syncs.uninstall()
    if rank != 1:
        expected = world_size * reference_grads(world_size)[rank]
        torch.testing.assert_close(preds.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_global_mode_with_a_rank_without_graph(world_size: int) -> None:
    run_ranks(_global_mode_with_a_rank_without_graph, world_size, timeout=60)


def test_description_round_trip_and_alignment() -> None:
    from torchmetrics_gradpatch.fused import wire

    tensors = [
        torch.ones((), dtype=torch.bool),
        torch.ones(3, dtype=torch.float16),
        torch.ones(2, 2, dtype=torch.complex128),
    ]
    described = [
        wire.State(wire.KIND_TENSOR, (wire.piece_of(tensors[0]),)),
        wire.State(wire.KIND_LIST, tuple(wire.piece_of(t.requires_grad_(t.is_floating_point())) for t in tensors[1:])),
        wire.State(wire.KIND_LIST, (wire.piece_of(torch.tensor([])),), placeholder=True),
    ]
    streamed = wire.State(wire.KIND_LIST, (wire.piece_of(tensors[1], streamed=True), wire.piece_of(tensors[2])))
    assert wire.decode(wire.encode([streamed])) == ([], [streamed])
    # a streamed piece and a reduced (skipped) state take no payload bytes; the stream holds the streamed piece
    (_, kept), size = wire.layout([described[0], streamed], 0, skip=[0])
    assert kept[0] == -1 and kept[1] == 0 and size == 64
    (_, in_stream), stream_size = wire.layout([described[0], streamed], 0, skip=[0], streamed=True)
    assert in_stream == [0, -1] and stream_size == 16
    words = wire.encode(described)
    assert wire.decode(words) == ([], described) and len(words) % 2 == 0
    assert wire.decode(wire.encode(described, [7, 8, 9])) == ([7, 8, 9], described)
    offsets, size = wire.layout(described, 8 * len(words))
    assert all(o % wire.ALIGN == 0 for state in offsets for o in state) and size % wire.ALIGN == 0
    buffer = wire.pack(words, [[tensors[0]], tensors[1:], [torch.tensor([])]], offsets, size + 32, torch.device("cpu"))
    assert wire.words_of(buffer, len(words)) == words
    unpacked = wire.unpack(buffer, wire.views(described, offsets, ()))
    assert same(unpacked[0][0], tensors[0]) and same(unpacked[1], tensors[1:]) and unpacked[2][0].shape == (0,)
    assert not buffer[size:].any()  # padding is zeros, not this process's memory


def _global_mode_graph_keeps_no_receive_buffer(rank: int, world_size: int) -> None:
    import gc

    metric = Probe({"x": ([], "cat")})
    metric.x = [torch.randn(100_000 + rank, dtype=torch.float64, requires_grad=True)]
    _fused.fused_sync(metric, mode="global")
    assert metric.x.requires_grad
    # a receive buffer holds one rank's payload: 64 bytes of description, then the largest rank's 100,001 float64
    # values aligned to 16 bytes; anything viewing it (as any dtype) shares its storage of exactly that size
    payload = 64 + 800_016

    def storage_bytes(tensor: torch.Tensor) -> int:
        try:
            return tensor.untyped_storage().nbytes()
        except NotImplementedError:
            # torch 2.0: gloo's worker thread freed this tensor while the scan below held its Python object (an
            # undefined tensor): it holds no memory any more
            return 0

    def held() -> list[torch.Tensor]:
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance() on torch's deprecated module attributes warns
            return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and storage_bytes(t) == payload]

    # gloo's worker thread drops its finished work (which references the buffers) a moment after the caller
    # wakes, later still on a loaded machine; the graph, alive until backward below, would hold them for good
    deadline = time.monotonic() + 10
    while held() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held() == []  # the synced state's graph needs shapes and dtypes only
    metric.x.sum().backward()


def test_global_mode_graph_keeps_no_receive_buffer() -> None:
    run_ranks(_global_mode_graph_keeps_no_receive_buffer, 2, timeout=60)


def test_patch_sync_fused_installs_and_unpatch_restores() -> None:
    """The API wiring seen from this module (tests/test_sync_api.py has the rest): the engine installs and restores."""
    import torchmetrics_gradpatch as tg
    from torchmetrics_gradpatch import _api

    try:
        tg.patch(sync="fused")
        assert fused_installed() and tg.status().sync == "fused"
        tg.patch(sync="torchmetrics")
        assert not fused_installed() and _syncs.original_sync_dist() is ORIGINAL_SYNC_DIST
        tg.patch()  # no sync named: the default (TORCHMETRICS_GRADPATCH_SYNC, else torchmetrics' own)
        assert fused_installed() == (_api.sync_requested() == "fused")
        tg.patch(sync="fused")
        tg.unpatch()
        assert Metric.__dict__["_sync_dist"] is ORIGINAL_SYNC_DIST and not fused_installed()
        with pytest.raises(ValueError, match="'fast' is not a sync strategy"):
            tg.patch(sync="fast")
    finally:
        reset_patch_state()


# --- exact reductions -------------------------------------------------------------------------------------------

BIG = (300, 300)  # 90,000 elements: at least reduced.REDUCE_MIN_BYTES in every dtype, int8 included

# name -> states (reduction, dtype, shape), the all_reduce groups they use; the gathered ones are float sums, means
# and lists, mixed in
REDUCTION_CASES: dict[str, tuple[list[tuple[Any, torch.dtype, tuple[int, ...]]], int]] = {
    "integer sums, int64 result": (
        [("sum", torch.int64, BIG), ("sum", torch.int32, BIG), ("sum", torch.uint8, BIG), ("sum", torch.bool, BIG)],
        1,
    ),
    "integer max and min ride together": (
        [("max", torch.int64, BIG), ("min", torch.int32, BIG), ("min", torch.int8, BIG), ("max", torch.uint8, BIG)],
        1,
    ),
    "float max and min": ([("max", torch.float32, BIG), ("min", torch.float16, BIG), ("min", torch.float64, BIG)], 2),
    "a mix with gathered states": (
        [
            ("sum", torch.int64, BIG),
            ("sum", torch.float32, BIG),  # a floating-point sum: gathered
            ("mean", torch.float64, BIG),
            ("min", torch.int64, BIG),
            ("max", torch.float64, (3,)),  # small: in the payload
            ("cat", torch.float32, (4, 2)),
        ],
        2,
    ),
}


def big_values(rank: int, seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s data: integers near their type's limits (int32 sums overflow int32 but not torchmetrics'
    int64; int64 sums wrap), floats without NaN or -0.0 (+0.0 included)."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        value = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
        value.view(-1)[0] = 0.0
        return value
    info = torch.iinfo(dtype)
    value = torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(dtype)
    value.view(-1)[0] = info.max  # every rank: the sum overflows the state's own dtype
    return value


def reduction_probe(rank: int, spec: list[tuple[Any, torch.dtype, tuple[int, ...]]]) -> Probe:
    metric = Probe({f"s{i}": (torch.zeros(shape, dtype=dtype), r) for i, (r, dtype, shape) in enumerate(spec)})
    for i, (_, dtype, shape) in enumerate(spec):
        setattr(metric, f"s{i}", big_values(rank, i, shape, dtype))
    return metric


#: the gathers: the fused exchange's collectives are ``all_gather_single`` where torch has it, else ``all_gather``
GATHERS = ("all_gather", "all_gather_single")


@contextlib.contextmanager
def recording(*names: str) -> Iterator[list[tuple[str, int]]]:
    """Record every ``dist.<name>`` call's tensor (device type, bytes), in call order, for each of ``names`` this
    torch has, while calling through to the real one."""
    seen: list[tuple[str, int]] = []
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def recorder(name: str) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            tensor = args[1] if name in GATHERS else args[0]
            seen.append((tensor.device.type, tensor.numel() * tensor.element_size()))
            return real[name](*args, **kwargs)

        return record

    for name in real:
        setattr(dist, name, recorder(name))
    try:
        yield seen
    finally:
        for name, function in real.items():
            setattr(dist, name, function)


def _exact_reductions(rank: int, world_size: int, case: str) -> None:
    spec, groups = REDUCTION_CASES[case]
    usable = set(gloo_dtypes())
    spec = [state for state in spec if str(state[1]).removeprefix("torch.") in usable]
    expected, fused = reduction_probe(rank, spec), reduction_probe(rank, spec)
    torchmetrics_sync(expected)
    before = calls()
    with recording("all_reduce") as reductions:
        _fused.fused_sync(fused)
    assert calls() - before == 2 + groups and len(reductions) == groups, (calls() - before, reductions)
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), name


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("case", list(REDUCTION_CASES))
def test_exact_reductions_are_reduced_bit_for_bit(world_size: int, case: str) -> None:
    run_ranks(_exact_reductions, world_size, case, timeout=120)


def _order_sensitive_floats_are_gathered(rank: int, world_size: int, odd: str) -> None:
    spec = [("max", torch.float32, BIG), ("min", torch.float64, BIG), ("sum", torch.int64, BIG)]
    expected, fused = reduction_probe(rank, spec), reduction_probe(rank, spec)
    for metric in (expected, fused):
        if rank == world_size - 1:  # one rank only: the ranks' proposals differ, so every state is gathered
            metric.s0[1, 1] = float("nan") if odd == "nan" else -0.0
    torchmetrics_sync(expected)
    before = calls()
    _fused.fused_sync(fused)
    assert calls() - before == 2
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), name


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("odd", ["nan", "negative zero"])
def test_float_max_with_nan_or_negative_zero_is_gathered(world_size: int, odd: str) -> None:
    run_ranks(_order_sensitive_floats_are_gathered, world_size, odd, timeout=60)


def _subnormals_under_flush_to_zero(rank: int, world_size: int) -> None:
    dtypes = [d for d in (torch.float32, torch.bfloat16) if str(d).removeprefix("torch.") in gloo_dtypes()]
    spec = [(reduction, dtype, BIG) for dtype in dtypes for reduction in ("max", "min")]

    def subnormals() -> Probe:
        metric = Probe({f"s{i}": (torch.zeros(shape, dtype=dtype), r) for i, (r, dtype, shape) in enumerate(spec)})
        for i, (_, dtype, shape) in enumerate(spec):
            # +0.0 on rank 0, a positive subnormal on the others: torch compares them as equal under flush-to-zero,
            # so which one the stacked max/min returns depends on the order it meets them
            tiny = torch.finfo(dtype).tiny / 4
            setattr(metric, f"s{i}", torch.full(shape, 0.0 if rank == 0 else tiny, dtype=dtype))
        return metric

    expected, fused = subnormals(), subnormals()  # made before the mode changes, so the subnormals are there
    assert all(bool((state != 0).all()) for state in states(fused).values()) or rank == 0
    if not torch.set_flush_denormal(True):
        return  # no flush-to-zero on this processor: nothing order-dependent to check
    try:
        torchmetrics_sync(expected)
        before = calls()
        _fused.fused_sync(fused)
        count = calls() - before
    finally:
        torch.set_flush_denormal(False)
    assert count == 2, count  # gathered: no rank with a subnormal proposes to reduce
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), name


@pytest.mark.parametrize("world_size", worlds(2, 3))
def test_subnormals_under_flush_to_zero_are_gathered(world_size: int) -> None:
    run_ranks(_subnormals_under_flush_to_zero, world_size, timeout=60)


def _a_state_with_a_graph_is_gathered(rank: int, world_size: int, mode: str) -> None:
    leaf = big_values(rank, 0, BIG, torch.float64).requires_grad_()
    metric = Probe({"x": (torch.zeros(BIG, dtype=torch.float64), "max")})
    metric.x = leaf * 2
    _syncs.install("fused", mode=mode)
    try:
        before = calls()
        metric.sync()
        assert calls() - before == 2 and metric.x.requires_grad
    finally:
        _syncs.uninstall()
    metric.x.sum().backward()
    assert leaf.grad is not None


@pytest.mark.parametrize("mode", ["local", "global"])
def test_a_state_with_a_graph_is_gathered(mode: str) -> None:
    run_ranks(_a_state_with_a_graph_is_gathered, 2, mode, timeout=60)


# --- CPU-held states on a device-only group (NCCL), the device path forced on gloo --------------------------------


@contextlib.contextmanager
def device_path(chunk: int) -> Iterator[None]:
    """The path CPU-held states take under NCCL, on this gloo group: the staging device is the CPU (the test's
    stand-in for the current CUDA device), chunks of ``chunk`` bytes. Put back after."""
    original, previous = _gather.staging_device, os.environ.get(_gather.CHUNK_ENV)
    _gather.staging_device = lambda group: torch.device("cpu")  # type: ignore[assignment]
    os.environ[_gather.CHUNK_ENV] = str(chunk)
    try:
        yield
    finally:
        _gather.staging_device = original  # type: ignore[assignment]
        if previous is None:
            del os.environ[_gather.CHUNK_ENV]
        else:
            os.environ[_gather.CHUNK_ENV] = previous


def cpu_held(rank: int, big: int = 20_000) -> Probe:
    """A Metric on the CPU: ``cat`` and ``None`` lists of uneven sizes, a ``big`` integer sum, a small float sum."""
    metric = Probe({"c": ([], "cat"), "n": ([], None), "big": (torch.zeros(big, dtype=torch.int64), "sum")})
    metric.add_state("f", torch.zeros(3), dist_reduce_fx="sum")
    metric.c = [values(rank, k, (3 + rank, 5), torch.float32) for k in range(2)]
    metric.n = [values(rank, 9, (7 + rank,), torch.int64)]
    metric.big = values(rank, 4, (big,), torch.int64)
    metric.f = values(rank, 5, (3,), torch.float32)
    return metric


def _which_device_each_exchange_uses(rank: int, world_size: int) -> None:
    group = dist.distributed_c10d._get_default_group()
    assert _gather.staging_device(group) is None  # gloo takes CPU tensors as they are
    assert transit.devices("cpu", group) == (torch.device("cpu"), None, False)  # a CPU Metric: unchanged
    with device_path(1000):
        assert transit.devices("cpu", group) == (torch.device("cpu"), torch.device("cpu"), True)


def test_which_device_each_exchange_uses() -> None:
    run_ranks(_which_device_each_exchange_uses, 2, timeout=60)


def _cpu_states_cross_in_chunks(rank: int, world_size: int, chunk: int) -> None:
    big = 8_192  # reduced.REDUCE_MIN_BYTES: 1,024 reductions at 64-byte chunks (20,000: 14 s on torch 2.0's gloo)
    expected, fused = cpu_held(rank, big), cpu_held(rank, big)
    torchmetrics_sync(expected)
    # every rank's streamed bytes: its concatenated cat list, its None list, its float sum, each 16-byte aligned
    streams = [sum(-(-n // 16) * 16 for n in (2 * (3 + r) * 5 * 4, (7 + r) * 8, 3 * 4)) for r in range(world_size)]
    stream_chunks = -(-max(streams) // chunk)
    reduce_chunks = -(-big * 8 // chunk)
    with device_path(chunk), recording(*GATHERS) as gathers, recording("all_reduce") as reductions:
        before = calls()
        _fused.fused_sync(fused)
        count = calls() - before
    assert count == 2 + stream_chunks + reduce_chunks, (count, stream_chunks, reduce_chunks)
    chunks = [size for _, size in gathers[2:]]
    assert sum(chunks) == max(streams) and max(chunks) <= chunk and len(chunks) == stream_chunks, chunks
    assert len(reductions) == reduce_chunks and max(size for _, size in reductions) <= chunk
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), name
        for element in value if isinstance(value, list) else [value]:
            assert element.device.type == "cpu"


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
def test_cpu_states_cross_in_chunks(world_size: int, chunk: int) -> None:
    run_ranks(_cpu_states_cross_in_chunks, world_size, chunk, timeout=120)


def _patched_gather_crosses_in_chunks(rank: int, world_size: int, shape: tuple[int, ...]) -> None:
    own = (shape[0] + rank, *shape[1:]) if shape else ()  # uneven first dimension: padded, gathered, trimmed
    x = values(rank, 7, own, torch.float64)
    reference = gather_all_tensors(x)
    chunk = 1000
    with device_path(chunk), recording(*GATHERS) as gathers:
        before = calls()
        got = _gather.gather_local(x)
        count = calls() - before
    padded = 8 * (math.prod((shape[0] + world_size - 1, *shape[1:])) if shape else 1)
    data = -(-padded // chunk)
    assert count == 2 + data, (count, data)  # the barrier, the shapes with each rank's chunk size, the data
    assert [size for _, size in gathers[1:]] == [min(chunk, padded - k * chunk) for k in range(data)]
    assert got[rank] is x and all(same(a, b) for a, b in zip(got, reference, strict=True))
    assert all(entry.device.type == "cpu" for entry in got)


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("shape", [(), (3, 100), (40, 7, 2)], ids=["scalar", "2-d", "3-d"])
def test_patched_gather_crosses_in_chunks(world_size: int, shape: tuple[int, ...]) -> None:
    run_ranks(_patched_gather_crosses_in_chunks, world_size, shape, timeout=60)


def _a_bad_chunk_size_raises_on_every_rank(rank: int, world_size: int, bad: str) -> None:
    texts: list[object] = [None] * world_size
    with device_path(1000):  # the patched gather reads the chunk size only on the device path
        os.environ[_gather.CHUNK_ENV] = bad if rank == 1 else "1000"
        with pytest.raises(FusedSyncError) as caught:
            _fused.fused_sync(cpu_held(rank))
        dist.all_gather_object(texts, str(caught.value))
        assert texts == [texts[0]] * world_size and "rank(s) [1]" in str(caught.value), texts
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\]") as gathered:
            _gather.gather_local(values(rank, 1, (3 + rank,), torch.float32))
        dist.all_gather_object(texts, str(gathered.value))
        assert texts == [texts[0]] * world_size, texts
    follow_up = Probe({"x": ([], "cat")})
    follow_up.x = [torch.ones(1)]
    _fused.fused_sync(follow_up)  # the group is in step
    assert same(follow_up.x, torch.ones(world_size))


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("bad", ["lots", "0", "99999999999999999999"])
def test_a_bad_chunk_size_raises_on_every_rank(world_size: int, bad: str) -> None:
    run_ranks(_a_bad_chunk_size_raises_on_every_rank, world_size, bad, timeout=60)


def test_kept_send_buffer_gives_packs_bytes_and_zero_padding() -> None:
    from torchmetrics_gradpatch.fused import wire

    def packed(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        described = [wire.tensor_state(t) for t in tensors]
        words = wire.encode(described)
        offsets, size = wire.layout(described, 8 * len(words))
        row = list(range(wire.HEADER_WORDS))
        total = 8 * wire.HEADER_WORDS + size + 64
        cpu, head = torch.device("cpu"), 8 * wire.HEADER_WORDS
        kept = wire.pack([*row, *words], [[t] for t in tensors], offsets, total, cpu, head, group).clone()
        return kept, wire.pack([*row, *words], [[t] for t in tensors], offsets, total, cpu, head)

    group = wire.Group()  # a group's record of its own: the process's others stay as they were
    first = [torch.full((3,), 7.0, dtype=torch.float64), torch.ones((), dtype=torch.complex128).conj()]
    kept, reference = packed(first)
    assert torch.equal(kept, reference)
    # another layout of the same size: its own buffer, none of the first one's bytes in its padding
    kept, reference = packed([torch.ones(1, dtype=torch.float64), torch.ones((), dtype=torch.complex128)])
    assert torch.equal(kept, reference)
    # the first layout again, other values: its kept buffer holds them
    kept, reference = packed([-t for t in first])
    assert torch.equal(kept, reference)
    assert len(group.sends) <= wire.KEPT
