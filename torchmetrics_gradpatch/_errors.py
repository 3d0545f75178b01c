"""Every error this package raises of its own. Imports nothing, so any module may import it; the classes report
themselves under the public name (``torchmetrics_gradpatch.FusedSyncError``).
"""

from __future__ import annotations


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
