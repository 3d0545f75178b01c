"""The parent's last resort: on SIGTERM, undo what the harness holds, then die of SIGTERM as before.

Python's default for SIGTERM ends the process at once, with no ``finally`` and no ``atexit``: the ranks would
die with it (their parent-death signal) but the processes they started and the directories the plugin made
would stay. While something is tracked here, SIGTERM first runs every tracked clean-up, then restores the
default action and re-sends itself, so the exit status is still "killed by SIGTERM". A handler of the user's
(anything but the default) is left alone, and so is a process where this is not the main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

__all__ = ["track", "untrack"]

_cleanups: dict[int, Callable[[], None]] = {}
_installed = False


def track(key: int, cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` if SIGTERM arrives before :func:`untrack` with the same ``key``."""
    global _installed
    _cleanups[key] = cleanup
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True


def untrack(key: int) -> None:
    _cleanups.pop(key, None)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    for cleanup in list(_cleanups.values()):
        with contextlib.suppress(Exception):
            cleanup()
    _cleanups.clear()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
