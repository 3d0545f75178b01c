"""What one rank's tensor can do to the others' gather: no hang, no decision from unwritten memory, no wrong cause.

Each case puts a different tensor on one rank (a negative bit, a conjugate bit, another ndim or dtype, a tensor
subclass that cannot be read as bytes) and checks, on every rank, what unpatched torchmetrics does where it
works (the same values) and, where it cannot, that global mode raises the same clear error on every rank, naming
the ranks and the cause, and that the ranks stay in step (a gather right after it gives the right values).
A subgroup's non-member gets what the unpatched gather gives it, in both modes. Every test runs its body on warm
pooled gloo ranks (``run_ranks`` of ``tests/_ranks.py``) with a deadline far below the ranks' group timeout, so a
rank left waiting fails the test in a minute at most, with its stack.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchmetrics_gradpatch as tg
from tests._rank_tools import destroy_subgroup, every_rank
from tests._ranks import run_ranks
from tests._tensors import same_bits, unpatched_gather

#: seconds per test once its ranks are up: a rank left waiting in a collective fails the test long before the
#: ranks' group timeout
TIMEOUT = 60
WORLDS = (2, 3)
MODES = ("local", "global")


def error_of_gather(x: torch.Tensor, mode: str = "global") -> RuntimeError:
    """The error the gather of ``x`` raises on this rank (it must raise)."""
    with pytest.raises(RuntimeError) as raised:
        tg.gather_all_tensors(x, mode=mode)
    return raised.value


def assert_in_step() -> None:
    """The ranks are in step after an error: a plain gather gives every rank's value, in rank order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tg.gather_all_tensors(torch.tensor([float(rank), 7.0]), mode="global")
    assert [entry.tolist() for entry in out] == [[float(r), 7.0] for r in range(world)], out


def negative_scalar(rank: int) -> torch.Tensor:
    """Rank 1: ``-2.0`` as the imaginary part of a conjugate (the negative bit set); the others: ``rank``."""
    if rank == 1:
        x = torch.tensor(complex(1.0, 2.0)).conj().imag
        assert x.is_neg(), x
        return x
    return torch.tensor(float(rank))


def _negative_bit(rank: int, world_size: int, mode: str) -> None:
    x = negative_scalar(rank)
    expected = [0.0, -2.0, 2.0][:world_size]
    reference = [float(v) for v in unpatched_gather(x)]
    assert reference == expected, reference  # the reference: unpatched torchmetrics
    got = [float(v) for v in tg.gather_all_tensors(x, mode=mode)]
    assert got == expected, got
    # with a graph: a leaf keeping the negative bit, and the gradient of sum_i (i + 1) * out[i]
    leaf = x.detach().requires_grad_(True)
    out = tg.gather_all_tensors(leaf, mode=mode)
    assert [float(v.detach()) for v in out] == expected, out
    sum((i + 1) * v for i, v in enumerate(out)).backward()  # type: ignore[union-attr]
    assert leaf.grad is not None, "no gradient reached the input"
    assert float(leaf.grad) == (world_size if mode == "global" else 1) * (rank + 1), leaf.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", WORLDS)
def test_negative_bit_on_one_rank_gathers_as_unpatched(world_size: int, mode: str) -> None:
    run_ranks(_negative_bit, world_size, mode, timeout=TIMEOUT)


#: case -> (this rank's tensor as a function of its rank, words every rank's message must contain)
DISAGREEMENTS = {
    "ndim": (
        lambda r: torch.ones(2, 3) if r == 0 else torch.ones(2),
        ["number of dimensions", "rank 0: 2 (shape [2, 3])", "rank 1: 1 (shape [2])"],
    ),
    "scalar_and_vector": (
        lambda r: torch.tensor(1.0) if r == 0 else torch.ones(2),
        ["number of dimensions", "rank 0: 0 (shape [])"],
    ),
    "dtype": (
        lambda r: torch.ones(3, dtype=torch.float64 if r == 0 else torch.float32),
        ["dtype", "rank 0: torch.float64", "rank 1: torch.float32"],
    ),
    "scalar_dtype": (
        lambda r: torch.tensor(1, dtype=torch.float64 if r == 0 else torch.int32),
        ["dtype", "rank 0: torch.float64", "rank 1: torch.int32"],
    ),
}


def _disagreement(rank: int, world_size: int, case: str) -> None:
    build, words = DISAGREEMENTS[case]
    x = build(rank)
    if x.is_floating_point():  # a grad-mode disagreement too: the input's disagreement is the cause to name
        x.requires_grad_(True)
    with torch.set_grad_enabled(rank != 0):
        error = error_of_gather(x)
    assert not isinstance(error, tg.GradModeMismatchError), error
    message = str(error)
    assert all(word in message for word in words), message
    assert "none is left waiting" in message, message
    messages = every_rank(message)
    assert messages == [message] * world_size, messages
    assert_in_step()


@pytest.mark.parametrize("case", DISAGREEMENTS)
@pytest.mark.parametrize("world_size", WORLDS)
def test_ranks_that_disagree_get_one_clear_error_on_every_rank(world_size: int, case: str) -> None:
    """Unpatched torchmetrics aborts a rank there (gloo's size check); global mode tells every rank why."""
    run_ranks(_disagreement, world_size, case, timeout=TIMEOUT)


def _conjugate_bit(rank: int, world_size: int) -> None:
    for shape in [(), (3,)]:
        x = torch.full(shape, complex(1.0, float(rank)))
        message = str(error_of_gather(x.conj() if rank == 1 else x))
        assert "rank(s) [1] cannot take part (rank(s) [1]: the tensor has the conjugate bit set" in message, message
        assert "resolve_conj()" in message, message
        messages = every_rank(message)
        assert messages == [message] * world_size, messages
    assert_in_step()


@pytest.mark.parametrize("world_size", WORLDS)
def test_conjugate_bit_on_one_rank_stops_every_rank(world_size: int) -> None:
    """Unpatched torchmetrics raises on that rank only, and its peers wait; global mode tells every rank."""
    run_ranks(_conjugate_bit, world_size, timeout=TIMEOUT)


class Opaque(torch.Tensor):
    """A tensor subclass whose bytes cannot be read (``view`` to another dtype raises), as some wrappers do."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.view and any(isinstance(a, torch.dtype) for a in args[1:]):
            raise RuntimeError("Opaque tensors cannot be viewed as another dtype")
        return super().__torch_function__(func, types, args, kwargs or {})


def _opaque_scalar(rank: int, world_size: int) -> None:
    x = torch.tensor(float(rank) + 0.5)
    x = x.as_subclass(Opaque) if rank == 1 else x
    reference = unpatched_gather(x)
    out = tg.gather_all_tensors(x, mode="global")
    assert [float(v) for v in out] == [r + 0.5 for r in range(world_size)] == [float(v) for v in reference], (
        out,
        reference,
    )


@pytest.mark.parametrize("world_size", WORLDS)
def test_scalar_that_cannot_be_read_as_bytes_is_gathered_as_data(world_size: int) -> None:
    run_ranks(_opaque_scalar, world_size, timeout=TIMEOUT)


def _non_member(rank: int, world_size: int) -> None:
    group = dist.new_group([0, 1])  # every rank takes part in creating it; rank 2 is not a member
    for mode, x in [(m, x) for m in MODES for x in (torch.tensor(float(rank)), torch.tensor([float(rank), 1.0]))]:
        with warnings.catch_warnings():  # torch warns that a non-member's collectives do nothing
            warnings.simplefilter("ignore")
            try:
                reference: list[torch.Tensor] | tuple[type, str] = unpatched_gather(x, group)
            except (RuntimeError, IndexError) as err:
                reference = (type(err), str(err))
            try:
                got: list[torch.Tensor] | tuple[type, str] = tg.gather_all_tensors(x, group, mode=mode)
            except RuntimeError as err:
                got = (type(err), str(err))
        if rank == 2 and x.ndim == 0:
            # torchmetrics < 1.6 returns []; 1.6 and newer raise IndexError there (they put the local tensor at
            # get_rank(group), -1 for a non-member, into an empty list): the package gives what < 1.6 gives
            native_bug = tg.status().native and isinstance(reference, tuple) and reference[0] is IndexError
            assert got == [] and (reference == [] or native_bug), (mode, reference)
        elif rank == 2:  # unpatched fails there (torch.stack of no sizes): the same error
            assert isinstance(reference, tuple) and got == reference, (mode, got, reference)
        else:
            assert isinstance(got, list) and isinstance(reference, list), (mode, got, reference)
            assert len(got) == 2 and all(same_bits(a, b) for a, b in zip(got, reference, strict=True)), (
                mode,
                got,
                reference,
            )
    destroy_subgroup(group)


def test_non_member_of_a_subgroup_gets_what_unpatched_gives() -> None:
    """In both modes, in one test (one group to create and destroy)."""
    run_ranks(_non_member, 3, timeout=TIMEOUT)
