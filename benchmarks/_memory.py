"""The memory section of ``bench_gather.py``: peak and retained RSS of one uneven gather, patched and unpatched.

RSS is read right after the call and once it has settled (``soak_workload.settled_rss_kib``; its module docstring
says why the readings wait), plus the bytes the returned list itself keeps alive (its tensors' storages), which does
not depend on any timing.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from soak_workload import rss_kib, settled_rss_kib


def reset_peak() -> None:
    """Reset ``VmHWM`` (peak RSS) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as refs:  # "5": reset the peak resident set size
        refs.write("5")


def storage_mib(tensors: list[torch.Tensor], exclude: torch.Tensor) -> float:
    """MiB of the distinct storages ``tensors`` keep alive, not counting ``exclude``'s (the caller's own tensor)."""
    seen = {exclude.untyped_storage().data_ptr()}
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total / 2**20


def gather_memory(rounds: int, rows: int, cols: int) -> dict[str, Any]:
    """RSS of one uneven gather, patch off (A) and on (B), interleaved; rank ``r`` holds ``rows - r * rows // 4``.

    Per round and mode, in MiB above the settled RSS before the call: ``peak`` (the high-water mark during the
    call), ``immediate`` (RSS right after the call returns: may still include the input and receive buffers that
    gloo's finished work holds, see the module docstring), ``settled`` (RSS once it stopped changing, the result
    still held) and ``held_by_result`` (the storages of the returned tensors other than the caller's own).
    One unmeasured warm-up call per mode first; a barrier after every measured call keeps the ranks in step.
    """
    from torchmetrics.utilities.distributed import gather_all_tensors as gather

    import torchmetrics_gradpatch as tmgp

    warnings.simplefilter("ignore")  # torchmetrics < 1.6 warns at every uneven gather on torch >= 2.8
    rank = dist.get_rank()
    x = torch.randn(rows - rank * (rows // 4), cols)
    out: dict[str, Any] = {"unpatched": [], "patched": []}
    for warm in (tmgp.unpatch, tmgp.patch):
        warm()
        del_me = gather(x)
        del del_me
        dist.barrier()
    for _ in range(rounds):
        for mode in ("unpatched", "patched"):
            (tmgp.patch if mode == "patched" else tmgp.unpatch)()
            gc.collect()
            dist.barrier()
            before, _ = settled_rss_kib()
            reset_peak()
            result = gather(x)
            peak = rss_kib("VmHWM")
            immediate = rss_kib()
            settled, waited = settled_rss_kib()
            out[mode].append(
                {
                    "peak_mib": (peak - before) / 1024,
                    "immediate_mib": (immediate - before) / 1024,
                    "settled_mib": (settled - before) / 1024,
                    "settle_ms": waited * 1e3,
                    "held_by_result_mib": storage_mib(result, x),
                    "local_entry_is_callers_tensor": float(result[rank] is x),
                }
            )
            del result
            dist.barrier()
    out["tensor"] = {"rank": rank, "mib": x.numel() * x.element_size() / 2**20, "pid": os.getpid()}
    tmgp.patch()
    return out
