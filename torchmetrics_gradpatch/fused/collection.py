"""Placeholder until the one-exchange collection sync lands: nothing is replaced."""

from __future__ import annotations


def install() -> None:
    """Nothing to install yet."""


def uninstall() -> None:
    """Nothing to uninstall yet."""


def installed() -> bool:
    """Nothing is installed."""
    return False
