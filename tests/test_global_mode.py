"""The "global" gradient mode (issues 6 and 12): exact single-process gradients under DDP, agreement, plumbing.

Spawned part: each world size (2, and 3 with a subgroup of ranks 0 and 2) is spawned once for the gradient cases
and once for the agreement cases of issue 12 (a rank without a graph, a grad-mode disagreement) in
``tests/_global_ranks.py``; the tests below compare what the ranks returned with single-process float64
references built here from the same deterministic inputs. The DDP gradient is the average over ranks of each
rank's gradient, as DDP's all-reduce makes it.

In-process part: mode validation, the state model of ``patch(mode=...)``/``patched(mode=...)``, ``status()``,
the environment variable, and installation on a (faked) native torchmetrics.
"""

from __future__ import annotations

import ast
import threading
import time
from typing import Any

import pytest
import torch
import torchmetrics

import torchmetrics_gradpatch as tg
from tests import _global_ranks as ranks
from tests._subprocess import WORLD_OF_ONE, ok, run_python
from torchmetrics_gradpatch import _engine
from torchmetrics_gradpatch.testing import RankError, spawn_ranks

WORLD_SIZES = (2, 3)  # a world of one runs in a plain subprocess below (a spawn costs seconds)
SUBGROUP = [0, 2]
RTOL = 1e-12
#: int64 words of global mode's header exchange, the same on every rank whatever its tensor
HEADER_WORDS = 10
# all_to_all_single calls issued by one backward of each Metric case (one per state that carries a graph)
BACKWARD_GATHERS = {"collection": 2, "many_states": 3}


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    """``actual`` equals ``expected`` to ``rtol`` relative to the largest magnitude in ``expected``."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.numel() == 0:
        return
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= rtol * max(scale, 1e-300), f"max error {error:.3e} vs scale {scale:.3e}"


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, Any]]]:
    return {
        world_size: spawn_ranks(
            ranks.run_all, world_size, args=(world_size, SUBGROUP if world_size == 3 else None), timeout=180
        )
        for world_size in WORLD_SIZES
    }


@pytest.fixture(scope="module")
def empty_rank_works() -> str | None:
    """Why the masked cases cannot run here (None where they can): they need what unpatched torchmetrics does."""
    if not ranks.EMPTY_STATE_SYNCED:
        return (
            "torchmetrics < 1.4 does not sync an empty list state (the rank skips that gather, so the ranks' "
            "collectives mismatch with or without this package)"
        )
    try:
        spawn_ranks(ranks.unpatched_empty_rank_forward, 2, timeout=120)
    except RankError:
        return (
            f"unpatched torchmetrics {torchmetrics.__version__} fails a rank with no samples itself on torch "
            f"{torch.__version__} (its forward raises there)"
        )
    return None


@pytest.fixture(scope="module")
def agreement(empty_rank_works: str | None) -> dict[int, list[dict[str, Any]]]:
    masked = empty_rank_works is None
    return {
        world_size: spawn_ranks(ranks.run_agreement, world_size, args=(world_size, masked), timeout=240)
        for world_size in WORLD_SIZES
    }


def global_collectives(local: list[str]) -> list[str]:
    """The forward collectives global mode issues for the gathers whose local-mode collectives are ``local``.

    Local mode (= unpatched torchmetrics) issues, per gather, ``barrier`` then, for a scalar, the data; for a
    non-scalar, the shapes, then the data. Global mode drops the barrier and sends, in place of the shapes, a
    header of :data:`HEADER_WORDS` int64 words whatever the tensor (status, flags, dtype, ndim, then the shape or,
    for a scalar, its bytes: a scalar's gather is that one exchange). Every tensor here has at most six dims.
    """
    out: list[str] = []
    gathers: list[list[str]] = []
    for call in local:
        if call == "barrier":
            gathers.append([])
        else:
            gathers[-1].append(call)
    for calls in gathers:
        shapes = ast.literal_eval(calls[0][len("all_gather") :])
        out.append(f"all_gather{[(HEADER_WORDS,)] * len(shapes)}")
        if len(calls) == 1:  # a scalar: its value rides in the header
            assert all(shape == () for shape in shapes)
        else:
            out.append(calls[1])
    return out


def test_global_collectives_helper() -> None:
    local = ["barrier", "all_gather[(), ()]", "barrier", "all_gather[(1,), (1,)]", "all_gather[(3,), (3,)]"]
    assert global_collectives(local) == [
        "all_gather[(10,), (10,)]",
        "all_gather[(10,), (10,)]",
        "all_gather[(3,), (3,)]",
    ]


# ------------------------------------------------------------------------------------------- references


def _gather_references(case: str, global_ranks: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Single-process gradients for each member's input: (sum of every member's loss, its own loss only)."""
    xs = [ranks.gather_input(case, g) for g in global_ranks]
    total = sum(ranks.gather_loss([x.contiguous() for x in xs], r) for r in range(len(xs)))
    global_grads = torch.autograd.grad(total, xs)  # type: ignore[arg-type]
    local_grads = [
        torch.autograd.grad(ranks.gather_loss([x.contiguous() for x in xs], r), xs[r])[0] for r in range(len(xs))
    ]
    return list(global_grads), local_grads


def _metric_reference(case: str, world_size: int) -> torch.Tensor:
    """Single-process gradient of the global metric loss w.r.t. the shared weight."""
    rows = ranks.metric_rows(case)
    data = [ranks.model_inputs(r, rows[r]) for r in range(world_size)]
    w = ranks.weight().requires_grad_()
    features = torch.cat([d[0] for d in data])
    target = torch.cat([d[1] for d in data])
    (grad,) = torch.autograd.grad(ranks.reference_metric_loss(case, features @ w, target), w)
    return grad


def _contrastive_reference(rows_key: str, world_size: int) -> torch.Tensor:
    """Gradient of the mean over ranks of each rank's contrastive loss (what DDP averages to)."""
    rows = ranks.ROWS[rows_key][:world_size]
    p = ranks.projection().requires_grad_()
    embeddings = [ranks.model_inputs(r, rows[r])[0] @ p for r in range(world_size)]
    everything = torch.cat(embeddings)
    losses = [ranks.contrastive_loss(embeddings[r], everything, sum(rows[:r])) for r in range(world_size)]
    (grad,) = torch.autograd.grad(sum(losses) / world_size, p)  # type: ignore[arg-type]
    return grad


def _ddp(per_rank: list[dict[str, Any]]) -> torch.Tensor:
    return torch.stack([r["grad"] for r in per_rank]).mean(dim=0)


# ------------------------------------------------------------------------------------------- gather


def _check_gather_case(per_member: list[dict[str, Any]], case: str, global_ranks: list[int]) -> None:
    global_ref, local_ref = _gather_references(case, global_ranks)
    inputs = [ranks.gather_input(case, g).detach().contiguous() for g in global_ranks]
    for member, out in enumerate(per_member):
        assert out["group_rank"] == member
        local, glob = out["local"], out["global"]
        # forward: bit-identical to local mode, and to every member's input
        assert len(glob["values"]) == len(inputs)
        for got, same, expected in zip(glob["values"], local["values"], inputs, strict=True):
            assert torch.equal(got, same) and torch.equal(got, expected) and got.dtype == same.dtype
        assert glob["dtypes"] == local["dtypes"]
        # collectives: local = unpatched (barrier, shapes, data); global drops the barrier, flags ride along
        assert local["forward_collectives"][0] == "barrier"
        assert glob["forward_collectives"] == global_collectives(local["forward_collectives"])
        assert len(glob["forward_collectives"]) == (1 if case == "scalar" else 2)
        assert glob["backward_collectives"] == ["all_to_all_single"]
        assert local["backward_collectives"] == []
        # gradients: global = sum over members of each member's loss gradient; local = own loss only
        assert_rel(glob["grad"], global_ref[member])
        assert_rel(local["grad"], local_ref[member])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", ranks.GATHER_CASES)
def test_gather_global_exact_and_forward_identical(
    results: dict[int, list[dict[str, Any]]], world_size: int, case: str
) -> None:
    per_rank = [r["gather"][case] for r in results[world_size]]
    _check_gather_case(per_rank, case, list(range(world_size)))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", ["uneven_rows", "scalar"])
def test_gather_global_through_torchmetrics_and_patched_mode(
    results: dict[int, list[dict[str, Any]]], world_size: int, case: str
) -> None:
    """``patched(mode=...)`` around torchmetrics' own gather selects the mode (the trampoline path)."""
    per_rank = [r["gather_via_torchmetrics"][case] for r in results[world_size]]
    _check_gather_case(per_rank, case, list(range(world_size)))


@pytest.mark.parametrize("case", ["equal", "uneven_rows", "scalar"])
def test_gather_global_subgroup_uses_rank_within_group(results: dict[int, list[dict[str, Any]]], case: str) -> None:
    per_rank = results[3]
    assert "subgroup" not in per_rank[1]
    _check_gather_case([per_rank[g]["subgroup"][case] for g in SUBGROUP], case, SUBGROUP)


def test_zero_row_rank_is_really_exercised() -> None:
    assert 0 in [ranks.gather_input("uneven_rows", r).shape[0] for r in range(3)]
    assert 0 in ranks.ROWS["zero_rows"]


# ------------------------------------------------------------------------------------------- metric paths


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", ranks.METRIC_CASES)
def test_metric_paths_global_gives_single_process_gradient(
    results: dict[int, list[dict[str, Any]]], world_size: int, case: str
) -> None:
    reference = _metric_reference(case, world_size)
    glob = [r["metric"][(case, "global")] for r in results[world_size]]
    local = [r["metric"][(case, "local")] for r in results[world_size]]
    assert_rel(_ddp(glob), reference)  # scale 1
    assert_rel(_ddp(local), reference / world_size)  # scale 1 / world size
    for g, loc in zip(glob, local, strict=True):
        assert torch.equal(g["loss"], loc["loss"])  # the synced values are identical, bit for bit
        assert g["forward_collectives"] == global_collectives(loc["forward_collectives"])
        assert "barrier" not in g["forward_collectives"]
        assert g["backward_collectives"] == ["all_to_all_single"] * BACKWARD_GATHERS.get(case, 1)
        assert loc["backward_collectives"] == []


# ------------------------------------------------------------------------------------------- contrastive


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("rows_key", ["uneven", "zero_rows"])
def test_contrastive_global_exact_local_not(
    results: dict[int, list[dict[str, Any]]], world_size: int, rows_key: str
) -> None:
    reference = _contrastive_reference(rows_key, world_size)
    glob = [r["contrastive"][("global", rows_key)] for r in results[world_size]]
    local = [r["contrastive"][("local", rows_key)] for r in results[world_size]]
    assert_rel(_ddp(glob), reference)
    if sum(rows > 0 for rows in ranks.ROWS[rows_key][:world_size]) > 1:  # else there are no cross-rank terms
        error = (_ddp(local) - reference).abs().max().item()
        assert error > 1e-3 * reference.abs().max().item(), "local mode should drop the cross-rank terms"


# ------------------------------------------------------------------------------------------- agreement


#: (world size, the rank whose mask is all False): first and last of 2; first, middle and last of 3
EMPTY_RANKS = [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
EMPTY_IDS = ["2-first", "2-last", "3-first", "3-middle", "3-last"]


def _masked_reference(world_size: int, empty_rank: int, step: int, aux: bool) -> list[torch.Tensor]:
    """Single-process gradient of the synced masked loss over every rank's samples (+ the mean per-rank penalty)."""
    model = ranks.MaskedModel()
    data = [ranks.masked_inputs(r, empty_rank, step) for r in range(world_size)]
    x, target, mask = (torch.cat([d[i] for d in data]) for i in range(3))  # type: ignore[index]
    preds, _ = model(x, mask)
    loss = ((preds[mask] - target[mask]) ** 2).mean()
    if aux:
        features = [model(d[0], d[2])[1] for d in data]
        loss = loss + ranks.AUX_WEIGHT * sum((f**2).mean() for f in features) / world_size
    return list(torch.autograd.grad(loss, list(model.parameters())))


@pytest.mark.parametrize(("world_size", "empty"), EMPTY_RANKS, ids=EMPTY_IDS)
def test_rank_with_nothing_to_sync_still_joins_the_backward(
    agreement: dict[int, list[dict[str, Any]]], world_size: int, empty: int, empty_rank_works: str | None
) -> None:
    """Issue 12's hang: one rank's mask is all False; every rank's ``loss.backward()`` completes, gradients exact."""
    if empty_rank_works is not None:
        pytest.skip(empty_rank_works)
    reference = _masked_reference(world_size, empty, 0, aux=False)
    per_rank = [r["masked"][(empty, False)]["steps"][0] for r in agreement[world_size]]
    for rank, out in enumerate(per_rank):
        assert out["loss_has_graph"], f"rank {rank}"
        assert torch.equal(out["loss"], per_rank[0]["loss"])
        # one cat state: the header, then the data; no barrier. One backward collective on every rank.
        assert len(out["forward_collectives"]) == 2 and out["forward_collectives"][0].startswith("all_gather[(10,)")
        assert out["backward_collectives"] == ["all_to_all_single"], f"rank {rank}"
    # the empty rank's loss reaches no parameter of its own: its gradients stay None (really exercised)
    assert all(g is None for g in per_rank[empty]["grads"])
    total = [
        sum(torch.zeros_like(ref) if out["grads"][i] is None else out["grads"][i] for out in per_rank)
        for i, ref in enumerate(reference)
    ]
    for got, ref in zip(total, reference, strict=True):
        assert_rel(got, world_size * ref)  # the ranks' gradients add up to world_size x the single-process one


@pytest.mark.parametrize(("world_size", "empty"), EMPTY_RANKS, ids=EMPTY_IDS)
def test_rank_with_nothing_to_sync_under_ddp(
    agreement: dict[int, list[dict[str, Any]]], world_size: int, empty: int, empty_rank_works: str | None
) -> None:
    """Under DDP (``find_unused_parameters=True``: the empty rank's head does not run) every rank, every step,
    holds exactly the single-process gradient."""
    if empty_rank_works is not None:
        pytest.skip(empty_rank_works)
    per_rank = [r["masked"][(empty, True)]["steps"] for r in agreement[world_size]]
    for step in range(len(per_rank[0])):
        reference = _masked_reference(world_size, empty, step, aux=True)
        for rank in range(world_size):
            out = per_rank[rank][step]
            assert out["loss_has_graph"]
            for got, ref in zip(out["grads"], reference, strict=True):
                assert got is not None, f"rank {rank} step {step}"
                assert_rel(got, ref)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_grad_mode_disagreement_raises_on_every_rank(
    agreement: dict[int, list[dict[str, Any]]], world_size: int
) -> None:
    per_rank = [r["disagreement"] for r in agreement[world_size]]
    for (culprit, case), _ in per_rank[0]["errors"].items():
        for rank, out in enumerate(per_rank):
            found = out["errors"][(culprit, case)]
            assert found is not None, f"rank {rank} did not raise ({case}, rank {culprit} under no_grad)"
            name, message, calls = found
            others = [r for r in range(world_size) if r != culprit]
            assert name == "GradModeMismatchError"
            assert f"Rank(s) [{culprit}] gathered with grad mode off" in message, message
            assert f"rank(s) {others} with it on" in message, message
            assert "same grad mode on every rank" in message and "none is left waiting" in message
            # raised right after the first exchange, before the data: every rank issued the same one collective
            assert len(calls) == 1 and calls[0].startswith("all_gather"), calls
    # the group is still in step: a gather after the errors gives every rank's input
    inputs = [ranks.gather_input("uneven_rows", r).detach() for r in range(world_size)]
    for out in per_rank:
        assert all(torch.equal(a, b) for a, b in zip(out["after"], inputs, strict=True))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_node_when_nothing_requires_grad_or_grad_is_off_everywhere(
    agreement: dict[int, list[dict[str, Any]]], world_size: int
) -> None:
    for case in ("uneven_rows", "scalar"):
        inputs = [ranks.gather_input(case, r).detach() for r in range(world_size)]
        for how in ("no_requires_grad", "all_no_grad"):
            for out in (r["no_node"][(case, how)] for r in agreement[world_size]):
                assert out["has_graph"] == [False] * world_size  # no node (own entry: the input itself)
                assert out["others_require_grad"] == [False] * (world_size - 1)
                assert all(torch.equal(a, b) for a, b in zip(out["values"], inputs, strict=True))
                assert len(out["collectives"]) == (1 if case == "scalar" else 2)
                assert "barrier" not in out["collectives"]


# ------------------------------------------------------------------------------------------- safety


def test_rank_that_skips_backward_is_caught_by_the_runner_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        # 20 s: on a loaded 2-core machine two ranks can take over 10 s just to import torch and connect
        spawn_ranks(ranks.skip_backward, 2, args=(120.0,), timeout=20)
    assert time.monotonic() - start < 40
    err = caught.value
    assert err.rank == 0 and err.reason == "timed out", err
    # rank 0 got as far as the backward and was stuck there (not still starting up)
    assert "skip_backward" in err.details and "backward" in err.details


def test_ranks_in_different_modes_wait_until_the_timeout() -> None:
    """What the README says of mixing modes: the forward collectives differ, nothing detects it, the ranks wait.

    (Local mode must keep the unpatched gather's collectives, so it cannot carry a mode check.)
    """
    with pytest.raises(RankError) as caught:
        spawn_ranks(ranks.mixed_modes, 2, timeout=20)
    assert caught.value.reason == "timed out", caught.value
    assert "gather_local" in caught.value.details or "gather_global" in caught.value.details, caught.value


# ------------------------------------------------------------------------------------------- mode plumbing


@pytest.fixture
def clean_state() -> Any:
    """The state these tests start from and must restore: patch() on in local mode, no blocks."""
    assert _engine._state.blocks == 0 and _engine._state.manual
    tg.patch(mode="local")
    yield
    while _engine._state.blocks:
        _engine.exit_block()
    tg.patch()
    assert tg.status().mode == "local"


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


def test_global_mode_installs_even_on_native_torchmetrics(clean_state: None) -> None:
    """Local mode on torchmetrics >= 1.6 installs nothing; global mode must install (faked native where it is not).

    The engine's ``native`` flag is restored to what it was, not forced to ``False`` (on torchmetrics 1.9 forcing
    it would leak a wrongly installed trampoline into every later test).
    """
    was_native = _engine._state.native
    was_installed = _engine.installed()
    assert was_installed == (not was_native)  # patch() is on in local mode here: installed unless native
    with _engine._lock:
        _engine._state.native = True
        _engine._sync()
    try:
        assert not _engine.installed() and tg.status().applied_to == ()
        with tg.patched(mode="global"):
            assert _engine.installed() and tg.status().applied_to
            assert "patched" in str(tg.status()) and "gradient mode:    global" in str(tg.status())
        assert not _engine.installed()
    finally:
        with _engine._lock:
            _engine._state.native = was_native
            _engine._sync()
    assert _engine._state.native == was_native and _engine.installed() == was_installed


def test_direct_gather_global_in_a_world_of_one() -> None:
    out = ok(
        WORLD_OF_ONE
        + """
from torchmetrics_gradpatch import gather_all_tensors
x = torch.arange(3.0, requires_grad=True)
(y,) = gather_all_tensors(x, mode="global")
(3 * y).sum().backward()
print(x.grad.tolist(), y is x, y.requires_grad)
"""
    )
    # the last line: gloo on torch 2.8 and newer prints its own "[Gloo] Rank 0 is connected ..." lines first
    assert out.strip().splitlines()[-1].split() == ["[3.0,", "3.0,", "3.0]", "False", "True"]


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


# ------------------------------------------------------------------------------- entries like torch's (issue 17)


@pytest.fixture(scope="module")
def entries() -> dict[int, list[dict[str, Any]]]:
    return {n: spawn_ranks(ranks.run_entries, n, args=(n,), timeout=180) for n in WORLD_SIZES}


def _inplace_reference(case: str, target: str, world_size: int) -> list[torch.Tensor]:
    """Single-process: every rank modifies its copy of the gathered entries, then sums its loss's gradient."""
    xs = [ranks.gather_input(case, r) for r in range(world_size)]
    total = sum(
        ranks.modified_loss([x.clone() for x in xs], r, ranks.inplace_index(target, r, world_size))
        for r in range(world_size)
    )
    return list(torch.autograd.grad(total, xs))  # type: ignore[arg-type]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("target", ranks.INPLACE_TARGETS)
@pytest.mark.parametrize("case", ranks.INPLACE_SHAPES)
def test_inplace_change_to_any_entry_is_allowed_on_every_rank(
    entries: dict[int, list[dict[str, Any]]], world_size: int, target: str, case: str
) -> None:
    """Like torch's all_gather: ``g[j].mul_(2)`` works on every rank for every ``j``, with exact gradients."""
    reference = _inplace_reference(case, target, world_size)
    for rank, out in enumerate(entries[world_size]):
        found = out["inplace"][(case, target)]
        assert found["error"] is None, f"rank {rank}: {found['error']}"
        assert_rel(found["grad"], reference[rank])


def _double_reference(case: str, world_size: int) -> list[torch.Tensor]:
    """Single-process: rank r's first-order gradient is sum_q dL_q/dx_r; the second loss sums its squares."""
    xs = [ranks.gather_input(case, r) for r in range(world_size)]
    total = sum(ranks.gather_loss([x.contiguous() for x in xs], r) for r in range(world_size))
    firsts = torch.autograd.grad(total, xs, create_graph=True)  # type: ignore[arg-type]
    second = sum((first**2).sum() for first in firsts)
    return list(torch.autograd.grad(second, xs))  # type: ignore[arg-type]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", ["equal", "uneven_rows", "scalar"])
def test_double_backward_gives_exact_second_order_gradients(
    entries: dict[int, list[dict[str, Any]]], world_size: int, case: str
) -> None:
    reference = _double_reference(case, world_size)
    for rank, out in enumerate(entries[world_size]):
        found = out["double"][(case, "global")]
        assert found["error"] is None, f"rank {rank}: {found['error']}"
        assert_rel(found["grad"], reference[rank])
        if case == "equal":  # the same as torch's own differentiable all_gather, where it runs
            theirs = out["double"][(case, "torch")]
            if theirs["error"] is None:
                assert_rel(found["grad"], theirs["grad"])
