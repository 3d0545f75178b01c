"""Property tests of the patched gather against the unpatched one, on real spawned ranks.

Hypothesis runs *inside* every rank (derandomized, no example database), so all ranks draw the same examples
in the same order and issue the same collectives; each example ends with a consensus step, so a failure on one
rank makes every rank fail (and shrink) together. One test is one call of ``run_ranks`` on warm ranks, which runs
all its examples (nothing is spawned per example); the subgroup a test creates is destroyed at its end, so the ranks
stay warm.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version

import torchmetrics_gradpatch as tmgp
from tests._profile import sized
from tests._rank_tools import destroy_subgroup, errors_off_and_on, every_rank
from tests._ranks import RankError, run_ranks
from tests._tensors import (
    DTYPES,
    GRAD_DTYPES,
    all_empty_gathers,
    gloo_dtypes,
    make_tensor,
    patched_gather,
    same_bits,
    torchmetrics_gather,
    unpatched_gather,
)

# --- what is drawn and checked ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One drawn case. Every rank draws the same one and picks its own shape by rank."""

    shapes: tuple[tuple[int, ...], ...]  # one per global rank (ranks outside the group ignore theirs)
    dtype: str
    requires_grad: bool
    contiguous: bool
    no_grad: bool
    subgroup: bool  # gather over the group of ranks 1..world-1 instead of the world
    seed: int

    def digest(self) -> int:
        return zlib.crc32(repr(self).encode()) & 0x7FFFFFFF


def check_example(example: Example, subgroup: Any, mode: str = "local") -> list[str]:
    """Run one example on this rank; return the problems found (empty when all is well).

    ``mode="local"``: upstream 1.6 semantics, only the local entry carries a graph and it is the caller's tensor.
    ``mode="global"`` (every rank alike): the same values, every entry an output of the global node when the
    tensors require grad, and the gradient of rank ``j``'s tensor summed over the group's ranks.
    """
    glob = mode == "global"
    rank, world = dist.get_rank(), dist.get_world_size()
    members = list(range(1, world)) if example.subgroup else list(range(world))
    if rank not in members:
        return []
    group = subgroup if example.subgroup else None
    index = members.index(rank)  # the rank within the group: where the local entry must be
    problems: list[str] = []
    expected = [make_tensor(example.shapes[r], example.dtype, example.seed + r, True) for r in members]

    x = make_tensor(example.shapes[rank], example.dtype, example.seed + rank, example.contiguous)
    if example.requires_grad:
        x.requires_grad_(True)

    reference = unpatched_gather(x.detach(), group)
    if example.no_grad:
        with torch.no_grad():
            out = patched_gather(x, group, mode)
    else:
        out = patched_gather(x, group, mode)
    graph = example.requires_grad and not example.no_grad

    if len(out) != len(members):
        return [f"{len(out)} entries for a group of {len(members)}"]
    for i, (got, ref, want) in enumerate(zip(out, reference, expected, strict=True)):
        if i == index:
            continue
        if not same_bits(got, ref):
            problems.append(f"entry {i} differs from the unpatched gather: {got!r} vs {ref!r}")
        if not same_bits(got, want):
            problems.append(f"entry {i} differs from rank {members[i]}'s tensor")
        if got.requires_grad != (glob and graph):
            problems.append(f"entry {i} (not local) requires_grad is {got.requires_grad} in {mode} mode")
    local = out[index]
    if x.is_contiguous() and not glob:
        if local is not x:
            problems.append(f"local entry {index} is not the caller's tensor")
    elif not same_bits(local, x):
        problems.append(f"local entry {index} does not equal the caller's (non-contiguous) tensor")
    if not same_bits(reference[index], x.detach()):
        problems.append("the unpatched gather's own local entry differs from the caller's tensor")

    if example.requires_grad and not example.no_grad:
        # loss = sum_i (i + 1) * out[i].sum(). Local mode: only the local entry carries a graph, so d loss / d x is
        # index + 1. Global mode: every member's loss sends its (index + 1) back, so the group size times that.
        loss = sum(
            ((i + 1) * entry.real.sum() if entry.is_complex() else (i + 1) * entry.sum()) for i, entry in enumerate(out)
        )
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            problems.append("the loss has no graph")
        else:
            loss.backward()
            want = (len(members) if glob else 1) * (index + 1)
            want_grad = torch.full_like(x, want)
            if x.grad is None or not same_bits(x.grad, want_grad):
                problems.append(f"grad {x.grad!r}, expected {want} everywhere")
    return problems


def _consensus(example: Example, problems: list[str]) -> None:
    """Make every rank agree on the example and on its verdict, so all ranks raise (and shrink) together."""
    mine = torch.tensor([example.digest(), int(bool(problems))], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    digests = {int(t[0]) for t in every}
    if len(digests) != 1:
        raise RuntimeError(f"ranks drew different examples ({sorted(digests)}): the collectives would diverge")
    failed = [r for r, t in enumerate(every) if int(t[1])]
    if failed:
        raise AssertionError(f"ranks {failed} failed {example}; this rank: {problems or 'ok'}")


def run_properties(max_examples: int, empty_gathers_work: bool = True, mode: str = "local") -> dict[str, Any]:
    """Hypothesis inside the rank: derandomized, no database, so every rank runs the same examples in order.

    ``mode`` is the gradient mode of the patched side (the same on every rank).
    """
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    world = dist.get_world_size()
    subgroup = dist.new_group(list(range(1, world))) if world > 1 else None  # collective: every rank calls it
    seen: dict[str, int] = {"examples": 0, "uneven": 0, "zero_size": 0, "grad": 0, "subgroup": 0}
    dtypes = gloo_dtypes()

    @st.composite
    def examples(draw: Any) -> Example:
        ndim = draw(st.integers(0, 3))
        if ndim == 0:
            shapes: tuple[tuple[int, ...], ...] = ((),) * world
        elif draw(st.booleans()):
            shape = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
            shapes = (shape,) * world
        else:
            shapes = tuple(tuple(draw(st.integers(0, 6)) for _ in range(ndim)) for _ in range(world))
        if not empty_gathers_work:
            # The data all_gather moves the elementwise-largest shape of the group's members (the world, or the
            # subgroup of ranks 1..n-1); with a zero in it every member sends nothing.
            for members in (shapes, shapes[1:]):
                assume(not members or 0 not in [max(sizes) for sizes in zip(*members, strict=True)])
        dtype = draw(st.sampled_from(dtypes))
        return Example(
            shapes=shapes,
            dtype=dtype,
            requires_grad=dtype in GRAD_DTYPES and draw(st.booleans()),
            contiguous=draw(st.booleans()),
            no_grad=draw(st.booleans()),
            subgroup=world > 1 and draw(st.booleans()),
            seed=draw(st.integers(0, 2**20)),
        )

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(examples())
    def property_holds(example: Example) -> None:
        try:
            problems = check_example(example, subgroup, mode)
        except Exception as err:  # a local failure must still reach the consensus step
            problems = [f"raised {err!r}"]
        _consensus(example, problems)
        seen["examples"] += 1
        seen["uneven"] += len(set(example.shapes)) > 1
        seen["zero_size"] += any(0 in shape for shape in example.shapes)
        seen["grad"] += example.requires_grad and not example.no_grad
        seen["subgroup"] += example.subgroup

    property_holds()
    # While the group is up anyway: a non-tensor must give the unpatched gather's error (no collective runs).
    seen["non_tensor_problems"] = non_tensor_errors_match()  # type: ignore[assignment]
    seen["dtypes"] = list(dtypes)  # type: ignore[assignment]
    if subgroup is not None:
        destroy_subgroup(subgroup)  # pooled ranks stay warm
    return seen


def non_tensor_errors_match() -> list[str]:
    """In an initialised group: a non-tensor gives the unpatched gather's error, on every rank."""
    problems = []
    for bad in (1.5, [1, 2], None, "x"):
        # every rank runs the same modes in the same order, so the ranks never disagree on the mode
        unpatched, *patched = errors_off_and_on(lambda: torchmetrics_gather()(bad))  # noqa: B023 (called at once)
        if not patched or any(error != unpatched for error in patched):
            problems.append(f"{bad!r}: unpatched {unpatched} vs patched {patched}")
    return problems


def properties_catch_a_broken_gather(max_examples: int, mode: str = "local") -> str:
    """Run the property test against a gather that puts the local entry at the *global* rank (wrong in a
    subgroup, upstream's own pitfall); return the failure hypothesis reports, or ``"not caught"``."""
    from torchmetrics_gradpatch import _engine, _modes

    # what the trampoline dispatches to: the mode's gather in _modes.GATHERS, chosen at every state change
    correct = _modes.gather_for(mode)

    def broken(result: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        out: list[torch.Tensor] = correct(result, group)
        index = dist.get_rank()  # the bug: not dist.get_rank(group)
        if index < len(out):
            out[index] = result.contiguous()
        return out

    _modes.GATHERS[mode] = broken
    _engine.refresh()
    try:
        run_properties(max_examples, mode=mode)
    except AssertionError as err:
        return str(err)
    finally:  # a warm rank runs other tests next
        _modes.GATHERS[mode] = correct
        _engine.refresh()
    return "not caught"


# --- the tests -------------------------------------------------------------------------------------------------

# On native torchmetrics (>= 1.6) local mode installs nothing: "patched vs unpatched" would compare torchmetrics'
# gather with itself. The global mode installs the trampoline there, so the patched side uses it (every rank
# alike), checked against torchmetrics' own gather with the global mode's expectations.
MODE = "global" if tmgp.status().native else "local"


def _all_empty_gathers(rank: int, world_size: int) -> int:
    return all_empty_gathers()


@pytest.fixture(scope="module")
def empty_gathers_work() -> bool:
    """Whether this torch's gloo survives gathers of all-empty tensors (torchmetrics' own gather, unpatched)."""
    try:  # on the warm ranks, which the module's 2-rank cases use next; a gloo that aborts ends them
        run_ranks(_all_empty_gathers, 2, timeout=60)
    except RankError:
        return False
    return True


def test_newer_torch_gathers_empty_tensors(empty_gathers_work: bool) -> None:
    """The probe must not hide a problem where gloo is known to handle empty gathers."""
    if Version(torch.__version__).release >= (2, 13):
        assert empty_gathers_work


def _properties_hold(rank: int, world_size: int, examples: int, empty_gathers_work: bool) -> dict[str, Any]:
    seen = run_properties(examples, empty_gathers_work, MODE)
    assert seen["examples"] >= examples, seen
    # the draws must actually cover the interesting cases, on every rank alike
    assert every_rank(seen) == [seen] * world_size, (rank, seen)
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_patched_gather_properties(world_size: int, empty_gathers_work: bool) -> None:
    every = run_ranks(_properties_hold, world_size, 50, empty_gathers_work, timeout=150)
    seen = every[0]
    assert every == [seen] * world_size, every
    assert seen["uneven"] and seen["zero_size"] and seen["grad"] and seen["subgroup"]
    # the same call also checks that a non-tensor gives the unpatched error inside an initialised group
    assert seen["non_tensor_problems"] == []
    # Only bfloat16 and bool may be missing (older gloo); everything else must have been drawn from.
    assert set(DTYPES) - set(seen["dtypes"]) <= {"bfloat16", "bool"}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 3])
def test_patched_gather_properties_many(world_size: int, empty_gathers_work: bool) -> None:
    run_ranks(_properties_hold, world_size, sized(full=600, ci=120), empty_gathers_work, timeout=800)


def _catches_a_wrong_local_index(rank: int, world_size: int) -> None:
    from torchmetrics_gradpatch import _modes

    correct = _modes.gather_for(MODE)
    caught = properties_catch_a_broken_gather(100, MODE)
    assert caught != "not caught", caught
    assert "subgroup=True" in caught, caught
    assert _modes.gather_for(MODE) is correct, "the warm rank must get the real gather back"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_property_test_catches_a_wrong_local_index() -> None:
    """The check can fail: a gather that uses the global rank instead of the group rank is caught (world 3)."""
    run_ranks(_catches_a_wrong_local_index, 3, timeout=300)
