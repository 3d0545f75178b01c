"""Coverage of code that runs only inside spawned ranks, without any configuration from the user.

pytest-cov 7 no longer measures subprocesses, and coverage's own ``patch = subprocess`` needs the child to start
Python through a ``.pth`` hook with a config file and a data file per process, then a ``combine``. A rank is
simpler than an arbitrary subprocess: the pytest process sends it the test and waits for its answer, so the
rank can measure itself and send its data back with the answer:

1. in the pytest process, :func:`parent_config` returns the configuration of the coverage run in progress
   (``Coverage.current()``: started by pytest-cov, or by ``coverage run -m pytest``), or ``None`` when nothing
   measures;
2. in the rank, :func:`start` starts a :class:`coverage.Coverage` with that very configuration (source,
   include/omit, branch, plugins) and **no data file**, just before the test body runs; :func:`finish` stops it
   and returns its data as bytes (``CoverageData.dumps()``);
3. in the pytest process, :func:`merge` adds those bytes to the running coverage's data, which pytest-cov or
   ``coverage run`` then saves, combines and reports as usual.

No file is written by a rank, so nothing extra appears in the report or on disk. The interface is three plain
functions so that any runner (a fresh spawn per test, or a pool of warm ranks) can call them around each test.
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
