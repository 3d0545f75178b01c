"""Tensors as bytes on the wire, for every exchange of the package: a dtype's code, its size, and aligned offsets.

Contract: a code is the CRC-32 of the dtype's name, so it means the same on every rank whatever torch each runs; a
rank whose torch lacks the dtype reads it as ``None``, never as another dtype. Imports torch.
"""

from __future__ import annotations

import functools
import warnings
import zlib
from collections.abc import Iterable

import torch

#: Every packed piece starts at a multiple of this, so its bytes can be viewed as any dtype (complex128: 16).
ALIGN = 16

# dtypes whose bytes can be viewed back as the dtype: what a packed buffer may carry (quantized, bit-packed and
# sub-byte dtypes cannot be viewed from uint8)
_PLAIN = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex32", "complex64", "complex128", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip


@functools.cache
def code(dtype: torch.dtype) -> int:
    """``dtype``'s code: the same on every rank (from its name, not from torch's enum order)."""
    return zlib.crc32(str(dtype).encode())


@functools.cache
def _by_code() -> dict[int, torch.dtype]:
    return {code(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)}


def dtype_of(value: int) -> torch.dtype | None:
    """The dtype ``value`` codes for, or ``None`` when this rank's torch has no such dtype."""
    return _by_code().get(value)


def dtype_name(value: int) -> str:
    """The dtype ``value`` codes for, as text (error messages)."""
    dtype = dtype_of(value)
    return str(dtype) if dtype is not None else f"a dtype unknown to this rank's torch (code {value})"


@functools.cache
def plain(dtype: torch.dtype) -> bool:
    """Whether a packed byte buffer can carry ``dtype`` (its bytes can be viewed back as it)."""
    return any(getattr(torch, name, None) == dtype for name in _PLAIN)


@functools.cache
def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (``torch.dtype.itemsize`` is missing on torch 2.0)."""
    with warnings.catch_warnings():  # complex32: "ComplexHalf support is experimental"
        warnings.simplefilter("ignore")
        return torch.empty((), dtype=dtype).element_size()


def nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of ``shape`` and ``dtype``."""
    count = 1
    for size in shape:
        count *= size
    return count * itemsize(dtype)


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def offsets(sizes: Iterable[int], start: int = 0) -> tuple[list[int], int]:
    """Where each piece of ``sizes`` bytes starts when packed from ``start`` on, each aligned; and the end."""
    found: list[int] = []
    at = aligned(start)
    for size in sizes:
        found.append(at)
        at = aligned(at + size)
    return found, at


def unresolved(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a conjugate or negative view (``x.conj()``, ``x.conj().imag``): its memory holds other
    values than it reads as, and a byte view of it raises."""
    return bool(tensor.is_conj() or tensor.is_neg())


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a copy holding the values it reads as where it is a conjugate or negative view (as
    ``torch.cat`` resolves them)."""
    return tensor.resolve_conj().resolve_neg() if unresolved(tensor) else tensor


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a flat ``uint8`` tensor (a view of its memory when it is contiguous and no conjugate or
    negative view)."""
    flat = resolved(tensor.detach()).reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # expanded gradients (stride 0) pass is_contiguous at one element
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)
