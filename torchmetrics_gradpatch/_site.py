"""One class attribute of torchmetrics replaced now or the moment its module is imported (a ``wrapt`` hook), and
the marks this package's replacements carry.

Contract of :class:`Site`: install and uninstall are idempotent; uninstall puts back the identical original (the
replacement's ``__wrapped__``), or leaves another tool's replacement on top of ours in place and warns; ``after``
runs each time the attribute is brought in line. Imports neither torch nor torchmetrics.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import wrapt

# The mark each replacement carries (true), so it is told apart from another tool's: Metric._sync_dist's, a
# MetricCollection's compute and its forward.
SYNC_MARK = "__torchmetrics_gradpatch_sync__"
COLLECTION_MARK = "__torchmetrics_gradpatch_collection__"
STEP_MARK = "__torchmetrics_gradpatch_step__"
MARKS = (SYNC_MARK, COLLECTION_MARK, STEP_MARK)


class Site:
    """The attribute ``owner.name`` of module ``module``, replaced by ``wrap(original)`` while :attr:`on`."""

    def __init__(
        self,
        module: str,
        owner: str,
        name: str,
        mark: str,
        wrap: Callable[[Any], Callable[..., Any]],
        after: Callable[[], None] | None = None,
    ) -> None:
        self.module, self.owner, self.name, self.mark = module, owner, name, mark
        self._wrap, self._after = wrap, after
        self.on = False  # the replacement is wanted
        self.hook = False  # the post-import hook is registered and has not run yet
        self.ours: Any = None  # the replacement this site set, so another tool's replacement on top of it is noticed

    def cls(self) -> Any:
        """The class, or ``None`` while its module is not imported or is still being imported."""
        return getattr(sys.modules.get(self.module), self.owner, None)

    def _is_ours(self, value: Any) -> bool:
        return bool(getattr(value, self.mark, False))

    def _replacement(self, original: Any) -> Callable[..., Any]:
        replacement = self._wrap(original)
        replacement.__wrapped__ = original  # type: ignore[attr-defined]  # what uninstall restores
        setattr(replacement, self.mark, True)
        return replacement

    def apply(self) -> None:
        """Bring the attribute in line with :attr:`on`; nothing while there is no class yet (the hook applies it)."""
        cls = self.cls()
        if cls is None:
            return
        current = cls.__dict__[self.name]
        ours = self._is_ours(current)
        if self.on and not ours:
            self.ours = self._replacement(current)
            setattr(cls, self.name, self.ours)
        elif not self.on and ours:
            setattr(cls, self.name, current.__wrapped__)
            self.ours = None
        if self._after is not None:
            self._after()

    def _on_import(self, module: Any) -> None:
        self.hook = False
        self.apply()

    def install(self) -> None:
        """Replace the attribute now, or when its module is imported; idempotent."""
        self.on = True
        if self.module in sys.modules:  # imported, or being imported: then the hook registered earlier applies it
            self.apply()
        elif not self.hook:
            self.hook = True
            wrapt.register_post_import_hook(self._on_import, self.module)

    def uninstall(self) -> None:
        """Put the original back (the same object), unless another tool's replacement sits on ours; idempotent."""
        self.on = False
        cls = self.cls()
        if cls is None:
            return
        current = cls.__dict__[self.name]
        ours, self.ours = self.ours, None
        if self._is_ours(current):
            setattr(cls, self.name, current.__wrapped__)
        elif ours is not None:
            warnings.warn(
                f"torchmetrics_gradpatch: another tool has replaced {self.owner}.{self.name} on top of this "
                "package's; leaving it in place.",
                RuntimeWarning,
                stacklevel=3,  # the caller of the owning module's uninstall(), which calls this
            )
        if self._after is not None:
            self._after()

    def installed(self) -> bool:
        """Whether the attribute currently is this package's replacement."""
        cls = self.cls()
        return cls is not None and self._is_ours(cls.__dict__[self.name])

    def original(self) -> Any:
        """The attribute as its module defined it (what the replacement wraps, if it is in place); needs the class."""
        current = getattr(sys.modules[self.module], self.owner).__dict__[self.name]
        return current.__wrapped__ if self._is_ours(current) else current
