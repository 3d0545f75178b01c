"""Every error this package raises of its own.

This module imports nothing, so every other module (the torch-free version gate, the CLI, the gathers, the
features) can import it without loading torch or creating a cycle. The classes are re-exported by the package's
``__init__`` and report themselves under that public name (``torchmetrics_gradpatch.FusedSyncError``).
"""

from __future__ import annotations

__all__ = ["FusedSyncError", "GradModeMismatchError", "UnsupportedVersionError"]


class UnsupportedVersionError(ImportError):
    """The installed torch or torchmetrics cannot be patched safely; nothing was changed.

    A subclass of :class:`ImportError` because it is raised by ``import torchmetrics_gradpatch``; deliberately
    not a :class:`ModuleNotFoundError`, so code that treats "not installed" as optional does not swallow it.
    """


class GradModeMismatchError(RuntimeError):
    """Ranks gathered in global mode with different grad modes while a tensor requires grad (raised on every
    rank)."""


class FusedSyncError(RuntimeError):
    """The ranks' states cannot be synced together by the fused sync; raised on every rank of the group after the
    same exchange, before any state is changed."""


for _error in (UnsupportedVersionError, GradModeMismatchError, FusedSyncError):
    _error.__module__ = "torchmetrics_gradpatch"  # tracebacks name the public class, not this private module
del _error
