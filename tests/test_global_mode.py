"""The "global" gradient mode: exact single-process gradients under DDP, and its plumbing.

Spawned part: every case is a test whose body runs on each of warm pooled gloo ranks (``run_ranks`` of
``tests/_ranks.py``: 2, and 3 with a subgroup of ranks 0 and 2; 1 for the direct gather alone) and checks that
rank against single-process float64 references it builds itself from the same deterministic inputs
(``tests/_global_inputs.py``). The DDP gradient is the average over ranks of each rank's gradient, as DDP's
all-reduce makes it; the ranks' gradients come together through ``all_gather_object``.
The agreement cases (a rank with nothing to sync, a grad-mode disagreement, in-place changes, double backward)
are in ``tests/test_global_agreement.py``.

In-process part, with no process group: mode validation, the state model of ``patch(mode=...)``/
``patched(mode=...)``, ``status()``, the environment variable, and installation on a (faked) native torchmetrics.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchmetrics.utilities.distributed as tm_dist
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

import torchmetrics_gradpatch as tg
from tests import _global_inputs as inp
from tests._global_inputs import assert_rel, global_collectives
from tests._rank_tools import collection_loss, destroy_subgroup, every_rank, record_collectives, synced_state_loss
from tests._ranks import run_ranks
from tests._subprocess import ok, run_python
from tests._workloads import CatSquaredError, SumSquaredError
from torchmetrics_gradpatch import _engine, fused, gather_all_tensors, patched

SUBGROUP = [0, 2]
# all_to_all_single calls issued by one backward of each Metric case (one per state that carries a graph)
BACKWARD_GATHERS = {"collection": 2, "many_states": 3}
# Metric syncs of each case where the fused sync is in force (TORCHMETRICS_GRADPATCH_SYNC=fused; a collection's
# forward syncs its members in one exchange): one exchange each (two all_gathers for the group's first, one or two
# after it), the same in both modes, and one backward all_to_all_single each, whatever its number of states and
# members
FUSED_SYNCS: dict[str, int] = {}


def test_global_collectives_helper() -> None:
    local = ["barrier", "all_gather[(), ()]", "barrier", "all_gather[(1,), (1,)]", "all_gather[(3,), (3,)]"]
    assert global_collectives(local) == [
        "all_gather[(10,), (10,)]",
        "all_gather[(10,), (10,)]",
        "all_gather[(3,), (3,)]",
    ]


# ------------------------------------------------------------------------------------------- gather


def gather_references(case: str, global_ranks: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Single-process gradients for each member's input: (sum of every member's loss, its own loss only)."""
    xs = [inp.gather_input(case, g) for g in global_ranks]
    total = sum(inp.gather_loss([x.contiguous() for x in xs], r) for r in range(len(xs)))
    global_grads = torch.autograd.grad(total, xs)  # type: ignore[arg-type]
    local_grads = [
        torch.autograd.grad(inp.gather_loss([x.contiguous() for x in xs], r), xs[r])[0] for r in range(len(xs))
    ]
    return list(global_grads), local_grads


def check_gather_case(case: str, global_ranks: list[int], group: Any = None, through: str = "direct") -> None:
    """Global vs local gather of one case on this rank: values, collectives, and the gradient of its own loss."""
    member = dist.get_rank(group)
    assert member == global_ranks.index(dist.get_rank()), (member, global_ranks)
    global_ref, local_ref = gather_references(case, global_ranks)
    inputs = [inp.gather_input(case, g).detach().contiguous() for g in global_ranks]
    x = inp.gather_input(case, dist.get_rank())
    seen: dict[str, dict[str, Any]] = {}
    for mode in ("local", "global"):
        x.grad = None
        with record_collectives() as forward_calls:
            if through == "torchmetrics":
                with patched(mode=mode):
                    entries = tm_dist.gather_all_tensors(x, group)
            else:
                entries = gather_all_tensors(x, group, mode=mode)
        loss = inp.gather_loss(entries, member)
        with record_collectives() as backward_calls:
            loss.backward()
        assert x.grad is not None, f"{mode}: no gradient reached the input"
        seen[mode] = {"values": entries, "forward": forward_calls, "backward": backward_calls, "grad": x.grad}
    local, glob = seen["local"], seen["global"]
    # forward: bit-identical to local mode, and to every member's input
    assert len(glob["values"]) == len(inputs), (glob["values"], inputs)
    for got, same, expected in zip(glob["values"], local["values"], inputs, strict=True):
        assert torch.equal(got, same) and torch.equal(got, expected) and got.dtype == same.dtype, (got, same, expected)
    assert [t.dtype for t in glob["values"]] == [t.dtype for t in local["values"]]
    # collectives: local = unpatched (barrier, shapes, data); global drops the barrier, flags ride along
    assert local["forward"][0] == "barrier", local["forward"]
    assert glob["forward"] == global_collectives(local["forward"]), (glob["forward"], local["forward"])
    assert len(glob["forward"]) == (1 if case == "scalar" else 2), glob["forward"]
    assert glob["backward"] == ["all_to_all_single"], glob["backward"]
    assert local["backward"] == [], local["backward"]
    # gradients: global = sum over members of each member's loss gradient; local = own loss only
    assert_rel(glob["grad"], global_ref[member])
    assert_rel(local["grad"], local_ref[member])


def _gather_case(rank: int, world_size: int, case: str, through: str) -> None:
    check_gather_case(case, list(range(world_size)), through=through)


@pytest.mark.parametrize("case", inp.GATHER_CASES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_global_exact_and_forward_identical(world_size: int, case: str) -> None:
    run_ranks(_gather_case, world_size, case, "direct")


@pytest.mark.parametrize("case", ["uneven_rows", "scalar"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_global_through_torchmetrics_and_patched_mode(world_size: int, case: str) -> None:
    """``patched(mode=...)`` around torchmetrics' own gather selects the mode (the trampoline path)."""
    run_ranks(_gather_case, world_size, case, "torchmetrics")


def _subgroup(rank: int, world_size: int) -> None:
    group = dist.new_group(SUBGROUP)  # every rank takes part in creating it
    if rank in SUBGROUP:
        for case in ("equal", "uneven_rows", "scalar"):
            check_gather_case(case, SUBGROUP, group)
    else:
        assert dist.get_rank(group) == -1, dist.get_rank(group)  # rank 1 is outside the group and gathers nothing
    dist.barrier()
    destroy_subgroup(group)


def test_gather_global_subgroup_uses_rank_within_group() -> None:
    """One test for the three shapes, one group for every case; it is destroyed at the end, so the warm ranks stay."""
    run_ranks(_subgroup, 3)


def test_zero_row_rank_is_really_exercised() -> None:
    assert 0 in [inp.gather_input("uneven_rows", r).shape[0] for r in range(3)]
    assert 0 in inp.ROWS["zero_rows"]


# ------------------------------------------------------------------------------------------- metric paths


class ManyStates(Metric):
    """Several gathered states, all with graphs: a sum state, a 1-D cat state and a 2-D cat state."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("sse", default=torch.tensor(0.0, dtype=inp.F64), dist_reduce_fx="sum")
        self.add_state("abs_errors", default=[], dist_reduce_fx="cat")
        self.add_state("pairs", default=[], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.sse = self.sse + ((preds - target) ** 2).sum()
        self.abs_errors.append((preds - target).abs())
        self.pairs.append(torch.stack([preds, target * preds], dim=1))

    def compute(self) -> torch.Tensor:
        pairs = dim_zero_cat(self.pairs)
        return self.sse / 7 + dim_zero_cat(self.abs_errors).mean() + (pairs[:, 0] * pairs[:, 1]).sum() / 5


METRIC_CASES = (
    "forward_sum",
    "forward_cat",
    "sync_sum",
    "sync_cat",
    "sync_dist_default_sum",
    "sync_dist_default_cat",
    "collection",
    "many_states",
)


def metric_loss(case: str, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Run one Metric path (through torchmetrics' own gather) and return the synced loss."""
    if case in ("forward_sum", "forward_cat"):
        metric: Metric = (SumSquaredError if case == "forward_sum" else CatSquaredError)(dist_sync_on_step=True)
        return metric(preds, target)  # type: ignore[no-any-return]
    if case == "collection":
        return collection_loss(preds, target)
    if case == "many_states":
        return ManyStates(dist_sync_on_step=True)(preds, target)  # type: ignore[no-any-return]
    return synced_state_loss(case, preds, target)


def metric_rows(case: str) -> tuple[int, ...]:
    return inp.ROWS["equal"] if case.endswith("sum") else inp.ROWS["uneven"]


def metric_reference(case: str, world_size: int) -> torch.Tensor:
    """Single-process gradient of the global metric loss w.r.t. the shared weight."""
    rows = metric_rows(case)
    data = [inp.model_inputs(r, rows[r]) for r in range(world_size)]
    w = inp.weight().requires_grad_()
    preds = torch.cat([d[0] for d in data]) @ w
    target = torch.cat([d[1] for d in data])
    mse = ((preds - target) ** 2).mean()
    if case == "collection":
        loss = 2 * mse
    elif case == "many_states":
        loss = ((preds - target) ** 2).sum() / 7 + (preds - target).abs().mean() + (preds * target * preds).sum() / 5
    else:
        loss = mse
    (grad,) = torch.autograd.grad(loss, w)
    return grad


def _metric_path(rank: int, world_size: int, case: str) -> None:
    reference = metric_reference(case, world_size)
    seen: dict[str, dict[str, Any]] = {}
    for mode in ("global", "local"):
        fused.reset()  # each mode's fused syncs start as a group's first: the same collectives in both
        features, target = inp.model_inputs(rank, metric_rows(case)[rank])
        w = inp.weight().requires_grad_()
        with patched(mode=mode), record_collectives() as forward_calls:
            sync = tg.status().sync  # the environment's default (TORCHMETRICS_GRADPATCH_SYNC)
            loss = metric_loss(case, features @ w, target)
        with record_collectives() as backward_calls:
            loss.backward()
        assert w.grad is not None, f"{mode}: no gradient reached the weight"
        seen[mode] = {
            "loss": loss.detach(),
            "grad": w.grad,
            "forward": forward_calls,
            "backward": backward_calls,
            "sync": sync,
        }
    glob, local = seen["global"], seen["local"]
    ddp = {mode: torch.stack(every_rank(seen[mode]["grad"])).mean(dim=0) for mode in ("global", "local")}  # type: ignore[arg-type]
    assert_rel(ddp["global"], reference)  # scale 1
    assert_rel(ddp["local"], reference / world_size)  # scale 1 / world size
    assert torch.equal(glob["loss"], local["loss"]), (glob["loss"], local["loss"])  # identical, bit for bit
    assert glob["sync"] == local["sync"], (glob["sync"], local["sync"])
    if glob["sync"] == "fused":
        syncs = FUSED_SYNCS.get(case, 1)
        assert glob["forward"] == local["forward"], (glob["forward"], local["forward"])
        # the group's first exchange takes two all_gathers, each later one two or (its payload inline) one
        assert syncs + 1 <= len(glob["forward"]) <= 2 * syncs, glob["forward"]
        assert all(c.startswith("all_gather") for c in glob["forward"]), glob
        assert glob["backward"] == ["all_to_all_single"] * syncs, glob["backward"]
    else:
        assert glob["forward"] == global_collectives(local["forward"]), (glob["forward"], local["forward"])
        assert "barrier" not in glob["forward"], glob["forward"]
        assert glob["backward"] == ["all_to_all_single"] * BACKWARD_GATHERS.get(case, 1), glob["backward"]
    assert local["backward"] == [], local["backward"]


@pytest.mark.parametrize("case", METRIC_CASES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_metric_paths_global_gives_single_process_gradient(world_size: int, case: str) -> None:
    run_ranks(_metric_path, world_size, case)


# ------------------------------------------------------------------------------------------- contrastive


def contrastive_reference(rows_key: str, world_size: int) -> torch.Tensor:
    """Gradient of the mean over ranks of each rank's contrastive loss (what DDP averages to)."""
    rows = inp.ROWS[rows_key][:world_size]
    p = inp.projection().requires_grad_()
    embeddings = [inp.model_inputs(r, rows[r])[0] @ p for r in range(world_size)]
    everything = torch.cat(embeddings)
    losses = [inp.contrastive_loss(embeddings[r], everything, sum(rows[:r])) for r in range(world_size)]
    (grad,) = torch.autograd.grad(sum(losses) / world_size, p)  # type: ignore[arg-type]
    return grad


def _contrastive(rank: int, world_size: int, rows_key: str) -> None:
    rows = inp.ROWS[rows_key]
    reference = contrastive_reference(rows_key, world_size)
    ddp = {}
    for mode in ("global", "local"):
        p = inp.projection().requires_grad_()
        gathered = gather_all_tensors(inp.model_inputs(rank, rows[rank])[0] @ p, mode=mode)
        inp.contrastive_loss(gathered[rank], torch.cat(gathered), sum(rows[:rank])).backward()
        ddp[mode] = torch.stack(every_rank(p.grad)).mean(dim=0)  # type: ignore[arg-type]
    assert_rel(ddp["global"], reference)
    if sum(n > 0 for n in rows[:world_size]) > 1:  # else there are no cross-rank terms
        error = (ddp["local"] - reference).abs().max().item()
        assert error > 1e-3 * reference.abs().max().item(), "local mode should drop the cross-rank terms"


@pytest.mark.parametrize("rows_key", ["uneven", "zero_rows"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_contrastive_global_exact_local_not(world_size: int, rows_key: str) -> None:
    """Each rank's contrastive loss over every rank's embeddings: global mode's DDP gradient is exact."""
    run_ranks(_contrastive, world_size, rows_key)


# ------------------------------------------------------------------------------------------- mode plumbing


@pytest.fixture
def clean_state(restore_patch_state: None) -> None:
    """The state these tests start from: patch() on in local mode, no blocks (conftest restores what was)."""
    assert _engine._state.blocks == 0 and _engine._state.manual
    tg.patch(mode="local")


def test_mode_is_validated_everywhere() -> None:
    for call in (
        lambda: tg.gather_all_tensors(torch.ones(1), mode="globall"),  # names are case-insensitive, not fuzzy
        lambda: tg.patch(mode="sideways"),
        lambda: tg.patched(mode="grad"),
        lambda: tg.patched(mode=1),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match="'local', 'global'"):
            call()
    assert tg.status().mode == "local"


def test_patched_mode_state_model(clean_state: None) -> None:
    assert tg.status().mode == "local"
    with tg.patched(mode="global"):
        assert tg.status().mode == "global" and _engine._state.mode == "global"
        with tg.patched():  # no mode: keeps the patch in force, never chooses the mode
            assert tg.status().mode == "global"
            with tg.patched(mode="local"):  # the inner block wins until it exits
                assert tg.status().mode == "local"
            assert tg.status().mode == "global"
    assert tg.status().mode == "local"
    tg.patch(mode="global")
    assert tg.status().mode == "global"
    with tg.patched(mode="local"):
        assert tg.status().mode == "local"
    assert tg.status().mode == "global"
    tg.patch()  # no mode: the default mode (TORCHMETRICS_GRADPATCH_MODE unset here: local)
    assert tg.status().mode == "local" and tg.status().default_mode == "local"
    tg.unpatch()
    assert tg.status().mode == "off"
    with tg.patched():
        assert tg.status().mode == "local"


def test_blocks_closing_out_of_order_across_threads(clean_state: None) -> None:
    older, newer = tg.patched(mode="global"), tg.patched(mode="local")
    opened, close = threading.Event(), threading.Event()

    def thread_body() -> None:
        with older:
            opened.set()
            close.wait(10)

    thread = threading.Thread(target=thread_body)
    thread.start()
    assert opened.wait(10)
    assert tg.status().mode == "global"  # process-wide: the other thread's block applies here too
    with newer:
        assert tg.status().mode == "local"
        close.set()
        thread.join(10)
        assert not thread.is_alive()
        assert tg.status().mode == "local"  # the older block closed first: the newer one still decides
    assert tg.status().mode == "local" and _engine._state.block_modes == []


def test_same_instance_reentered_and_decorator(clean_state: None) -> None:
    block = tg.patched(mode="global")
    with block, block:
        assert tg.status().mode == "global"
    assert _engine._state.blocks == 0

    @tg.patched(mode="global")
    def inside() -> str:
        return tg.status().mode

    assert inside() == "global" and tg.status().mode == "local"


def test_global_mode_installs_even_on_native_torchmetrics(clean_state: None, pretend_native: Any) -> None:
    """Local mode on torchmetrics >= 1.6 installs nothing; global mode must install (faked native where it is not)."""
    was_installed = _engine.installed()
    with pretend_native() as was_native:
        assert was_installed == (not was_native)  # patch() is on in local mode here: installed unless native
        assert not _engine.installed() and tg.status().applied_to == ()
        with tg.patched(mode="global"):
            assert _engine.installed() and tg.status().applied_to
            assert "patched" in str(tg.status()) and "gradient mode:    global" in str(tg.status())
        assert not _engine.installed()
    assert _engine._state.native == was_native and _engine.installed() == was_installed


def _world_of_one(rank: int, world_size: int) -> None:
    x = torch.arange(3.0, requires_grad=True)
    (y,) = gather_all_tensors(x, mode="global")
    (3 * y).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [3.0, 3.0, 3.0], x.grad
    assert y is not x and y.requires_grad, y


def test_direct_gather_global_in_a_world_of_one() -> None:
    run_ranks(_world_of_one, 1)


def test_environment_variable_sets_the_import_time_mode() -> None:
    out = ok(
        "import torchmetrics_gradpatch as tg; s = tg.status(); print(s.mode, s.default_mode)",
        env={"TORCHMETRICS_GRADPATCH_MODE": "Global"},
    )
    assert out.split() == ["global", "global"]
    bad = run_python("import torchmetrics_gradpatch", env={"TORCHMETRICS_GRADPATCH_MODE": "sideways"})
    assert bad.returncode != 0
    assert "ValueError: TORCHMETRICS_GRADPATCH_MODE='sideways' is not a gradient mode" in bad.stderr
    assert "local, global" in bad.stderr


def test_grad_mode_mismatch_error_is_public() -> None:
    """Users catch the disagreement error by its public name; it is a RuntimeError like other collective errors."""
    from torchmetrics_gradpatch import _global

    assert tg.GradModeMismatchError is _global.GradModeMismatchError
    assert issubclass(tg.GradModeMismatchError, RuntimeError) and "GradModeMismatchError" in tg.__all__


#: the collection loss's Metric classes, trusted in its rank bodies: its subject is the collection's exchange, not which
#: classes the exchange trusts (tests/test_fused_trust.py)
TRUSTED = (SumSquaredError, CatSquaredError)
