"""``torch.compile`` support: the gather runs eagerly, behind a graph break, in both gradient modes.

Why a graph break
-----------------
Inside a compiled function dynamo traces every collective it meets into torch's functional collectives. On gloo
that fails for torchmetrics' gather before any of this package's code matters: a 0-d metric state becomes a
``(1,)``-shaped output and gloo refuses it ("ProcessGroupGloo::allgather_coalesced: invalid size of output
tensor at index 0 (expected length (), got (1))"); unpatched torchmetrics 0.11-1.5 and native 1.6-1.9 fail the
same way. A traceable gather would have to be rewritten on functional collectives for every torch from 2.0 to
2.15 (their API and dynamo's handling of them changed across those releases), and would still need a
data-dependent shape exchange for uneven states, which dynamo graph-breaks on anyway. So the gather is not
traced: when dynamo reaches it, :func:`gather_when_compiling` (wrapped in torch's own compiler-disable API)
makes a graph break there, and the gather runs in eager mode, exactly the code and collectives that run without
``torch.compile``. The graph before the gather and the one after it are compiled; autograd connects them through
the gather's outputs, so the backward (global mode's ``all_to_all_single`` included) runs as in eager mode.

What it costs in eager mode
---------------------------
One call of torch's ``is_compiling`` check in :func:`torchmetrics_gradpatch._engine.dispatch` (the trampoline's
path; the engine keeps the check found by :func:`check`) and in the public
:func:`torchmetrics_gradpatch._modes.gather_all_tensors`. dynamo folds that call to ``True`` while tracing; in
eager mode it is an ordinary function call returning ``False``. The
compiler-disable wrapper (which costs more per call) is only reached under ``torch.compile``.
``benchmarks/bench_compile.py`` measures both against a gather without the check.

Version shim
------------
``torch.compiler.is_compiling`` and ``torch.compiler.disable`` are the public names from torch 2.3 and 2.1; torch 2.1
and 2.2 have ``torch._utils.is_compiling``, torch 2.0 only ``torch._dynamo``'s (its dynamo refuses Python 3.11 and
newer, but runs on 3.10). ``torch._dynamo`` is never imported by this package: on torch 2.0 the check asks dynamo's
``is_compiling`` once dynamo has been imported (by ``torch.compile``), and is ``False`` before.

Native torchmetrics (1.6 and newer)
-----------------------------------
Local mode installs nothing there (torchmetrics' own gather keeps the graph), so torchmetrics' gather is traced
and fails under ``torch.compile`` on gloo as above. :func:`compile_support` opts in to installing the trampoline
in local mode too while the patch is in force, so that the gather is this package's and takes the graph break.
It is opt-in, not automatic: without ``torch.compile`` it only adds the trampoline's cost to a gather that needs no
patch, and "native torchmetrics: nothing patched in local mode" stays true for everyone who does not ask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import wrapt

if TYPE_CHECKING:
    import torch

__all__ = [
    "check",
    "compile_support",
    "compile_support_enabled",
    "gather_when_compiling",
    "is_compiling",
    "watch_dynamo",
]


def _find_is_compiling() -> Callable[[], bool]:
    """The check dynamo folds to ``True``, found without importing ``torch._dynamo`` (seconds)."""
    import torch

    compiler = getattr(torch, "compiler", None)
    found = getattr(compiler, "is_compiling", None)  # torch >= 2.3
    if found is None:
        found = getattr(torch._utils, "is_compiling", None)  # torch 2.1, 2.2
    return found if callable(found) else _dynamo_is_compiling  # pragma: no cover - torch 2.0


_late: list[Callable[[], bool]] = []  # torch 2.0: torch._dynamo.is_compiling, once dynamo is imported


def _dynamo_is_compiling() -> bool:  # pragma: no cover - torch 2.0 only
    return bool(_late and _late[0]())


_found: list[Callable[[], bool]] = []


def check() -> Callable[[], bool]:
    """torch's check, ``True`` while dynamo traces the caller and ``False`` in eager mode; found on first use.

    Found lazily because finding it imports torch, which ``import torchmetrics_gradpatch`` does not; the engine
    asks for it once torchmetrics (and so torch) is imported and keeps it, so the hot path calls it directly.
    """
    if not _found:
        _found.append(_find_is_compiling())
    return _found[0]


def is_compiling() -> bool:
    """Whether dynamo is tracing the caller (see :func:`check`)."""
    return check()()


def _gather(result: torch.Tensor, group: Any, mode: str) -> list[torch.Tensor]:
    from torchmetrics_gradpatch._modes import gather_for  # _modes imports this module: look it up at call time

    return gather_for(mode)(result, group)


#: The gather, run eagerly behind a graph break: ``_gather`` in torch's compiler-disable wrapper (``mode`` is
#: already checked). The wrapper needs ``torch._dynamo``, which takes seconds to import, so it is made by a
#: post-import hook when dynamo is imported (``torch.compile`` imports it before tracing anything).
gather_when_compiling: Callable[[torch.Tensor, Any, str], list[torch.Tensor]] = _gather


def _wrap(_dynamo: Any) -> None:
    global gather_when_compiling
    import torch

    disable = getattr(getattr(torch, "compiler", None), "disable", None) or _dynamo.disable  # torch 2.0: _dynamo's
    gather_when_compiling = disable(_gather)
    found = getattr(_dynamo, "is_compiling", None)
    if callable(found) and not _late:
        _late.append(found)


_watching: list[bool] = []


def watch_dynamo() -> None:
    """Make the disable wrapper once ``torch._dynamo`` is imported (now, if it is). Idempotent.

    Called when the trampoline is installed and by :func:`compile_support`, not at import: a post-import hook
    adds a finder to ``sys.meta_path``, and an import that patches nothing (native torchmetrics in local mode, or a
    refused import) must leave the interpreter as it found it.
    """
    if not _watching:
        _watching.append(True)
        wrapt.register_post_import_hook(_wrap, "torch._dynamo")


def compile_support(enabled: bool = True) -> None:
    """On native torchmetrics (1.6 and newer), also install the trampoline in local mode, for ``torch.compile``.

    torchmetrics' own gather fails inside ``torch.compile`` on gloo (dynamo traces its collectives and gloo
    refuses the 0-d states). With ``compile_support()`` on, the patch in force installs this package's gather in
    local mode too, which runs behind a graph break with the same semantics as torchmetrics >= 1.6. It takes effect
    at once and while the patch is in force (``patch()``, which the import calls, or a ``patched()`` block).
    ``compile_support(False)`` goes back to installing nothing in local mode. On torchmetrics before 1.6 the
    trampoline is installed anyway and this changes nothing.
    """
    from torchmetrics_gradpatch import _engine

    watch_dynamo()
    with _engine._lock:
        previous = _engine._state.compile_native
        _engine._state.compile_native = bool(enabled)
        try:
            _engine._sync()
        except BaseException:
            _engine._state.compile_native = previous
            raise


def compile_support_enabled() -> bool:
    """Whether :func:`compile_support` is on."""
    from torchmetrics_gradpatch import _engine

    return bool(_engine._state.compile_native)
