"""The sync strategies, and the one replacement of ``torchmetrics.Metric._sync_dist`` that runs them.

Contract: while the engine asks (:func:`install`), ``Metric._sync_dist`` runs the chosen strategy when the sync
function is torchmetrics' own gather (any other ``dist_sync_fn`` goes to torchmetrics' method unchanged), behind
one graph break under ``torch.compile`` (docs/design.md, "torch.compile"); :func:`uninstall` puts the very same
function object back. ``"torchmetrics"`` is built in; a feature calls :func:`register` with its sync and the further
sites it needs while in force. Every rank of a group must use the same strategy. Imports neither torch nor
torchmetrics.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torchmetrics_gradpatch import _compile
from torchmetrics_gradpatch._modes import check_name
from torchmetrics_gradpatch._site import SYNC_MARK, Site


@dataclass(frozen=True)
class Strategy:
    """A sync strategy: ``sync(metric, process_group, mode)`` syncs one Metric's states as ``_sync_dist`` would;
    ``install`` / ``uninstall`` (idempotent) put further patch sites in place while it is the strategy in force."""

    sync: Callable[[Any, Any, str], None]
    install: Callable[[], None] | None = None
    uninstall: Callable[[], None] | None = None
    #: what ``status()`` reports as the strategy's further sites when they are in place (``None``: it has none)
    sites: Callable[[], tuple[str, ...]] | None = None
    #: the torchmetrics functions the strategy does not recognise now, each with the parts of it that step aside
    #: (called only once torchmetrics is imported)
    aside: Callable[[], dict[str, tuple[str, ...]]] | None = None
    #: the classes of the user's that the strategy trusts (what ``status()`` reports)
    trusted: Callable[[], tuple[str, ...]] | None = None


#: name -> strategy; ``None`` stands for torchmetrics' own sync.
STRATEGIES: dict[str, Strategy | None] = {"torchmetrics": None}

#: What was asked (``sync``, ``mode``; whether the replacement is wanted is ``_SITE.on``), the strategy whose
#: further sites are in place. ``sync`` is read at every call of the replacement, so switching strategies replaces
#: nothing.
_wanted: dict[str, Any] = {"sync": "torchmetrics", "mode": "local", "sites": None}


def register(name: str, strategy: Strategy) -> None:
    """Make ``name`` a sync strategy (``patch(sync=name)``, ``TORCHMETRICS_GRADPATCH_SYNC``)."""
    STRATEGIES[name] = strategy


def check_sync(sync: object, what: str = "sync") -> str:
    """Return the strategy ``sync`` names (the spelling rule of :func:`~torchmetrics_gradpatch._modes.check_name`)."""
    return check_name(sync, tuple(STRATEGIES), what, "a sync strategy")


def _mode_now() -> str:
    mode = _wanted["mode"]
    return mode() if callable(mode) else str(mode)


def _is_torchmetrics_gather(fn: object, original: Any) -> bool:
    """Whether ``fn`` is torchmetrics' own gather (the object the original method's default names)."""
    default = (original.__defaults__ or (None,))[0]
    if fn is default:
        return True
    module = sys.modules.get("torchmetrics.utilities.distributed")
    return module is not None and fn is getattr(module, "gather_all_tensors", None)


#: ids of the Metrics that sync with torchmetrics' own ``_sync_dist`` now, whatever the strategy (:func:`own_sync`)
_OWN: set[int] = set()


@contextlib.contextmanager
def own_sync(metrics: Iterable[Any]) -> Iterator[None]:
    """While open, ``metrics`` sync with torchmetrics' own ``_sync_dist`` (and this package's gather), whatever the
    strategy: a feature hands back to torchmetrics what it does not take over where its ranks must issue the
    collectives torchmetrics' own path issues."""
    added = {id(metric) for metric in metrics} - _OWN
    _OWN.update(added)
    try:
        yield
    finally:
        _OWN.difference_update(added)


def _run(original: Any, metric: Any, dist_sync_fn: Any, process_group: Any) -> None:
    strategy = STRATEGIES.get(_wanted["sync"])
    if strategy is not None and id(metric) not in _OWN and _is_torchmetrics_gather(dist_sync_fn, original):
        strategy.sync(metric, process_group, _mode_now())
    else:
        original(metric, dist_sync_fn, process_group)


def _replacement(original: Any) -> Callable[..., None]:
    def _sync_dist(self: Any, dist_sync_fn: Any = None, process_group: Any | None = None) -> None:
        if _compile.is_compiling():  # under torch.compile: one graph break, the whole sync runs eagerly
            _compile.run_eagerly(_run, original, self, dist_sync_fn, process_group)
        else:
            _run(original, self, dist_sync_fn, process_group)

    functools.update_wrapper(_sync_dist, original)  # name, doc, __wrapped__ = the original, restored by uninstall
    _sync_dist.__defaults__ = original.__defaults__  # the same default gather object as torchmetrics'
    return _sync_dist


def _apply_sites() -> None:
    """Put the chosen strategy's further sites in place, and take out another strategy's."""
    want = _wanted["sync"] if _SITE.on else None
    current = _wanted["sites"]
    if current == want:
        return
    old = STRATEGIES.get(current) if current is not None else None
    if old is not None and old.uninstall is not None:
        old.uninstall()
    _wanted["sites"] = None
    new = STRATEGIES.get(want) if want is not None else None
    if new is not None and new.install is not None:
        _wanted["sites"] = want  # before the call: an interrupted install is finished (or undone) next time
        new.install()


#: ``Metric._sync_dist``; each time it is brought in line (on install, uninstall, or at the end of the import of
#: ``torchmetrics.metric``), the chosen strategy's further sites follow.
_SITE = Site("torchmetrics.metric", "Metric", "_sync_dist", SYNC_MARK, _replacement, after=_apply_sites)


def install(sync: str = "torchmetrics", *, mode: str | Callable[[], str] = "local") -> None:
    """Set the replacement running ``sync`` (see :data:`STRATEGIES`) for every Metric; ``mode`` is the gradient mode,
    or a function giving it at each sync (the engine's effective mode). Idempotent: wraps at most once.

    While ``torchmetrics.metric`` is still being imported (a hook of the gather's module, which it imports, changed
    the strategy) there is no class yet: the post-import hook registered by an earlier call applies it once the
    import is done.
    """
    _wanted["sync"], _wanted["mode"] = check_sync(sync), mode
    _compile.watch_dynamo()  # the graph break's wrapper, once dynamo is imported
    _SITE.install()


def uninstall() -> None:
    """Put torchmetrics' original ``Metric._sync_dist`` back (the same object) and a strategy's sites; idempotent."""
    _SITE.uninstall()


def guarded() -> bool:
    """Whether ``torchmetrics.Metric._sync_dist`` currently is this package's replacement (any strategy)."""
    return _SITE.installed()


def installed() -> str | None:
    """The strategy the replacement runs now (``"torchmetrics"`` too), or ``None`` when it is not in place."""
    return _wanted["sync"] if _SITE.on and guarded() else None


def sites() -> tuple[str, ...]:
    """The further sites the strategy in force has put in place (what ``status()`` lists)."""
    strategy = STRATEGIES.get(_wanted["sites"]) if _wanted["sites"] is not None else None
    return strategy.sites() if strategy is not None and strategy.sites is not None else ()


def trusted() -> tuple[str, ...]:
    """Every registered strategy's :attr:`Strategy.trusted`, joined (what ``status()`` reports)."""
    return tuple(
        name
        for strategy in STRATEGIES.values()
        if strategy is not None and strategy.trusted is not None
        for name in strategy.trusted()
    )


def stepped_aside() -> dict[str, tuple[str, ...]]:
    """Every registered strategy's :attr:`Strategy.aside`, merged (what ``status()`` reports); empty until
    torchmetrics is imported."""
    if "torchmetrics.metric" not in sys.modules:
        return {}
    found: dict[str, tuple[str, ...]] = {}
    for strategy in STRATEGIES.values():
        if strategy is not None and strategy.aside is not None:
            for function, parts in strategy.aside().items():
                found[function] = (*found.get(function, ()), *parts)
    return found


def original_sync_dist() -> Any:
    """torchmetrics' own ``Metric._sync_dist`` (what the replacement wraps, if it is in place); needs torchmetrics."""
    return _SITE.original()
