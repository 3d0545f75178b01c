"""Which classes a ``MetricCollection``'s one exchange trusts (torchmetrics' own and those named with :func:`trust`,
process-wide), and :func:`explain`. docs/fused-sync.md#which-collections-it-trusts says which and why.
"""

from __future__ import annotations

import threading
from types import FunctionType
from typing import Any

from torchmetrics_gradpatch.fused import forms, internals, recognise

_lock = threading.Lock()
_named: set[type] = set()  # the classes named with trust()


def trust(*classes: type) -> None:
    """Let ``MetricCollection``'s one exchange take over members of these ``Metric`` subclasses of yours, or
    collections of these ``MetricCollection`` subclasses; each vouches for its bases, not for its subclasses.

    Name a class only where its ``update()`` and ``compute()`` share nothing with other members and leave the sync
    flags alone (docs/fused-sync.md#which-collections-it-trusts lists the rules), and after a run in check mode
    (``patched(sync="fused", check=True)``) gave no difference. Call it alike on every rank.
    """
    from torchmetrics import Metric, MetricCollection

    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, Metric | MetricCollection)):
            raise TypeError(
                f"torchmetrics_gradpatch.trust() takes Metric or MetricCollection subclasses; got {cls!r}. "
                "Pass the class itself (type(metric)), not an instance."
            )
    with _lock:
        _named.update(classes)


def trusted_names() -> tuple[str, ...]:
    """The classes named with :func:`trust`, qualified, sorted (what ``status()`` reports)."""
    return tuple(sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in tuple(_named)))


def _in_torchmetrics(module: object) -> bool:
    return isinstance(module, str) and (module == "torchmetrics" or module.startswith("torchmetrics."))


def trusted(cls: type, base: type) -> bool:
    """Whether ``cls`` (a subclass of ``base``: ``Metric`` or ``MetricCollection``) is named with :func:`trust` or
    torchmetrics' own up to ``base`` (a function in its namespaces defined outside torchmetrics makes it the user's)."""
    for each in cls.__mro__:
        if each is base or each in _named:
            return True
        if not _in_torchmetrics(each.__module__):
            return False
        if any(type(v) is FunctionType and not _in_torchmetrics(v.__module__) for v in vars(each).values()):
            return False
    return False  # not a subclass of base


def untrusted(collection: Any, members: list[tuple[str, Any]]) -> str | None:
    """Why the exchange does not trust ``collection`` with ``members``; ``None`` where it trusts them."""
    from torchmetrics import Metric, MetricCollection

    if not trusted(type(collection), MetricCollection):
        return f"the collection is a {type(collection).__qualname__}, a MetricCollection subclass it does not trust"
    for key, metric in members:
        for each in (metric, *forms.inside(metric)):
            if isinstance(each, Metric) and not trusted(type(each), Metric):
                inner = "" if each is metric else f" holds a {type(each).__qualname__}, which"
                return f"member {key!r}{inner} is a class it does not trust ({type(each).__qualname__})"
    return None


def explain(collection: Any, step: bool = False) -> dict[str, str]:
    """What the fused sync does with each member of ``collection`` in ``compute()`` (``step``: in a training step's
    ``forward``), by key: ``"joins the collection's exchange"``, or why not (every member: why the whole collection
    runs torchmetrics' own path). This rank's reading: no collective, nothing changed; where the ranks differ, the
    exchange follows the rank that trusts least.
    """
    members = [(str(key), metric) for key, metric in internals.children(collection).items()]
    codes = forms.forms_of(members, on_step=step)
    part = recognise.STEP if step else recognise.COMPUTE
    missing = [name for name, parts in recognise.aside().items() if part in parts]
    why = f"{missing[0]} is not recognised" if missing else untrusted(collection, members)
    if why is not None:
        return {key: f"runs torchmetrics' own path: {why}" for key, _ in members}
    return {key: forms.describe(code) for (key, _), code in zip(members, codes, strict=True)}
