"""Deterministic inputs, losses and comparisons of the global-mode tests (tests/test_global_*.py).

Every rank builds every other rank's inputs from the same seeds, so a rank computes its single-process float64
reference itself. Nothing here runs a collective.
"""

from __future__ import annotations

import ast

import torch
import torch.nn.functional as F  # noqa: N812

F64 = torch.float64
FEATURES = 3
RTOL = 1e-12
# Per-rank rows of the cat-state and contrastive cases: uneven, and rank 1 of 3 holds none in "zero_rows".
ROWS = {"uneven": (3, 5, 4), "zero_rows": (2, 0, 3), "equal": (4, 4, 4)}
GATHER_CASES = ("equal", "uneven_rows", "uneven_all_dims", "scalar", "non_contiguous")


def gather_input(case: str, rank: int) -> torch.Tensor:
    """The tensor rank ``rank`` contributes to gather ``case`` (float64, requires grad)."""
    gen = torch.Generator().manual_seed(100 + rank)
    if case == "equal":
        x = torch.randn(2, 3, generator=gen, dtype=F64)
    elif case == "uneven_rows":  # includes a rank with zero rows
        x = torch.randn((2, 0, 3)[rank % 3], 2, generator=gen, dtype=F64)
    elif case == "uneven_all_dims":
        x = torch.randn(rank % 3 + 1, 3 - rank % 3, generator=gen, dtype=F64)
    elif case == "scalar":
        x = torch.randn((), generator=gen, dtype=F64)
    elif case == "non_contiguous":
        x = torch.randn(4, 3, generator=gen, dtype=F64).t()
    else:
        raise ValueError(case)
    return x.requires_grad_()


def gather_loss(entries: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Rank ``rank``'s loss from the gathered entries: different on every rank, uses every entry nonlinearly."""
    total = torch.zeros((), dtype=F64)
    for j, entry in enumerate(entries):
        total = total + (rank + 1.5) * (j + 0.5) * (entry**2).sum() + (rank - j) * entry.sin().sum()
    return total


def model_inputs(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s features and targets for the model-and-metric cases."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(rows, FEATURES, generator=gen, dtype=F64), torch.randn(rows, generator=gen, dtype=F64)


def weight() -> torch.Tensor:
    """The model parameter, identical on every rank (as DDP replicas are)."""
    return torch.linspace(-1.0, 1.0, FEATURES, dtype=F64)


def contrastive_loss(local: torch.Tensor, everything: torch.Tensor, offset: int) -> torch.Tensor:
    """InfoNCE-style: each local row's positive is itself among all rows of all ranks."""
    logits = local @ everything.t()
    labels = torch.arange(offset, offset + local.shape[0])
    return F.cross_entropy(logits, labels, reduction="sum")


def projection() -> torch.Tensor:
    return torch.linspace(-0.5, 0.7, FEATURES * 2, dtype=F64).reshape(FEATURES, 2)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    """``actual`` equals ``expected`` to ``rtol`` relative to the largest magnitude in ``expected``."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual, expected)
    if expected.numel() == 0:
        return
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= rtol * max(scale, 1e-300), f"max error {error:.3e} vs scale {scale:.3e}"


#: int64 words of global mode's header exchange, the same on every rank whatever its tensor
HEADER_WORDS = 10


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
