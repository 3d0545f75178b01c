"""pytest plugin: ``@pytest.mark.ranks(n)`` runs a test's body on ``n`` real spawned gloo ranks.

The suite's own plugin: tests/conftest.py lists it in ``pytest_plugins``; a pytest run elsewhere (the harness's own
tests) names it with ``-p tests.harness.plugin``. The package ships no plugin and no ``pytest11`` entry point. The
fixtures are set up in the pytest process, their values pickled and sent to the ranks, which import the test module
as pytest did and call the test (:mod:`._in_rank`); the outcome is decided from every rank's record (a failure on
any rank wins, then xfail, then skip, then pass).

Settings, one rule: the marker's argument > the command line (``--ranks-timeout``, ``--ranks-reuse``) > the ini
key (``ranks_timeout``, ``ranks_reuse``) > the default. One timeout per marked test: the marker's (the pool's
start-up apart); pytest-timeout's limit for that test is raised to a backstop beyond it, never below.

Beside it, parent side: :mod:`._settings` (the settings), :mod:`._sending` (what goes to the ranks),
:mod:`._outcome` (what comes back). pytest's private name used here: ``skip.Exception(...,
_use_item_location=True)`` (a skip reported at the test, as an in-test skip, not in this plugin); the others are
named where they are used (:mod:`._sending`, :mod:`._outcome`, :mod:`._in_rank`).
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

from tests.harness import _outcome, _pool, _reaper, _sending, _settings
from tests.harness._collect import RankError
from tests.harness._in_rank import run_in_rank
from tests.harness._records import RankTest, record_path
from tests.harness._spawn import spawn_ranks

__all__ = [
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_pyfunc_call",
    "pytest_report_header",
    "pytest_runtest_makereport",
    "pytest_runtest_setup",
    "pytest_unconfigure",
]


@pytest.hookimpl
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ranks", "torchmetrics_gradpatch: tests on spawned ranks (@pytest.mark.ranks)")
    group.addoption(
        "--ranks-timeout", dest="ranks_timeout", metavar="SECONDS", default=None, help=_settings.TIMEOUT_HELP
    )
    group.addoption(
        "--ranks-reuse", dest="ranks_reuse", choices=("true", "false"), default=None, help=_settings.REUSE_HELP
    )
    parser.addini("ranks_timeout", _settings.TIMEOUT_HELP, default=None)
    parser.addini("ranks_reuse", _settings.REUSE_HELP, type="bool", default=False)


@pytest.hookimpl
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _settings.MARKER_HELP)
    _settings.setting(config, None, "ranks_timeout")  # a bad --ranks-timeout or ini value is a usage error, at once
    _settings.setting(config, None, "ranks_reuse")


@pytest.hookimpl
def pytest_report_header(config: pytest.Config) -> str:
    timeout, where = _settings.setting(config, None, "ranks_timeout")
    reuse, reuse_where = _settings.setting(config, None, "ranks_reuse")
    return (
        f"torchmetrics_gradpatch ranks: timeout {timeout:g}s ({where}), reuse {str(reuse).lower()} ({reuse_where}), "
        f"pool start-up bound {_pool.STARTUP_TIMEOUT:g}s"
    )


@pytest.hookimpl
def pytest_unconfigure(config: pytest.Config) -> None:
    """No pool outlives the session (each pytest-xdist worker stops its own)."""
    _pool.close_all()


def _runner(item: pytest.Function, marker: pytest.Mark) -> Callable[..., list[Any]]:
    """The pool's run for reuse (marker > --ranks-reuse > ini ranks_reuse), else a fresh spawn_ranks."""
    reuse, _ = _settings.setting(item.config, marker, "ranks_reuse")
    return _pool.run_pooled if reuse else spawn_ranks


# --- before the spawn -----------------------------------------------------------------------------------------------


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One timeout story: under pytest-timeout, a marked test's limit becomes a backstop beyond the marker's."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        marker = item.get_closest_marker("ranks")
        if marker is None:
            continue
        try:
            timeout, _ = _settings.setting(config, marker, "ranks_timeout")
            reuse, _ = _settings.setting(config, marker, "ranks_reuse")
        except pytest.UsageError:
            continue  # the test fails with the reason when it runs
        backstop = timeout + (_pool.STARTUP_TIMEOUT if reuse else 0.0) + _settings.BACKSTOP
        current = item.get_closest_marker("timeout")
        if current is not None and current.args and isinstance(current.args[0], (int, float)):
            backstop = max(backstop, float(current.args[0]))
        backstop = min(backstop, threading.TIMEOUT_MAX)  # any finite marker timeout: pytest-timeout's timer caps here
        item.add_marker(pytest.mark.timeout(backstop), append=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A marked test whose backend cannot run here is skipped at once, before fixtures or ranks start."""
    marker = item.get_closest_marker("ranks")
    if marker is None:
        return
    n, backend = (marker.args or (marker.kwargs.get("n"),))[0], marker.kwargs.get("backend", "gloo")
    if backend == "nccl" and isinstance(n, int):  # a bad marker fails the call, with the reason
        found = _settings.cuda_devices()
        if found < n:
            reason = f"ranks({n}, backend='nccl') needs {n} CUDA devices (one per rank); this machine has {found}"
            raise pytest.skip.Exception(reason, _use_item_location=True)  # at the test, not in this plugin


# --- the run and its outcome ----------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a ``ranks``-marked test on its ranks; leave every other test to pytest."""
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        return None
    n, timeout, backend = _settings.ranks_options(pyfuncitem, marker)
    _sending.refuse_hypothesis(pyfuncitem)
    with _outbox() as outbox:
        failure = _run_on_ranks(_runner(pyfuncitem, marker), _sending.describe(pyfuncitem, outbox, backend), n, timeout)
        records = {}
        for rank in range(n):
            path = record_path(outbox, rank)
            if path.is_file():
                records[rank] = pickle.loads(path.read_bytes())
    _outcome.deliver(pyfuncitem, records)
    if failure is not None:
        _outcome.fail(pyfuncitem, n, failure, records)
    for kind in ("xfailed", "skipped"):
        found = [record for record in records.values() if record.outcome == kind]
        if found:
            reason = f"rank {found[0].rank} of {n}: {found[0].reason}"
            if kind == "xfailed":
                pytest.xfail(reason)
            raise pytest.skip.Exception(reason, _use_item_location=True)  # at the test, as an in-test skip
    return True


@contextlib.contextmanager
def _outbox() -> Iterator[str]:
    """The directory the ranks leave their records in, removed afterwards (also if SIGTERM ends pytest)."""
    path = tempfile.mkdtemp(prefix="tmgp-outbox-")
    _reaper.track(id(path), lambda: shutil.rmtree(path, ignore_errors=True))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        _reaper.untrack(id(path))


def _run_on_ranks(run: Callable[..., list[Any]], spec: RankTest, n: int, timeout: float) -> RankError | None:
    """Run :func:`run_in_rank` on ``n`` ranks with ``run`` (the warm pool or a fresh :func:`spawn_ranks`); the
    runner's error if a rank raised, died or timed out."""
    try:
        run(run_in_rank, n, args=(spec,), timeout=timeout)
    except RankError as error:
        return error
    return None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failure on the ranks is shown as the ranks' story, located at the rank's line in the test file."""
    result = yield
    report = result.get_result()
    failure = item.stash.get(_outcome.FAILURE, None)
    if call.when == "call" and failure is not None and report.failed:
        report.longrepr = _outcome.longrepr(item, failure)
