"""How big the slow tests run: ``TMGP_SLOW_PROFILE`` unset (or ``full``) is the full size, ``ci`` a bounded one.

``tox -m ci`` runs the slow selection (``pytest --run-slow -m slow``) with ``TMGP_SLOW_PROFILE=ci``, so CI
still runs every slow test -- the mutation check, the SIGKILL fault, the long stress -- with fewer examples and
shorter runs, within a few minutes on 2 cores. ``tox -e slow`` leaves it unset: the full counts.
"""

from __future__ import annotations

import os

VARIABLE = "TMGP_SLOW_PROFILE"
PROFILES = ("full", "ci")


def profile() -> str:
    """The profile asked for; a ``ValueError`` naming the variable for anything else (a typo must not pass)."""
    raw = os.environ.get(VARIABLE, "")
    value = raw.strip().lower() or "full"
    if value not in PROFILES:
        raise ValueError(f"{VARIABLE}={raw!r} is not a slow-test profile; use one of {', '.join(PROFILES)}.")
    return value


def sized(full: int, ci: int) -> int:
    """``full`` normally, ``ci`` under ``TMGP_SLOW_PROFILE=ci``."""
    return ci if profile() == "ci" else full
