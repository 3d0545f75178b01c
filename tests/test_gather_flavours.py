"""Every gloo dtype and tensor flavour through both modes' gather, against the unpatched gather, on 2 and 3 ranks.

Flavours: equal and uneven shapes, a non-contiguous view, a rank with zero rows, a 0-d tensor, seven dimensions
(more than global mode's header carries), the negative bit (``z.conj().imag``, on odd ranks only) as a 0-d and a
1-d tensor, and the conjugate bit on every rank. Each test runs its body on warm pooled gloo ranks (``run_ranks`` of
``tests/_ranks.py``) and loops over every case; each rank checks its own results: every entry bit for bit against
torchmetrics' own gather with the patch off, and, for floating and complex dtypes, the gradient against the
analytic one (local mode: this rank's weight; global mode: the world size times it). The call's deadline bounds
each test far below the ranks' group timeout.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from tests._tensors import GRAD_DTYPES, gloo_dtypes, make_tensor, same_bits, unpatched_gather

WORLDS = (2, 3)
#: seconds per test once its ranks are up
TIMEOUT = 90
MODES = ("local", "global")
#: dtype -> the complex dtype whose ``.conj().imag`` gives a tensor of that dtype with the negative bit set
NEGATIVE_FROM = {"float16": "complex32", "float32": "complex64", "float64": "complex128"}


def _negative_bit(shape: tuple[int, ...], dtype_name: str, rank: int) -> torch.Tensor:
    """On odd ranks a tensor with the negative bit set (values ``-imag``); on even ranks a plain one."""
    if rank % 2 == 0:
        return make_tensor(shape, dtype_name, 40 + rank, True)
    with warnings.catch_warnings():  # complex32 is "experimental" and says so
        warnings.simplefilter("ignore")
        real = make_tensor(shape, dtype_name, 50 + rank, True)
        imag = make_tensor(shape, dtype_name, 60 + rank, True)
        tensor = torch.complex(real, imag).conj().imag
    assert tensor.is_neg() and tensor.dtype == getattr(torch, dtype_name), tensor
    return tensor


#: flavour -> (dtype name, rank) -> this rank's tensor, or None where the flavour does not exist for the dtype
FLAVOURS: dict[str, Callable[[str, int], torch.Tensor | None]] = {
    "equal": lambda d, r: make_tensor((2, 3), d, r, True),
    "uneven": lambda d, r: make_tensor((r + 1, 3), d, r, True),
    "non_contiguous": lambda d, r: make_tensor((r + 2, 3), d, r, False),
    "zero_rows": lambda d, r: make_tensor((0 if r == 0 else 2, 3), d, r, True),
    "scalar": lambda d, r: make_tensor((), d, r, True),
    "seven_dims": lambda d, r: make_tensor((1, 2, 1, 1, 1, r + 1, 2), d, r, True),
    "negative_bit_scalar": lambda d, r: _negative_bit((), d, r) if d in NEGATIVE_FROM else None,
    "negative_bit": lambda d, r: _negative_bit((r + 2,), d, r) if d in NEGATIVE_FROM else None,
}


def _check_case(x: torch.Tensor, mode: str, graph: bool, what: str) -> list[str]:
    """Gather ``x`` (this rank's tensor; made a leaf that requires grad if ``graph``) in ``mode``: the problems."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = unpatched_gather(x.detach())
    if graph:
        x = x.detach().requires_grad_(True)  # a leaf with x's layout: strides and negative bit kept
    out = tg.gather_all_tensors(x, mode=mode)
    problems = []
    if len(out) != world:
        return [f"{what}: {len(out)} entries for {world} ranks"]
    for i, (got, ref) in enumerate(zip(out, reference, strict=True)):
        if not same_bits(got, ref):
            problems.append(f"{what}: entry {i} differs from the unpatched gather: {got!r} vs {ref!r}")
        if got.requires_grad != (graph and (mode == "global" or i == rank)):
            problems.append(f"{what}: entry {i} requires_grad is {got.requires_grad}")
    if graph:
        loss = sum((i + 1) * (e.real.sum() if e.is_complex() else e.sum()) for i, e in enumerate(out))
        assert isinstance(loss, torch.Tensor), loss
        loss.backward()
        want = torch.full(x.shape, (world if mode == "global" else 1) * (rank + 1), dtype=x.dtype)
        if x.grad is None or not same_bits(x.grad, want):
            problems.append(f"{what}: gradient {x.grad!r}, expected {want!r}")
    return problems


def every_rank_problems(problems: list[str]) -> list[str]:
    """Every rank's problems, labelled by rank (a collective: every rank calls it)."""
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, problems)
    return [f"rank {r}: {p}" for r, found in enumerate(every) for p in found]  # type: ignore[attr-defined]


def _every_dtype_and_flavour(rank: int, world_size: int, mode: str) -> None:
    dtypes = gloo_dtypes()
    assert set(dtypes) >= {"float32", "float64", "int64", "complex64"}, dtypes
    problems: list[str] = []
    cases = 0
    for dtype in dtypes:
        for flavour, build in FLAVOURS.items():
            x = build(dtype, rank)
            if x is None:
                continue
            for graph in (False, True) if dtype in GRAD_DTYPES else (False,):
                problems += _check_case(x, mode, graph, f"{dtype} {flavour}{' with grad' if graph else ''}")
                cases += 1
    found = every_rank_problems(problems)
    assert found == [], "\n".join(found)
    # every dtype in six flavours, the three with a negative-bit view in two more; floating ones with grad too
    floating = len(GRAD_DTYPES & set(dtypes))
    assert cases == (len(dtypes) + floating) * 6 + 3 * 2 * 2, cases


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", WORLDS)
def test_every_dtype_and_flavour_matches_the_unpatched_gather(world_size: int, mode: str) -> None:
    run_ranks(_every_dtype_and_flavour, world_size, mode, timeout=TIMEOUT)


def _conjugate_bit_everywhere(rank: int, world_size: int, mode: str) -> None:
    for shape in [(), (3,)]:
        x = make_tensor(shape, "complex64", rank, True).conj()
        try:
            unpatched_gather(x)
        except RuntimeError as err:
            unpatched = str(err)
        else:
            raise AssertionError("the unpatched gather accepted a conjugate view: the reference changed")
        with pytest.raises(RuntimeError) as raised:
            tg.gather_all_tensors(x, mode=mode)
        message = str(raised.value)
        if mode == "local":
            assert message == unpatched, (message, unpatched)
        else:
            assert "conjugate bit" in message and "resolve_conj()" in message, message
            assert f"rank(s) {list(range(world_size))} cannot take part" in message, message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", WORLDS)
def test_conjugate_bit_on_every_rank_fails_on_every_rank(world_size: int, mode: str) -> None:
    """Unpatched torchmetrics refuses a conjugate view on every rank (gloo's view_as_real); both modes do too."""
    run_ranks(_conjugate_bit_everywhere, world_size, mode, timeout=TIMEOUT)
