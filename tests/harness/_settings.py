"""The marker's settings: its arguments, the command line and the ini keys, one precedence rule.

marker argument > command line (``--ranks-timeout``, ``--ranks-reuse``) > ini key (``ranks_timeout``,
``ranks_reuse``) > default, in :func:`setting`; each help text is written once and shared by the option and the
ini key; a bad value names where it came from. Also whether a backend can run here (:func:`cuda_devices`,
without importing torch on a machine with no GPU driver).

Invariant: parent side; imports pytest, :mod:`._spawn` (the default and the timeout check) and the standard
library.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from tests.harness._spawn import DEFAULT_TIMEOUT, check_timeout

__all__ = ["BACKSTOP", "MARKER_HELP", "REUSE_HELP", "TIMEOUT_HELP", "cuda_devices", "ranks_options", "setting"]

MARKER_HELP = (
    "ranks(n, timeout=seconds, backend='gloo', reuse=False): run the test body on n spawned processes, each in an "
    "initialised default process group (torchmetrics_gradpatch); backend='nccl' puts rank r on cuda:r; "
    "reuse=True runs it in warm processes kept across tests"
)


TIMEOUT_HELP = (
    f"seconds a @pytest.mark.ranks test may take on its ranks (default {DEFAULT_TIMEOUT:g}; a fresh spawn's "
    "start-up included, a warm pool's start-up not); the marker's timeout=... overrides it"
)


REUSE_HELP = (
    "run @pytest.mark.ranks tests in warm rank processes kept across tests (true/false, default false); "
    "the marker's reuse=... overrides it"
)


_BACKENDS = ("gloo", "nccl")


#: How far beyond the marker's timeout pytest-timeout's limit for a marked test is put: the stack dump, the
#: terminate-then-kill grace and the report, so the marker's own report always comes first.
BACKSTOP = 30.0


def setting(config: pytest.Config, marker: pytest.Mark | None, name: str) -> tuple[Any, str]:
    """``(value, where it came from)`` for ``ranks_timeout`` or ``ranks_reuse``: marker > command line > ini.

    A bad value fails with a message naming where it came from.
    """
    key = name.removeprefix("ranks_")
    candidates: list[tuple[Any, str]] = []
    if marker is not None and key in marker.kwargs:
        candidates.append((marker.kwargs[key], f"ranks({key}=...)"))
    option = config.getoption(name)
    if option is not None:
        candidates.append((option, f"--ranks-{key}"))
    ini = config.getini(name)
    if name == "ranks_timeout" and ini not in (None, ""):
        candidates.append((ini, "ini ranks_timeout"))
    if name == "ranks_reuse" and ini:
        candidates.append((ini, "ini ranks_reuse"))
    value, where = candidates[0] if candidates else ((DEFAULT_TIMEOUT if key == "timeout" else False), "default")
    if key == "timeout":
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise pytest.UsageError(f"{where}: timeout must be a number of seconds, got {value!r}") from None
        try:
            return check_timeout(value, where), where
        except ValueError as err:
            raise pytest.UsageError(str(err)) from None
    if isinstance(value, str) and where == f"--ranks-{key}":
        value = value == "true"
    if not isinstance(value, bool):
        raise pytest.UsageError(f"{where} must be True or False, got {value!r}")
    return value, where


def ranks_options(item: pytest.Item, marker: pytest.Mark) -> tuple[int, float, str]:
    """``(n, timeout, backend)`` from ``@pytest.mark.ranks(n, ...)``; a clear failure for anything else."""
    usage = "use @pytest.mark.ranks(n), with optional timeout=seconds, backend='gloo' or 'nccl', reuse=True/False"
    kwargs = dict(marker.kwargs)
    args = list(marker.args)
    if "n" in kwargs and not args:
        args.append(kwargs.pop("n"))
    backend = kwargs.pop("backend", "gloo")
    for known in ("timeout", "reuse"):
        kwargs.pop(known, None)  # read by setting
    if len(args) != 1 or kwargs:
        pytest.fail(f"{item.nodeid}: bad ranks marker {marker.args!r} {marker.kwargs!r}: {usage}", pytrace=False)
    n = args[0]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        pytest.fail(f"{item.nodeid}: the number of ranks must be a positive int, got {n!r}: {usage}", pytrace=False)
    try:
        timeout, _ = setting(item.config, marker, "ranks_timeout")
    except pytest.UsageError as err:
        pytest.fail(f"{item.nodeid}: {err}", pytrace=False)
    if backend not in _BACKENDS:
        pytest.fail(f"{item.nodeid}: backend must be one of {_BACKENDS}, got {backend!r}", pytrace=False)
    return n, timeout, str(backend)


def cuda_devices() -> int:
    """How many CUDA devices torch would see; 0 without importing torch where the machine has no GPU driver."""
    if "torch" not in sys.modules and not any(
        os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd")
    ):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
