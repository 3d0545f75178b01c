"""The gpu profile (``tox -e gpu``, or ``pytest tests/test_gpu.py``): the gather, both gradient modes, a Metric loss and
torch.compile (inductor) on CUDA tensors; and CPU-held states crossing an NCCL group in chunks, through the fused
sync and the patched gather.

Two worlds: NCCL with one rank per device, for as many devices as the machine has (``ranks(n, backend="nccl")``
puts rank r on cuda:r), and gloo with CUDA tensors for 2 and 3 ranks sharing device 0. Every body checks its own
rank against a single-process float64 reference it computes on the CPU from every rank's deterministic inputs.
Without CUDA every test skips at collection, saying so.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import torchmetrics_gradpatch as tg
from tests import _global_inputs as inp
from tests._rank_tools import every_rank
from tests._ranks import run_ranks
from tests._workloads import CatSquaredError, SumSquaredError

CUDA = torch.cuda.is_available()
DEVICES = torch.cuda.device_count() if CUDA else 0
NO_CUDA = f"no CUDA device here (torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'})"
pytestmark = pytest.mark.skipif(not CUDA, reason=NO_CUDA)
TIMEOUT = 300  # NCCL's start-up and inductor's first compile take tens of seconds per process


#: NCCL with one rank per device (at least 1; fresh ranks, rank r on cuda:r), and gloo with CUDA tensors for 2 and
#: 3 warm ranks sharing cuda:0.
WORLDS = [
    pytest.param("nccl", max(DEVICES, 1), id=f"nccl-{max(DEVICES, 1)}ranks"),
    *(pytest.param("gloo", n, id=f"gloo-{n}ranks-cuda0") for n in (2, 3)),
]


def device() -> torch.device:
    """This rank's device: cuda:rank under NCCL (set by run_ranks), cuda:0 for the gloo ranks."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("case", ["equal", "uneven_rows", "scalar"])
@pytest.mark.parametrize(("backend", "world_size"), WORLDS)
def test_gather_on_cuda_in_both_modes(backend: str, world_size: int, case: str) -> None:
    """Values equal every rank's input; local mode keeps the own entry's graph, global mode's gradient is exact."""
    run_ranks(_gather_on_cuda, world_size, case, backend=backend, timeout=TIMEOUT)


def _gather_on_cuda(rank: int, world_size: int, case: str) -> None:
    dev = device()
    xs = [inp.gather_input(case, r) for r in range(world_size)]
    total = sum(inp.gather_loss([x.contiguous() for x in xs], r) for r in range(world_size))
    (global_ref,) = torch.autograd.grad(total, xs[rank])
    (local_ref,) = torch.autograd.grad(inp.gather_loss([x.contiguous() for x in xs], rank), xs[rank])
    for mode, reference in (("local", local_ref), ("global", global_ref)):
        x = inp.gather_input(case, rank).detach().to(dev).requires_grad_()
        entries = tg.gather_all_tensors(x, mode=mode)
        assert [e.device for e in entries] == [dev] * world_size, mode
        for j, entry in enumerate(entries):
            assert torch.equal(entry.detach().cpu(), xs[j].detach().contiguous()), (mode, j)
        assert entries[rank] is x or mode == "global"
        inp.gather_loss([e.double() for e in entries], rank).backward()
        assert x.grad is not None and x.grad.device == dev
        inp.assert_rel(x.grad.cpu(), reference)


@pytest.mark.parametrize("metric", ["sum", "cat"])
@pytest.mark.parametrize(("backend", "world_size"), WORLDS)
def test_metric_loss_on_cuda_backpropagates_like_single_process(backend: str, world_size: int, metric: str) -> None:
    """A Metric with ``dist_sync_on_step=True`` as the loss through torchmetrics' own gather (patched)."""
    run_ranks(_metric_loss_on_cuda, world_size, metric, backend=backend, timeout=TIMEOUT)


def _metric_loss_on_cuda(rank: int, world_size: int, metric: str) -> None:
    dev = device()
    rows = inp.ROWS["equal" if metric == "sum" else "uneven"]
    data = [inp.model_inputs(r, rows[r % 3]) for r in range(world_size)]
    w = inp.weight().requires_grad_()
    preds, target = torch.cat([d[0] for d in data]) @ w, torch.cat([d[1] for d in data])
    (reference,) = torch.autograd.grad(((preds - target) ** 2).mean(), w)
    for mode, scale in (("local", 1 / world_size), ("global", 1.0)):
        features, target = (t.to(dev) for t in data[rank])
        w_dev = inp.weight().to(dev).requires_grad_()
        loss_metric = (SumSquaredError if metric == "sum" else CatSquaredError)(dist_sync_on_step=True).to(dev)
        with tg.patched(mode=mode):
            loss = loss_metric(features @ w_dev, target)
        assert loss.device == dev and loss.requires_grad, mode
        loss.backward()
        assert w_dev.grad is not None
        ddp = torch.stack(every_rank(w_dev.grad.cpu())).mean(dim=0)  # type: ignore[arg-type]
        inp.assert_rel(ddp, scale * reference)  # DDP's average: global exact, local 1 / world size of it


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("mode", ["local", "global"])
@pytest.mark.parametrize(("backend", "world_size"), WORLDS)
def test_compiled_metric_loss_on_cuda_matches_eager(backend: str, world_size: int, mode: str) -> None:
    """torch.compile(backend="inductor") around a cat-state Metric loss on CUDA: eager's loss and gradient."""
    run_ranks(_compiled_metric_loss_on_cuda, world_size, mode, backend=backend, timeout=TIMEOUT)


def _compiled_metric_loss_on_cuda(rank: int, world_size: int, mode: str) -> None:
    dev = device()
    if tg.status().native:
        tg.compile_support()  # what the docs tell users of native torchmetrics to do for torch.compile
    features, target = (t.to(dev) for t in inp.model_inputs(rank, 3 + rank))

    results = []
    for compiled in (False, True):
        metric = CatSquaredError(dist_sync_on_step=True).to(dev)

        def step(w: torch.Tensor, metric: CatSquaredError = metric) -> torch.Tensor:
            return metric(torch.tanh(features @ w), target)  # type: ignore[no-any-return]

        fn = torch.compile(step, backend="inductor") if compiled else step
        w = inp.weight().to(dev).requires_grad_()
        with tg.patched(mode=mode):
            loss = fn(w)
        loss.backward()
        results.append((loss.detach().cpu(), w.grad.detach().cpu()))  # type: ignore[union-attr]
    tg.compile_support(False)
    (eager_loss, eager_grad), (compiled_loss, compiled_grad) = results
    inp.assert_rel(compiled_loss, eager_loss)
    inp.assert_rel(compiled_grad, eager_grad)
    assert eager_grad.abs().max() > 0


# --- the fused sync and the patched gather: CPU-held states under NCCL (torchmetrics #2477) ---------------------------
@pytest.mark.parametrize(("backend", "world_size"), WORLDS)
def test_large_cat_states_add_at_most_their_gathered_size(backend: str, world_size: int) -> None:
    """``Metric.sync()`` of large ``cat`` states (uneven, one a list of two tensors) under the fused sync: the values
    of torchmetrics' own sync, and a device peak (``torch.cuda.max_memory_allocated``) of at most 1.25x the
    gathered states and never more than torchmetrics' own sync's."""
    run_ranks(_large_cat_states_on_cuda, world_size, backend=backend, timeout=TIMEOUT)


def _large_cat_states_on_cuda(rank: int, world_size: int) -> None:
    from tests.test_fused import Probe, same, values

    dev = device()
    rows = [1_000_000 + 250_000 * r for r in range(world_size)]

    def make() -> Probe:
        metric = Probe({"preds": ([], "cat"), "target": ([], "cat")}).to(dev)
        n = rows[rank]
        metric.preds = [
            values(rank, 1, (n // 2,), torch.float32).to(dev),
            values(rank, 2, (n - n // 2,), torch.float32).to(dev),
        ]
        metric.target = [values(rank, 3, (n,), torch.int64).to(dev)]
        return metric

    gathered = sum(rows) * (4 + 8)
    peaks, synced = {}, {}
    for sync in ("torchmetrics", "fused"):
        metric = make()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with tg.patched(sync=sync):
            metric.sync()
        torch.cuda.synchronize()
        peaks[sync] = torch.cuda.max_memory_allocated() - before
        synced[sync] = metric
    assert same(synced["fused"].preds, synced["torchmetrics"].preds)
    assert same(synced["fused"].target, synced["torchmetrics"].target)
    assert peaks["fused"] <= 1.25 * gathered and peaks["fused"] <= peaks["torchmetrics"], (peaks, gathered)
    for metric in synced.values():
        metric.unsync()


# Ranks from tests._ranks.run_ranks (gloo default group); each body makes an NCCL group of every rank, one rank per
# device (a world of one NCCL rank runs on a single GPU), checks against torchmetrics' own sync over the gloo group,
# and destroys the NCCL group before it returns.

NCCL_WORLDS = sorted({1, DEVICES}) if CUDA else [1]
CHUNK = 4096


def _on_nccl(rank: int, world_size: int, case: str) -> None:
    import contextlib

    from torchmetrics.utilities.distributed import gather_all_tensors

    from tests._rank_tools import destroy_subgroup
    from tests.test_fused import ORIGINAL_SYNC_DIST, cpu_held, same, states, values
    from torchmetrics_gradpatch import _gather, fused

    torch.cuda.set_device(rank)
    nccl = dist.new_group(backend="nccl")
    previous = os.environ.get(_gather.CHUNK_ENV)
    os.environ[_gather.CHUNK_ENV] = str(CHUNK)
    try:
        assert _gather.staging_device(nccl) == torch.device("cuda", rank)
        assert _gather.staging_device(None) is None  # the gloo default group: CPU tensors as they are
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if case == "fused, a Metric on the CPU":
            expected, synced = cpu_held(rank), cpu_held(rank)
            ORIGINAL_SYNC_DIST(expected, gather_all_tensors)  # torchmetrics' own, over gloo
            fused.fused_sync(synced, process_group=nccl)
            checks = [(getattr(synced, k), v) for k, v in states(expected).items()]
            whole = 20_000 * 8  # the big integer sum, reduced in chunks
        elif case == "fused, compute_on_cpu":
            from torchmetrics import CatMetric

            made = [CatMetric(compute_on_cpu=True).to(f"cuda:{rank}") for _ in range(2)]
            for metric in made:
                metric.update(values(rank, 1, (50_000 + rank,), torch.float32).to(f"cuda:{rank}"))
                assert all(t.device.type == "cpu" for t in metric.value)  # torchmetrics moved the list states
            expected, synced = made
            ORIGINAL_SYNC_DIST(expected, gather_all_tensors)
            fused.fused_sync(synced, process_group=nccl)
            checks = [(synced.value, expected.value)]
            whole = 50_000 * 4
        else:  # the patched gather (torchmetrics < 1.6 runs it as its own gather_all_tensors)
            x = values(rank, 3, (3000 + rank, 4), torch.float64)
            got = tg.gather_all_tensors(x, group=nccl)
            checks = list(zip(got, gather_all_tensors(x), strict=True))
            assert got[rank] is x
            whole = 3000 * 4 * 8
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        for got_value, value in checks:
            assert same(got_value, value)
            for element in got_value if isinstance(got_value, list) else [got_value]:
                assert element.device.type == "cpu", element.device  # back where torchmetrics keeps it
        # the device held a chunk per rank at a time (and the small header and descriptions), never a whole state
        bound = (world_size + 1) * CHUNK + 16 * 1024
        assert peak <= bound < whole, (peak, bound, whole)
    finally:
        with contextlib.suppress(KeyError):
            del os.environ[_gather.CHUNK_ENV]
        if previous is not None:
            os.environ[_gather.CHUNK_ENV] = previous
        destroy_subgroup(nccl)


@pytest.mark.parametrize("case", ["fused, a Metric on the CPU", "fused, compute_on_cpu", "patched gather"])
@pytest.mark.parametrize("world_size", NCCL_WORLDS)
def test_cpu_held_states_cross_nccl_in_chunks(world_size: int, case: str) -> None:
    run_ranks(_on_nccl, world_size, case, timeout=TIMEOUT)


# --- the fused sync's steady step on CUDA: one collective, at most one device-to-host read ---------------------------


def _steady_fused_sync_on_cuda(rank: int, world_size: int) -> list[tuple[int, int]]:
    import warnings

    from tests._rank_tools import calls
    from torchmetrics_gradpatch import fused as _fused

    dev = device()
    group = dist.group.WORLD
    found = []
    for step in range(4):
        features, target = (t.to(dev) for t in inp.model_inputs(rank, 3 + rank))
        metric = CatSquaredError().to(dev)  # a cat state of uneven sizes, the metric made anew every step
        metric.update(features @ inp.weight().to(dev), target)
        torch.cuda.synchronize()
        before = calls(group)
        torch.cuda.set_sync_debug_mode("warn")  # every synchronizing CUDA call warns
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _fused.fused_sync(metric)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        found.append((calls(group) - before, syncs))
        assert step == 0 or syncs <= 1, (step, syncs, [str(w.message) for w in caught])
        assert metric.errors.device == dev, metric.errors
    return found


@pytest.mark.parametrize("world_size", [max(DEVICES, 1)])
def test_steady_fused_sync_reads_the_device_once(world_size: int) -> None:
    """After the group's first exchange, a fused sync of the same sizes on NCCL costs one collective and at most one
    device-to-host read (``torch.cuda.set_sync_debug_mode`` warns at each synchronizing call)."""
    for found in run_ranks(_steady_fused_sync_on_cuda, world_size, backend="nccl", timeout=TIMEOUT):
        assert [count for count, _ in found[1:]] == [1, 1, 1], found
