"""Put the patch back as a fresh import leaves it, between tests that share a process (and the fused sync's
per-group inline capacities with it).

Suite-side on purpose: the package carries no code that only a test harness needs, so this reaches into its
private modules (the engine's lock, records and settle step), which a test may do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torchmetrics_gradpatch import _api, _engine, fused
from torchmetrics_gradpatch.fused import membership


def reset_patch_state() -> str | None:
    """Close every open ``patched()`` block, switch compile support off, and apply the environment as the import
    does (default mode and sync, the import's patch). Returns ``None``, or why this process should not be reused
    (a block was left open). A refusal of torchmetrics' gather, which no test of a supported install meets in the
    suite's own process, is left as it is."""
    state = _engine._state
    with _engine._lock:
        _engine._sweep()
        left = len(state.records)
        state.settled = False
        state.records.clear()
        _engine._settle()
    _engine.set_defaults(compile_support=False)
    _engine.set_manual(False)
    with _engine._lock:
        state.manual_from = ""  # as a fresh import: nothing has switched the patch on yet
    _api.apply_environment()
    fused.reset()  # as a fresh import: no group's capacity, nothing kept
    membership._named.clear()
    return "the test left a torchmetrics_gradpatch.patched() block open" if left else None


def trust_module_classes(fn: Callable[..., object]) -> None:
    """Trust the classes that ``fn``'s test module lists in ``TRUSTED`` for this call (a module whose subject is
    the collection's exchange, not which classes it trusts, names its own Metric classes there)."""
    classes = getattr(sys.modules.get(fn.__module__), "TRUSTED", ())
    if classes:
        membership.trust(*classes)
