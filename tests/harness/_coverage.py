"""Coverage of code that runs only inside the ranks, with no configuration from the user.

pytest-cov 7 measures no subprocess, and coverage's own subprocess support needs a ``.pth`` hook, a config file
and a ``combine``. A rank answers the pytest process anyway, so it measures itself and sends the data back:
:func:`parent_config` (pytest process: the running coverage's configuration, or ``None``), :func:`start` and
:func:`finish` (rank: measure the test body with that configuration and no data file; the data as bytes), and
:func:`merge` (pytest process: add the bytes to the running data, which pytest-cov or ``coverage run`` saves).

Invariant: used on both sides; imports only the standard library (coverage inside functions). No rank writes
a file, so nothing extra appears in the report or on disk.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

__all__ = ["finish", "merge", "parent_config", "start"]


def _current() -> Any:
    try:
        import coverage
    except ImportError:
        return None
    return coverage.Coverage.current()


def parent_config() -> bytes | None:
    """In the pytest process: the running coverage's configuration, pickled; ``None`` if nothing measures."""
    cov = _current()
    if cov is None:
        return None
    return pickle.dumps(cov.config)


def start(config: bytes | None) -> Any:
    """In a rank, before the test body: start measuring with the parent's ``config``; returns a handle or ``None``.

    Returns ``None`` (and measures nothing) when the parent measured nothing, or when coverage already runs in
    this process (a user's own ``COVERAGE_PROCESS_START`` set-up): that run records to its own file.
    """
    if config is None or _current() is not None:
        return None
    import coverage

    cov = coverage.Coverage(data_file=None)  # no data file: the data goes back to the parent as bytes
    cov.config = pickle.loads(config)
    cov.start()
    return cov


def finish(handle: Any) -> bytes | None:
    """In a rank, after the test body (also when it raised): stop measuring; the data as bytes for :func:`merge`."""
    if handle is None:
        return None
    handle.stop()
    with warnings.catch_warnings():
        # "module was never imported", "no data collected": true of a rank, not of the run; the parent warns
        warnings.simplefilter("ignore")
        data = handle.get_data()
    payload: bytes = data.dumps()
    return payload


def merge(payload: bytes | None) -> None:
    """In the pytest process: add a rank's data (from :func:`finish`) to the running coverage's data."""
    cov = _current()
    if payload is None or cov is None:
        return
    import coverage

    data = coverage.CoverageData(no_disk=True)
    data.loads(payload)
    with warnings.catch_warnings():
        # get_data() checks for never-imported modules: too early to say mid-run; the run's end checks again
        warnings.simplefilter("ignore")
        cov.get_data().update(data)
