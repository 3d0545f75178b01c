"""Tensors of every dtype and layout gloo gathers, torchmetrics' gather with the patch off and on, and a bitwise
comparison: what the property tests and the dtype-and-flavour scans share (imports no test module)."""

from __future__ import annotations

import datetime
import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torchmetrics.utilities.distributed as tm_dist

import torchmetrics_gradpatch as tmgp

#: dtypes gloo can all-gather (int16, uint16/32/64 and float8 raise "Invalid scalar type" on gloo).
DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int32",
    "int64",
    "bool",
    "complex64",
    "complex128",
)
GRAD_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "complex64", "complex128"})


def all_empty_gathers() -> int:
    """Probe, with torchmetrics' own (unpatched) gather: gathers in which every rank's tensor is empty.

    Older gloo cannot do them, patched or not: torch 2.0.1 dies of SIGFPE, 2.1.2-2.4.1 desync the ranks
    ("Connection closed by peer"); 2.13.0 and 2.15.0 handle them. The test runs this in a throwaway spawn
    first and, where it fails, the property test does not draw such gathers.
    """
    tmgp.unpatch()
    rank = dist.get_rank()
    done = 0
    for shape in [(0, 3), (0, 2 + 4 * rank, 0), (0,)]:
        for _ in range(2):
            tm_dist.gather_all_tensors(torch.zeros(shape))
            done += 1
    return done


@functools.cache
def gloo_dtypes() -> tuple[str, ...]:
    """The :data:`DTYPES` this torch's gloo can all-gather, probed with one tiny all_gather each.

    gloo refuses a dtype it lacks ("Invalid scalar type"): bfloat16 on torch 2.0 and 2.1, bool on 2.0. The probe
    runs in a private one-process gloo group, never in the test's group: torch 2.0's gloo ``barrier`` waits on
    every work still in flight, and a refused probe that its worker thread has not yet retired re-raises there,
    in the next gather. Complex tensors are probed as real views, as ``dist.all_gather`` sends them. Any other
    error is real and propagates. Call it on a rank, never in the pytest process: the probe is a process group.
    """
    solo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    usable = []
    for name in DTYPES:
        probe = torch.zeros(1, dtype=getattr(torch, name))
        if probe.is_complex():
            probe = torch.view_as_real(probe)
        try:
            solo.allgather([[torch.zeros_like(probe)]], [probe]).wait()
        except RuntimeError as err:
            if "Invalid scalar type" not in str(err):
                raise
            continue
        usable.append(name)
    return tuple(usable)


# --------------------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------------------


def torchmetrics_gather() -> Any:
    """torchmetrics' own function object (runs the patched code while the patch is in force)."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    return gather_all_tensors


def unpatched_gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """torchmetrics' gather with the patch off (its original code runs). Leaves the patch off."""
    tmgp.unpatch()
    assert not tmgp.is_patched()
    with warnings.catch_warnings():  # torchmetrics < 1.6 on torch >= 2.8 warns at every uneven gather
        warnings.simplefilter("ignore")
        return list(torchmetrics_gather()(tensor, group))


def patched_gather(tensor: torch.Tensor, group: Any = None, mode: str = "local") -> list[torch.Tensor]:
    """torchmetrics' gather inside a ``patched(mode=mode)`` block (every rank must use the same mode)."""
    from torchmetrics_gradpatch import _engine

    with tmgp.patched(mode=mode), warnings.catch_warnings():
        if not _engine.installed():
            raise AssertionError(f"patched(mode={mode!r}) installed nothing: patched and unpatched would be the same")
        warnings.simplefilter("error")  # the patched gather must not warn
        return list(torchmetrics_gather()(tensor, group))


def as_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes, for bit-for-bit comparison (NaN payloads and -0.0 included)."""
    if tensor.numel() == 0:
        return b""
    flat = tensor.detach().reshape(-1)
    flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)  # stride 1 even for a size-1 strided view
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and as_bytes(a) == as_bytes(b)


# --------------------------------------------------------------------------------------------------------------
# Property tests: hypothesis runs inside every rank, derandomized, so all ranks draw the same examples
# --------------------------------------------------------------------------------------------------------------


def make_tensor(shape: tuple[int, ...], dtype_name: str, seed: int, contiguous: bool) -> torch.Tensor:
    """A deterministic tensor (any rank can rebuild any other rank's), with NaN/inf/-0.0 among floats.

    The values depend on ``shape``, ``dtype_name`` and ``seed`` only; ``contiguous=False`` lays the same values
    out as a transposed (ndim >= 2) or every-other-element (ndim 1) view.
    """
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        values = torch.randn(shape, generator=gen, dtype=dtype) * 100
    elif dtype.is_floating_point:
        values = (torch.randn(shape, generator=gen, dtype=torch.float64) * 1000).to(dtype)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
        flat = values.reshape(-1)
        if flat.numel():
            where = torch.randint(0, flat.numel(), (min(4, flat.numel()),), generator=gen)
            flat[where] = specials[: len(where)]
    elif dtype == torch.bool:
        values = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        values = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen).to(dtype)
    if contiguous or len(shape) == 0:
        return values
    if len(shape) == 1:
        storage = torch.zeros(shape[0] * 2, dtype=dtype)
        view = storage[::2]
    else:
        view = torch.zeros((*shape[:-2], shape[-1], shape[-2]), dtype=dtype).transpose(-1, -2)
    view.copy_(values)
    return view
