"""Code that runs inside spawned benchmark ranks (module-level, so the spawn start method can import it).

Every rank runs the same loops with the same fixed call counts: the number of collectives never depends on a
clock, so the ranks stay in lockstep. Timings are taken on every rank and returned; the parent reports rank 0
(each gather ends in a collective, so the ranks' times agree closely).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

#: name -> (shape for rank r, calls per timed block). Uneven: every rank a different number of rows.
CASES: dict[str, tuple[Any, int]] = {
    "scalar": (lambda r: (), 60),
    "1k": (lambda r: (1000,), 40),
    "64k": (lambda r: (65536,), 20),
    "1M": (lambda r: (1_000_000,), 4),
    "uneven": (lambda r: (4096 + 1000 * r, 16), 15),
}


def _gather() -> Any:
    from torchmetrics.utilities.distributed import gather_all_tensors

    return gather_all_tensors


def _block(gather: Any, tensor: torch.Tensor, calls: int) -> float:
    """Seconds per call over ``calls`` back-to-back gathers."""
    start = time.perf_counter()
    for _ in range(calls):
        gather(tensor)
    return (time.perf_counter() - start) / calls


def patched_vs_unpatched(rounds: int, case_names: list[str]) -> dict[str, dict[str, list[float]]]:
    """torchmetrics' own gather, patch off (A) and on (B), interleaved A B B A A B ..., ``rounds`` blocks each."""
    import torchmetrics_gradpatch as tmgp

    warnings.simplefilter("ignore")  # torchmetrics < 1.6 warns at every uneven gather on torch >= 2.8
    rank = dist.get_rank()
    gather = _gather()
    out: dict[str, dict[str, list[float]]] = {}
    for name in case_names:
        shape_of, calls = CASES[name]
        tensor = torch.randn(shape_of(rank))
        times: dict[str, list[float]] = {"unpatched": [], "patched": []}
        for warm in (tmgp.unpatch, tmgp.patch):
            warm()
            _block(gather, tensor, 2)
        for round_ in range(rounds):  # A B, then B A: neither mode always runs first
            for mode in ("unpatched", "patched")[:: 1 if round_ % 2 == 0 else -1]:
                (tmgp.patch if mode == "patched" else tmgp.unpatch)()
                times[mode].append(_block(gather, tensor, calls))
        out[name] = times
    tmgp.patch()
    return out


def as_shipped(rounds: int, case_names: list[str]) -> dict[str, Any]:
    """torchmetrics' gather as this environment ships it (patched by the import where not native)."""
    import torchmetrics

    import torchmetrics_gradpatch as tmgp

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    gather = _gather()
    out: dict[str, Any] = {"torchmetrics": torchmetrics.__version__, "status": str(tmgp.status().native)}
    for name in case_names:
        shape_of, calls = CASES[name]
        tensor = torch.randn(shape_of(rank))
        _block(gather, tensor, 2)
        out[name] = [_block(gather, tensor, calls) for _ in range(rounds)]
    return out
