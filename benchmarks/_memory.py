"""Memory readings shared by the memory section of ``bench_gather.py`` and ``bench_soak.py``, and the memory rank job.

Why the readings wait ("settle")
--------------------------------
gloo runs every collective on a worker thread, and the finished ``all_gather`` work object holds the tensors it
was given: the (padded) input and every receive buffer. The caller wakes up as soon as the work is marked done,
while the worker thread drops its own reference to the work a moment later (after it re-takes the process
group's work lock). A ``barrier`` issued in that moment snapshots the still "in progress" work as a weak
reference, and a c10 object with a weak reference outstanding is destroyed (its tensors freed) only when that
reference goes too: when the barrier's own work is destroyed, which the next barrier can postpone the same way.
So for a short time after any gather, with or without the patch, the process still holds the gather's input and
all its receive buffers, and an RSS reading taken then, even after a barrier or three, can show them. Without a
further collective the worker thread lets go within milliseconds (longer on a loaded machine). The readings
below therefore report both: RSS right after the call, and RSS once it has stopped changing
(:func:`settled_rss_kib`), plus the bytes the returned list itself keeps alive (its tensors' storages), which
does not depend on any timing.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist


def rss_kib(field: str = "VmRSS") -> int:
    """``field`` of ``/proc/self/status`` in KiB (``VmRSS``: resident now; ``VmHWM``: the high-water mark)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Reset ``VmHWM`` (peak RSS) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as refs:  # "5": reset the peak resident set size
        refs.write("5")


def settled_rss_kib(poll: float = 0.01, stable: int = 8, limit: float = 3.0) -> tuple[int, float]:
    """RSS once it has not changed for ``stable`` polls ``poll`` seconds apart (at most ``limit`` s); and the wait.

    No collective is issued, so gloo's worker threads can drop the finished works (see the module docstring).
    """
    start = time.monotonic()
    last, same = rss_kib(), 0
    while same < stable and time.monotonic() - start < limit:
        time.sleep(poll)
        now = rss_kib()
        same = same + 1 if now == last else 0
        last = now
    return last, time.monotonic() - start


def live_tensors() -> int:
    """The number of ``torch.Tensor`` objects the garbage collector tracks (parameters and views included)."""
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


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
