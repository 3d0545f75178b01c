"""Keep the autograd graph through torchmetrics' distributed gather, on every torchmetrics from 0.11 on.

``import torchmetrics_gradpatch`` at program start is all most users need: it checks the installed versions
and patches ``torchmetrics.utilities.distributed.gather_all_tensors`` so that the local rank's entry of every
synced metric state keeps its graph (torchmetrics 1.6.0 semantics, PR #2754). See the README for the
gradient this gives each rank, and :mod:`torchmetrics_gradpatch._engine` for how every reference is reached.

On PyTorch below 2.0, or a torchmetrics whose gather is not recognised, the import raises
:class:`UnsupportedVersionError` and leaves torchmetrics -- and ``sys.modules`` -- exactly as they were.
"""

from __future__ import annotations

import sys

from torchmetrics_gradpatch._version import UnsupportedVersionError

__version__ = "0.1.0"

__all__ = [
    "GradModeMismatchError",
    "Status",
    "UnsupportedVersionError",
    "compile_support",
    "gather_all_tensors",
    "is_patched",
    "patch",
    "patched",
    "status",
    "unpatch",
]


def _forget_this_package() -> None:
    """Drop this package and its submodules from ``sys.modules`` so a failed import leaves no trace."""
    for name in [n for n in sys.modules if n == __name__ or n.startswith(__name__ + ".")]:
        del sys.modules[name]


try:
    from torchmetrics_gradpatch import _version

    _version.check_torch(_version.installed_version("torch"))
    _tm_version = _version.check_torchmetrics(_version.installed_version("torchmetrics"))

    from torchmetrics_gradpatch import _engine
    from torchmetrics_gradpatch._api import (
        Status,
        autopatch_requested,
        is_patched,
        patch,
        patched,
        status,
        unpatch,
    )
    from torchmetrics_gradpatch._compile import compile_support  # torch.compile (H17)
    from torchmetrics_gradpatch._global import GradModeMismatchError
    from torchmetrics_gradpatch._modes import gather_all_tensors

    _autopatch = autopatch_requested()
    _engine.configure(native=_version.is_native(_tm_version), torchmetrics_version=str(_tm_version))
    if _autopatch:
        patch()
except BaseException as _error:
    try:
        if isinstance(_error, UnsupportedVersionError):
            # `python -m torchmetrics_gradpatch` and the console script import this package before any CLI code
            # runs; there (only there) the refusal is one message and exit status 3, not a traceback.
            from torchmetrics_gradpatch._cli import exit_if_cli

            exit_if_cli(_error)
    finally:
        _forget_this_package()
    raise
