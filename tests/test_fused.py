"""The fused sync against torchmetrics' own sync, on real gloo ranks: values bit for bit, two collectives, gradients.

Each rank builds the same Metric twice from the same data, syncs one with torchmetrics' own ``_sync_dist`` (the
original method, with torchmetrics' gather) and the other with the fused sync, and compares every state's dtype,
shape and bytes. Collectives are counted with the process group's sequence number, which counts every collective
whatever API issued it. Gradients are checked against the same loss computed in one process from every rank's
data (each rank regenerates every rank's data from the same seeds).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

import torchmetrics_gradpatch as tg
from torchmetrics_gradpatch import _fused

ORIGINAL_SYNC_DIST = Metric.__dict__["_sync_dist"]


def calls(group: Any = None) -> int:
    """The number of collectives ``group`` (default: the world) has issued so far."""
    group = dist.distributed_c10d._get_default_group() if group is None else group
    return int(group._get_sequence_number_for_group())


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


def worlds(*sizes: int, timeout: float = 60) -> list[Any]:
    """One parameter per world size, each run on that many pooled ranks."""
    return [pytest.param(n, marks=pytest.mark.ranks(n, reuse=True, timeout=timeout), id=f"{n}ranks") for n in sizes]


@pytest.mark.parametrize("world_size", worlds(2, 3))
@pytest.mark.parametrize("case", list(STATE_CASES))
def test_values_bit_identical_and_two_collectives(world_size: int, case: str) -> None:
    rank = dist.get_rank()
    expected, fused = build(rank, STATE_CASES[case]), build(rank, STATE_CASES[case])
    torchmetrics_sync(expected)
    before = calls()
    _fused.fused_sync(fused)
    assert calls() - before == 2
    for name, value in states(expected).items():
        assert same(getattr(fused, name), value), (name, getattr(fused, name), value)
