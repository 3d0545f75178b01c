"""Which classes a ``MetricCollection``'s one exchange trusts, and why each member of a collection joins it or not.

The collection's exchange runs every member's update before any member's ``compute()``; torchmetrics runs them one
after another. The two agree wherever members share nothing, which torchmetrics' own classes are proven to do by
its suites and this package's. So a collection joins the exchange only where its class, and the class of every
Metric in it, is trusted: one of torchmetrics' own (every class between it and ``Metric`` or ``MetricCollection``,
and every function in their namespaces, defined in the torchmetrics package), or one named with :func:`trust`.
Anything else runs torchmetrics' own path for the whole collection (each Metric still gets the fused sync of one
Metric, which reorders nothing). :func:`explain` says, member by member, what the exchange does with a collection.

The registry is process-wide, like the patch. Every rank must name the same classes; where they do not, the ranks
that trust less step aside and every rank follows them (docs/fused-sync.md#which-collections-it-trusts).
"""

from __future__ import annotations

import threading
from types import FunctionType
from typing import Any

from torchmetrics_gradpatch.fused import forms

__all__ = ["explain", "trust", "trusted", "trusted_names", "untrusted"]

_lock = threading.Lock()
#: the classes named with :func:`trust` (each also vouches for its bases)
_named: set[type] = set()


def trust(*classes: type) -> None:
    """Let ``MetricCollection``'s one exchange take over members of these classes of yours (``Metric``
    subclasses), or collections of these ``MetricCollection`` subclasses.

    Name a class only after a run in check mode (``patched(sync="fused", check=True)``) gave no difference, and only
    if its ``update()`` and ``compute()`` read or compute no other member, share no module, buffer or input tensor
    with one, change nothing they keep in place in ``compute()``, do not depend on the sync flags
    (``_to_sync``, ``_is_synced``, ``_should_unsync``) and never call ``sync()``/``unsync()`` themselves. A class
    named here vouches for its bases up to ``Metric`` too; a subclass of it must be named on its own.
    Call it alike on every rank.
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
    """Whether ``cls`` (a subclass of ``base``: ``Metric`` or ``MetricCollection``) is trusted: named with
    :func:`trust`, or torchmetrics' own up to ``base`` (a method replaced on a torchmetrics class by code outside
    torchmetrics makes it the user's)."""
    for each in cls.__mro__:
        if each is base or each in _named:
            return True
        if not _in_torchmetrics(each.__module__):
            return False
        for value in vars(each).values():
            if type(value) is FunctionType and not _in_torchmetrics(value.__module__):
                return False
    return False  # not a subclass of base


def untrusted(collection: Any, members: list[tuple[str, Any]]) -> str | None:
    """Why the collection's exchange does not trust ``collection`` with these ``members`` (its own class, or the
    first member holding a Metric of a class not trusted), or ``None`` where it trusts them."""
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
    ``forward``), by key: ``"joins the collection's exchange"``, or why not. Where the whole collection runs
    torchmetrics' own path (a class it does not trust), every member says so and why.

    A local reading: it looks at this rank's collection and this process's settings, issues no collective, and
    changes nothing (where the ranks differ, the exchange follows the rank that trusts least).
    """
    from torchmetrics_gradpatch.fused import aside

    members = [(str(key), metric) for key, metric in collection._modules.items()]
    codes = forms.forms_of(members, on_step=step)
    part = aside.STEP if step else aside.COMPUTE
    why = untrusted(collection, members)
    missing = [name for name, parts in aside.aside().items() if part in parts]
    if missing:
        why = f"{missing[0]} is not recognised"
    if why is not None:
        return {key: f"runs torchmetrics' own path: {why}" for key, _ in members}
    return {key: forms.describe(code) for (key, _), code in zip(members, codes, strict=True)}
