"""Run code on real gloo ranks: :func:`spawn_ranks`, and the ``ranks`` pytest marker built on it.

The suite's own harness (tests/conftest.py registers :mod:`tests.harness.plugin`); no part of the wheel.
Names for the tests: :func:`spawn_ranks`, :class:`RankError`, :data:`DEFAULT_TIMEOUT`.

Layout, one way (parent side -> rank side, never back):

* parent side: ``_spawn`` (spawn_ranks and its argument checks), ``_processes`` (the store, dump files, start and
  teardown of rank processes), ``_collect`` (reading the answers, :class:`RankError`), ``_pool`` (the warm pool),
  ``_reaper`` (clean-up on SIGTERM), ``plugin`` (the pytest hooks) with ``_settings`` (marker > command line >
  ini), ``_sending`` (what goes to the ranks) and ``_outcome`` (what comes back);
* rank side: ``_rank`` (a rank's start, its group, its messages), ``_worker`` (a pool worker), ``_in_rank`` (a
  marked test inside a rank);
* both, importing nothing of either side: ``_records`` (the data a marked test's ranks exchange with the pytest
  process), ``_coverage`` (coverage measured in the ranks, merged in the parent).

The names here are loaded on first use, so that a rank, which imports this package to reach ``_rank``, loads
nothing of the parent side. Nothing here imports the package under test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.harness._spawn import DEFAULT_TIMEOUT, RankError, spawn_ranks

__all__ = ["DEFAULT_TIMEOUT", "RankError", "spawn_ranks"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tests.harness import _spawn

        return getattr(_spawn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
