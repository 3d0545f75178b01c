"""Every error this package raises of its own, in the one module that imports nothing.

Invariants:

* importing this module imports no module at all, so every other module (the torch-free gate, the CLI, the
  torch-side gathers) can import it without creating a cycle or loading torch;
* the classes survive ``importlib.reload``: a reload re-runs this file in the same module namespace, and a class
  already defined there is kept, so ``except torchmetrics_gradpatch.GradModeMismatchError`` keeps catching what
  the (reloaded or not) gathers raise. A second copy of the package imported after clearing ``sys.modules`` has
  its own classes, as any re-imported Python module does.
"""

from __future__ import annotations

__all__ = ["GradModeMismatchError", "UnsupportedVersionError"]

if "UnsupportedVersionError" not in globals():  # else an earlier run of this file defined it: keep that class

    class UnsupportedVersionError(ImportError):
        """The installed torch or torchmetrics cannot be patched safely; nothing was changed.

        A subclass of :class:`ImportError` because it is raised by ``import torchmetrics_gradpatch``; deliberately
        not a :class:`ModuleNotFoundError`, so code that treats "not installed" as optional does not swallow it.
        """


if "GradModeMismatchError" not in globals():  # as above

    class GradModeMismatchError(RuntimeError):
        """Ranks gathered in global mode with different grad modes while a tensor requires grad (raised on every
        rank)."""
