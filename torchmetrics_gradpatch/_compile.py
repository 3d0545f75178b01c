"""The ``torch.compile`` shim, torch 2.0 to 2.15: :func:`check` (is dynamo tracing the caller?) and
:func:`run_eagerly` (call a function behind a graph break). Why: docs/design.md ("torch.compile").

Contract: a leaf that imports no module of this package; importing it imports neither torch nor ``torch._dynamo``
(torch on the first :func:`check`; the disable wrapper is made by a post-import hook once dynamo is imported,
registered by :func:`watch_dynamo`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import wrapt


def _find_is_compiling() -> Callable[[], bool]:
    """The check dynamo folds to ``True``, found without importing ``torch._dynamo`` (seconds)."""
    import torch  # the first check, not this module's import, loads torch (the package's import stays torch-free)

    compiler = getattr(torch, "compiler", None)
    found = getattr(compiler, "is_compiling", None)  # torch >= 2.3
    if found is None:
        found = getattr(torch._utils, "is_compiling", None)  # torch 2.1, 2.2
    return found if callable(found) else _dynamo_is_compiling  # pragma: no cover - torch 2.0


_late: list[Callable[[], bool]] = []  # torch 2.0: torch._dynamo.is_compiling, once dynamo is imported


def _dynamo_is_compiling() -> bool:  # pragma: no cover - torch 2.0 only
    return bool(_late and _late[0]())


_found: list[Callable[[], bool]] = []


def is_compiling_function() -> Callable[[], bool]:
    """torch's ``is_compiling`` (``True`` while dynamo traces the caller), found on first use; callers on a hot
    path keep it and call it directly.
    """
    if not _found:
        _found.append(_find_is_compiling())
    return _found[0]


def is_compiling() -> bool:
    """Whether dynamo is tracing the caller (see :func:`is_compiling_function`)."""
    return is_compiling_function()()


def _call(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


#: ``_call``, or ``_call`` in torch's compiler-disable wrapper once dynamo is imported (see :func:`_wrap`).
_eager: Callable[..., Any] = _call


def run_eagerly(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` behind a graph break: dynamo stops tracing here and the call runs in eager mode."""
    return _eager(function, *args)


def _wrap(_dynamo: Any) -> None:
    global _eager
    import torch  # dynamo is being imported, so torch is loaded already

    disable = getattr(getattr(torch, "compiler", None), "disable", None) or _dynamo.disable  # torch 2.0: _dynamo's
    _eager = disable(_call)
    found = getattr(_dynamo, "is_compiling", None)
    if callable(found) and not _late:
        _late.append(found)


_watching: list[bool] = []


def watch_dynamo() -> None:
    """Make the disable wrapper once ``torch._dynamo`` is imported (now, if it is). Idempotent.

    Called when the engine installs its trampoline or the sync replacement, or compile support is switched on; not
    at import: a post-import hook adds a finder to ``sys.meta_path``, and an import that patches nothing must leave
    the interpreter as it found it.
    """
    if not _watching:
        _watching.append(True)
        wrapt.register_post_import_hook(_wrap, "torch._dynamo")
