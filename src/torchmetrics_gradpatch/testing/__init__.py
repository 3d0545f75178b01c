"""Run code on real gloo ranks: :func:`spawn_ranks`, and the ``ranks`` pytest marker built on it."""

from __future__ import annotations

from torchmetrics_gradpatch.testing._spawn import DEFAULT_TIMEOUT, RankError, spawn_ranks

__all__ = ["DEFAULT_TIMEOUT", "RankError", "spawn_ranks"]
