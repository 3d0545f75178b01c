"""The global mode when the ranks do not all do the same thing: a rank with nothing to sync, a rank under
``no_grad``, ranks in different modes or one that skips backward, and entries changed in place or
differentiated twice.

Every case is a test whose body runs on each of warm pooled gloo ranks (2 and 3; ``run_ranks`` of
``tests/_ranks.py``) and checks its own rank against a single-process float64 reference it builds from every
rank's deterministic inputs (``tests/_global_inputs.py``). In the two cases where the ranks must hang, the call's
deadline ends them, on fresh ranks: the deadline starts once they are up, so it need only outlast the work before
the hang, and the ranks' stacks in the error show where each one waits.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchmetrics
from packaging.version import Version
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

import torchmetrics_gradpatch as tg
from tests import _global_inputs as inp
from tests._global_inputs import F64, FEATURES, assert_rel
from tests._rank_tools import EMPTY_CAT_PLACEHOLDER, every_rank, record_collectives
from tests._ranks import STARTUP, RankError, run_ranks
from torchmetrics_gradpatch import gather_all_tensors, patched

# ------------------------------------------------------------------------------- a rank with nothing to sync


class MaskedSquaredError(Metric):
    """A ``cat``-state metric whose ``update`` appends only the masked samples: nothing at all when none is.

    A rank whose mask is all False then syncs torchmetrics' grad-less empty ``torch.tensor([])``.
    """

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("errors", default=[], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        if bool(mask.any()):
            self.errors.append((preds[mask] - target[mask]) ** 2)

    def compute(self) -> torch.Tensor:
        return dim_zero_cat(self.errors).mean()


class MaskedModel(torch.nn.Module):
    """A backbone on every sample and a head on the selected samples only (as a detection head on positives).

    On a rank with nothing selected the head does not run: its parameters are unused there, which is what
    DDP's ``find_unused_parameters=True`` is for. Returns the predictions (zero where not selected) and the
    backbone features.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)  # the same initial weights on every rank and in the reference
        self.backbone = torch.nn.Linear(FEATURES, 4, dtype=F64)
        self.head = torch.nn.Linear(4, 1, dtype=F64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.tanh(self.backbone(x))
        preds = x.new_zeros(x.shape[0])
        if bool(mask.any()):
            preds = preds.masked_scatter(mask, self.head(features[mask]).squeeze(-1))
        return preds, features


AUX_WEIGHT = 0.01  # the per-rank activity penalty that reaches the backbone on every rank under DDP
#: (world size, the rank whose mask is all False): first and last of 2; first, middle and last of 3
EMPTY_RANKS = [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
EMPTY_IDS = ["2-first", "2-last", "3-first", "3-middle", "3-last"]


def masked_inputs(rank: int, empty_rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s features, targets and mask: ``3 + rank`` samples, none selected on ``empty_rank``."""
    gen = torch.Generator().manual_seed(5000 + 100 * step + rank)
    rows = 3 + rank
    x = torch.randn(rows, FEATURES, generator=gen, dtype=F64)
    target = torch.randn(rows, generator=gen, dtype=F64)
    mask = torch.arange(rows) % 2 == 0  # at least one sample selected...
    if rank == empty_rank:
        mask = torch.zeros(rows, dtype=torch.bool)  # ...except on the empty rank
    return x, target, mask


def masked_reference(world_size: int, empty_rank: int, step: int, aux: bool) -> list[torch.Tensor]:
    """Single-process gradient of the synced masked loss over every rank's samples (+ the mean per-rank penalty)."""
    model = MaskedModel()
    data = [masked_inputs(r, empty_rank, step) for r in range(world_size)]
    x, target, mask = (torch.cat([d[i] for d in data]) for i in range(3))
    preds, _ = model(x, mask)
    loss = ((preds[mask] - target[mask]) ** 2).mean()
    if aux:
        features = [model(d[0], d[2])[1] for d in data]
        loss = loss + AUX_WEIGHT * sum((f**2).mean() for f in features) / world_size
    return list(torch.autograd.grad(loss, list(model.parameters())))


def unpatched_empty_rank_forward(rank: int, world_size: int) -> float:
    """The masked metric's forward with rank 0's mask all False, with the patch off (a probe run on 2 ranks)."""
    tg.unpatch()
    metric = MaskedSquaredError(dist_sync_on_step=True).set_dtype(F64)
    preds, target = torch.arange(3.0, dtype=F64), torch.zeros(3, dtype=F64)
    return float(metric(preds, target, torch.full((3,), rank != 0)))


@pytest.fixture(scope="module")
def empty_rank_works() -> str | None:
    """Why the masked cases cannot run here (None where they can): they need what unpatched torchmetrics does.

    Without torchmetrics' empty-state placeholder (before 1.4, or on torch 2.0) it cannot: rank 0 raises "No
    samples to concatenate" in the batch compute of ``forward``, and its peers lose their connection. Elsewhere a
    probe runs it (a failing probe's ranks are ended, and the next call gets new ones).
    """
    if not EMPTY_CAT_PLACEHOLDER:  # the masked cases cannot run, with or without this package
        old_line = Version(torchmetrics.__version__).release < (1, 4)
        why = "torchmetrics < 1.4" if old_line else "on torch 2.0 torchmetrics"
        return (
            f"{why} does not sync an empty list state (the rank skips that gather, so the ranks' collectives "
            "mismatch with or without this package)"
        )
    try:
        run_ranks(unpatched_empty_rank_forward, 2)
    except RankError:
        return (
            f"unpatched torchmetrics {torchmetrics.__version__} fails a rank with no samples itself on torch "
            f"{torch.__version__} (its forward raises there)"
        )
    return None


def masked_step(model: torch.nn.Module, net: torch.nn.Module, empty: int, step: int, ddp: bool) -> dict[str, Any]:
    """One ``loss = metric(p, t, mask); loss.backward()`` on this rank, its mask all False on rank ``empty``."""
    x, target, mask = masked_inputs(dist.get_rank(), empty, step)
    model.zero_grad(set_to_none=True)
    metric = MaskedSquaredError(dist_sync_on_step=True).set_dtype(F64)
    with patched(mode="global"), record_collectives() as forward_calls:
        sync = tg.status().sync  # the environment's default (TORCHMETRICS_GRADPATCH_SYNC)
        preds, features = net(x, mask)
        loss = metric(preds, target, mask)
    if ddp:
        loss = loss + AUX_WEIGHT * (features**2).mean()
    with record_collectives() as backward_calls:
        loss.backward()  # on every rank, the empty one included
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return {
        "loss": loss.detach(),
        "graph": loss.grad_fn is not None,
        "grads": grads,
        "fwd": forward_calls,
        "bwd": backward_calls,
        "sync": sync,
    }


def _nothing_to_sync(rank: int, world_size: int, empty: int) -> None:
    model = MaskedModel()
    out = masked_step(model, model, empty, 0, ddp=False)
    assert out["graph"], f"rank {rank}"
    losses = every_rank(out["loss"])
    assert all(torch.equal(v, losses[0]) for v in losses), losses  # type: ignore[arg-type]
    # one cat state: the header, then the data; no barrier. One backward collective on every rank.
    # The fused sync (TORCHMETRICS_GRADPATCH_SYNC=fused): its description exchange, then the payload (each an
    # all_gather_single where torch has it).
    gather = "all_gather[" if out["sync"] == "torchmetrics" else "all_gather"
    assert len(out["fwd"]) == 2 and all(c.startswith(gather) for c in out["fwd"]), out["fwd"]
    if out["sync"] == "torchmetrics":
        assert out["fwd"][0].startswith("all_gather[(10,)"), out["fwd"]
    assert out["bwd"] == ["all_to_all_single"], f"rank {rank}"
    if rank == empty:  # the empty rank's loss reaches no parameter of its own (really exercised)
        assert all(g is None for g in out["grads"]), out["grads"]
    reference = masked_reference(world_size, empty, 0, aux=False)
    per_rank = every_rank(out["grads"])
    for i, ref in enumerate(reference):  # the ranks' gradients add up to world_size x the single-process one
        total = sum(torch.zeros_like(ref) if grads[i] is None else grads[i] for grads in per_rank)  # type: ignore[index]
        assert_rel(total, world_size * ref)  # type: ignore[arg-type]


@pytest.mark.parametrize(("world_size", "empty"), EMPTY_RANKS, ids=EMPTY_IDS)
def test_rank_with_nothing_to_sync_still_joins_the_backward(
    world_size: int, empty: int, empty_rank_works: str | None
) -> None:
    """One rank's mask is all False; every rank's ``loss.backward()`` completes, gradients exact."""
    if empty_rank_works is not None:
        pytest.skip(empty_rank_works)
    run_ranks(_nothing_to_sync, world_size, empty)


def _nothing_to_sync_under_ddp(rank: int, world_size: int, empty: int) -> None:
    model = MaskedModel()
    net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    for step in range(2):
        out = masked_step(model, net, empty, step, ddp=True)
        assert out["graph"], f"rank {rank} step {step}"
        for got, ref in zip(out["grads"], masked_reference(world_size, empty, step, aux=True), strict=True):
            assert got is not None, f"rank {rank} step {step}"
            assert_rel(got, ref)
    del net


@pytest.mark.parametrize(("world_size", "empty"), EMPTY_RANKS, ids=EMPTY_IDS)
def test_rank_with_nothing_to_sync_under_ddp(world_size: int, empty: int, empty_rank_works: str | None) -> None:
    """Under DDP (``find_unused_parameters=True``: the empty rank's head does not run) every rank, every step,
    holds exactly the single-process gradient."""
    if empty_rank_works is not None:
        pytest.skip(empty_rank_works)
    run_ranks(_nothing_to_sync_under_ddp, world_size, empty)


# ------------------------------------------------------------------------------- ranks that disagree


def _grad_mode_disagreement(rank: int, world_size: int, case: str) -> None:
    for culprit in range(world_size):
        # the metric gets samples on every rank: without torchmetrics' placeholder a rank with none cannot sync
        x = inp.gather_input({"direct": "uneven_rows", "scalar": "scalar", "metric": "uneven_all_dims"}[case], rank)
        context = torch.no_grad() if rank == culprit else torch.enable_grad()
        verb = "gathered"
        with pytest.raises(tg.GradModeMismatchError) as caught, context, record_collectives() as calls:
            if case == "metric":
                metric = MaskedSquaredError(dist_sync_on_step=True).set_dtype(F64)
                with patched(mode="global"):
                    # the fused sync (TORCHMETRICS_GRADPATCH_SYNC=fused) checks the whole sync, not each gather
                    verb = "synced" if tg.status().sync == "fused" else verb
                    metric(x.reshape(-1), torch.zeros(x.numel(), dtype=F64), torch.ones(x.numel(), dtype=bool))
            else:
                gather_all_tensors(x, mode="global")
        message = str(caught.value)
        others = [r for r in range(world_size) if r != culprit]
        assert isinstance(caught.value, RuntimeError), type(caught.value)
        assert f"Rank(s) [{culprit}] {verb} with grad mode off" in message, message
        assert f"rank(s) {others} with it on" in message, message
        assert "same grad mode on every rank" in message and "none is left waiting" in message, message
        # raised right after the first exchange, before the data: every rank issued the same one collective
        assert len(calls) == 1 and calls[0].startswith("all_gather"), calls
    # the group is still in step: a gather after the errors gives every rank's input
    entries = gather_all_tensors(inp.gather_input("uneven_rows", rank), mode="global")
    inp.gather_loss(entries, rank).backward()
    inputs = [inp.gather_input("uneven_rows", r).detach() for r in range(world_size)]
    assert all(torch.equal(a, b) for a, b in zip(entries, inputs, strict=True)), (entries, inputs)


@pytest.mark.parametrize("case", ["direct", "scalar", "metric"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_mode_disagreement_raises_on_every_rank(world_size: int, case: str) -> None:
    """One rank gathers under ``torch.no_grad()`` while the others gather a tensor that requires grad: every rank
    raises, from the gather itself, after the first exchange; the group is still in step afterwards."""
    run_ranks(_grad_mode_disagreement, world_size, case)


def _no_node(rank: int, world_size: int, case: str, how: str) -> None:
    x = inp.gather_input(case, rank)
    with record_collectives() as calls:
        if how == "no_requires_grad":
            entries = gather_all_tensors(x.detach(), mode="global")
        else:
            with torch.no_grad():
                entries = gather_all_tensors(x, mode="global")
    inputs = [inp.gather_input(case, r).detach() for r in range(world_size)]
    assert [t.grad_fn is not None for t in entries] == [False] * world_size, entries  # no node (own: the input)
    assert [t.requires_grad for j, t in enumerate(entries) if j != rank] == [False] * (world_size - 1), entries
    assert all(torch.equal(a, b) for a, b in zip(entries, inputs, strict=True)), (entries, inputs)
    assert len(calls) == (1 if case == "scalar" else 2), calls
    assert "barrier" not in calls, calls


@pytest.mark.parametrize("how", ["no_requires_grad", "all_no_grad"])
@pytest.mark.parametrize("case", ["uneven_rows", "scalar"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_no_node_when_nothing_requires_grad_or_grad_is_off_everywhere(world_size: int, case: str, how: str) -> None:
    run_ranks(_no_node, world_size, case, how)


def mixed_modes(rank: int, world_size: int) -> list[tuple[int, ...]]:
    """Rank 0 gathers in local mode, the others in global mode: their collectives do not match."""
    x = inp.gather_input("uneven_rows", rank)
    return [tuple(t.shape) for t in gather_all_tensors(x, mode="local" if rank == 0 else "global")]


def skip_backward(rank: int, world_size: int, hang_seconds: float) -> str:
    """Rank 1 gathers in global mode but never runs backward; rank 0 does, and waits for rank 1 forever."""
    entries = gather_all_tensors(inp.gather_input("uneven_rows", rank), mode="global")
    if rank == 1:
        time.sleep(hang_seconds)  # "moves on" without backward, like a rank that skipped the step
        return "skipped"
    inp.gather_loss(entries, rank).backward()
    return "finished"


#: The deadline of a run that hangs, counted from when the ranks have joined their group. Before the hang, a rank
#: runs one gather (and rank 0 its backward): well under a second at load 10 on 2 cores.
HANG_TIMEOUT = 3.0
#: How long after it the error may come: the ranks' start (spawn, imports, the group: up to run_ranks' STARTUP),
#: the stack dump (1 s) and the end of the pool; still far below the 120 s that rank 1 of skip_backward sleeps.
GRACE = 10.0 + STARTUP


def times_out(fn: Any, *args: Any) -> str:
    """The :class:`RankError` message of ``fn(rank, 2, *args)`` on 2 ranks, raised in time after
    :data:`HANG_TIMEOUT`; each rank is named as not finished, with its stack.

    Fresh ranks: they are ended at the deadline inside a gloo collective (and their deadline starts once they are
    up, so a new pool's start counts against no test).
    """
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(fn, 2, *args, timeout=HANG_TIMEOUT, fresh=True)
    elapsed = time.monotonic() - start
    assert HANG_TIMEOUT <= elapsed < HANG_TIMEOUT + GRACE, elapsed  # the call waited for no rank's sleep to end
    message = str(caught.value)
    for rank in (0, 1):
        assert f"rank {rank} of 2 (pid " in message, message
        assert f"did not finish {fn.__name__} in {HANG_TIMEOUT:g} s" in message, message
    return message


def stack_of(message: str, rank: int) -> str:
    """The stack that a :class:`RankError` message shows for ``rank`` (one that did not finish)."""
    return message.split(f"rank {rank} of 2 (pid ")[1].split("its stack:", 1)[1].split("\n\nrank ", 1)[0]


def test_rank_that_skips_backward_is_caught_by_the_runner_timeout() -> None:
    message = times_out(skip_backward, 120.0)
    # rank 1 is the one its peer waits for: it is in skip_backward, not inside a collective
    skipping, waiting = stack_of(message, 1), stack_of(message, 0)
    assert "in skip_backward" in skipping and "all_to_all_single" not in skipping, skipping
    # rank 0 got as far as the backward and is stuck in its collective (not still starting up)
    assert "in skip_backward" in waiting and "in backward" in waiting, waiting
    assert "in all_to_all_single" in waiting, waiting


def test_ranks_in_different_modes_wait_until_the_timeout() -> None:
    """What the README says of mixing modes: the forward collectives differ, nothing detects it, the ranks wait.

    (Local mode must keep the unpatched gather's collectives, so it cannot carry a mode check.)
    """
    message = times_out(mixed_modes)
    assert "gather_local" in message or "gather_global" in message, message


# ------------------------------------------------------------------------------- entries like torch's gather

#: the entry each rank modifies in place: its own, the next rank's, and entry 0 everywhere
INPLACE_TARGETS = ("own", "next", "zero")


def inplace_index(target: str, rank: int, world_size: int) -> int:
    return {"own": rank, "next": (rank + 1) % world_size, "zero": 0}[target]


def modified_loss(entries: list[torch.Tensor], rank: int, index: int) -> torch.Tensor:
    """``entries[index].mul_(2)`` then ``add_(1)``, then the gather loss: what every rank computes."""
    entries[index].mul_(2).add_(1)
    return inp.gather_loss(entries, rank)


def _inplace(rank: int, world_size: int, case: str, target: str) -> None:
    x = inp.gather_input(case, rank)
    modified_loss(gather_all_tensors(x, mode="global"), rank, inplace_index(target, rank, world_size)).backward()
    # single-process: every rank modifies its copy of the gathered entries, then sums its loss's gradient
    xs = [inp.gather_input(case, r) for r in range(world_size)]
    total = sum(
        modified_loss([x.clone() for x in xs], r, inplace_index(target, r, world_size)) for r in range(world_size)
    )
    (reference,) = torch.autograd.grad(total, xs[rank])
    assert x.grad is not None, "no gradient reached the input"
    assert_rel(x.grad, reference)


@pytest.mark.parametrize("target", INPLACE_TARGETS)
@pytest.mark.parametrize("case", ["equal", "uneven_rows", "scalar"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_inplace_change_to_any_entry_is_allowed_on_every_rank(world_size: int, case: str, target: str) -> None:
    """Like torch's all_gather: ``g[j].mul_(2)`` works on every rank for every ``j``, with exact gradients."""
    run_ranks(_inplace, world_size, case, target)


def double_backward(x: torch.Tensor, entries: list[torch.Tensor]) -> torch.Tensor:
    (first,) = torch.autograd.grad(inp.gather_loss(entries, dist.get_rank()), x, create_graph=True)
    (first**2).sum().backward()
    assert x.grad is not None, "no gradient reached the input"
    return x.grad


def _double_backward(rank: int, world_size: int, case: str) -> None:
    # single-process: rank r's first-order gradient is sum_q dL_q/dx_r; the second loss sums its squares
    xs = [inp.gather_input(case, r) for r in range(world_size)]
    total = sum(inp.gather_loss([x.contiguous() for x in xs], r) for r in range(world_size))
    firsts = torch.autograd.grad(total, xs, create_graph=True)  # type: ignore[arg-type]
    (reference,) = torch.autograd.grad(sum((first**2).sum() for first in firsts), xs[rank])  # type: ignore[arg-type]
    x = inp.gather_input(case, rank)
    grad = double_backward(x, gather_all_tensors(x, mode="global"))
    assert_rel(grad, reference)
    if case == "equal":  # the same as torch's own differentiable all_gather, where it runs
        import torch.distributed.nn.functional as dist_nn

        try:
            y = inp.gather_input(case, rank)
            with warnings.catch_warnings():  # torch 2.13 deprecates it (a FutureWarning at every call)
                warnings.simplefilter("ignore", FutureWarning)
                theirs: torch.Tensor | None = double_backward(y, list(dist_nn.all_gather(y)))
        except Exception:
            theirs = None
        ran = every_rank(theirs is not None)
        if all(ran):
            assert_rel(grad, theirs)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", ["equal", "uneven_rows", "scalar"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_double_backward_gives_exact_second_order_gradients(world_size: int, case: str) -> None:
    run_ranks(_double_backward, world_size, case)
