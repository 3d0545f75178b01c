"""pytest plugin: ``@pytest.mark.ranks(n)`` runs a test's body on ``n`` real spawned gloo ranks.

Enabled explicitly, with ``-p torchmetrics_gradpatch.pytest_plugin`` (which names this module) or in a conftest's
``pytest_plugins``; no ``pytest11`` entry point, so installing the package never changes another project's test
run (docs/testing-your-metrics.md says why). The fixtures are set up in the pytest process, their values pickled
and sent to the ranks, which import the test module as pytest did and call the test (:mod:`._in_rank`); the
outcome is decided from every rank's record (a failure on any rank wins, then xfail, then skip, then pass).

Settings, one rule: the marker's argument > the command line (``--ranks-timeout``, ``--ranks-reuse``) > the ini
key (``ranks_timeout``, ``ranks_reuse``) > the default. One timeout per marked test: the marker's (the pool's
start-up apart); pytest-timeout's limit for that test is raised to a backstop beyond it, never below.

pytest's private names used, each because no public API does the job:
``_pytest.assertion.rewrite.AssertionRewritingHook`` (which modules pytest rewrote, to rewrite them in the
ranks), ``_pytest._code.code.ReprExceptionInfo``/``ReprFileLocation``/``ReprTracebackNative`` (a report
located at the rank's line, as ``--tb=line`` and the short summary read it), ``skip.Exception(...,
_use_item_location=True)`` (a skip reported at the test, as an in-test skip); in the ranks, see :mod:`._in_rank`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from torchmetrics_gradpatch.testing import _coverage, _pool, _reaper
from torchmetrics_gradpatch.testing._in_rank import (
    FreshMonkeyPatch,
    RankRecord,
    RankReport,
    RankTest,
    record_path,
    run_in_rank,
)
from torchmetrics_gradpatch.testing._spawn import DEFAULT_TIMEOUT, RankError, check_timeout, spawn_ranks

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

_MARKER_HELP = (
    "ranks(n, timeout=seconds, backend='gloo', reuse=False): run the test body on n spawned processes, each in an "
    "initialised default process group (torchmetrics_gradpatch); backend='nccl' puts rank r on cuda:r; "
    "reuse=True runs it in warm processes kept across tests"
)
_TIMEOUT_HELP = (
    f"seconds a @pytest.mark.ranks test may take on its ranks (default {DEFAULT_TIMEOUT:g}; a fresh spawn's "
    "start-up included, a warm pool's start-up not); the marker's timeout=... overrides it"
)
_REUSE_HELP = (
    "run @pytest.mark.ranks tests in warm rank processes kept across tests (true/false, default false); "
    "the marker's reuse=... overrides it"
)
_BACKENDS = ("gloo", "nccl")
#: How far beyond the marker's timeout pytest-timeout's limit for a marked test is put: the stack dump, the
#: terminate-then-kill grace and the report, so the marker's own report always comes first.
_BACKSTOP = 30.0
_FAILURE = pytest.StashKey["tuple[str, tuple[str, int] | None]"]()

#: Why a pytest fixture cannot reach a rank, and what to do instead (monkeypatch is replaced, not refused).
_PYTEST_FIXTURES = {
    "request": "read what the test needs from request in a fixture of your own and return plain data",
    "capsys": "the ranks' output goes to pytest's capture; write what you want to check to a file in tmp_path",
    "capfd": "the ranks' output goes to pytest's capture; write what you want to check to a file in tmp_path",
    "caplog": "log records stay in the rank; return or write what you want to check to a file in tmp_path",
    "recwarn": "a rank's warnings are re-issued in the pytest process; use pytest.warns inside the test body",
}


@pytest.hookimpl
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ranks", "torchmetrics_gradpatch: tests on spawned ranks (@pytest.mark.ranks)")
    group.addoption("--ranks-timeout", dest="ranks_timeout", metavar="SECONDS", default=None, help=_TIMEOUT_HELP)
    group.addoption("--ranks-reuse", dest="ranks_reuse", choices=("true", "false"), default=None, help=_REUSE_HELP)
    parser.addini("ranks_timeout", _TIMEOUT_HELP, default=None)
    parser.addini("ranks_reuse", _REUSE_HELP, type="bool", default=False)


@pytest.hookimpl
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)
    _settings(config, None, "ranks_timeout")  # a bad --ranks-timeout or ini value is a usage error, at once
    _settings(config, None, "ranks_reuse")


@pytest.hookimpl
def pytest_report_header(config: pytest.Config) -> str:
    timeout, where = _settings(config, None, "ranks_timeout")
    reuse, reuse_where = _settings(config, None, "ranks_reuse")
    return (
        f"torchmetrics_gradpatch ranks: timeout {timeout:g}s ({where}), reuse {str(reuse).lower()} ({reuse_where}), "
        f"pool start-up bound {_pool.STARTUP_TIMEOUT:g}s"
    )


@pytest.hookimpl
def pytest_unconfigure(config: pytest.Config) -> None:
    """No pool outlives the session (each pytest-xdist worker stops its own)."""
    _pool.close_all()


def _settings(config: pytest.Config, marker: pytest.Mark | None, name: str) -> tuple[Any, str]:
    """``(value, where it came from)`` for ``ranks_timeout`` or ``ranks_reuse``: marker > command line > ini.

    A bad value fails with a message naming where it came from.
    """
    key = name.removeprefix("ranks_")
    candidates: list[tuple[Any, str]] = []
    if marker is not None and key in marker.kwargs:
        candidates.append((marker.kwargs[key], f"ranks({key}=...)"))
    option = config.getoption(name)
    if option is not None:
        candidates.append((option, f"--ranks-{key}"))
    ini = config.getini(name)
    if name == "ranks_timeout" and ini not in (None, ""):
        candidates.append((ini, "ini ranks_timeout"))
    if name == "ranks_reuse" and ini:
        candidates.append((ini, "ini ranks_reuse"))
    value, where = candidates[0] if candidates else ((DEFAULT_TIMEOUT if key == "timeout" else False), "default")
    if key == "timeout":
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise pytest.UsageError(f"{where}: timeout must be a number of seconds, got {value!r}") from None
        try:
            return check_timeout(value, where), where
        except ValueError as err:
            raise pytest.UsageError(str(err)) from None
    if isinstance(value, str) and where == f"--ranks-{key}":
        value = value == "true"
    if not isinstance(value, bool):
        raise pytest.UsageError(f"{where} must be True or False, got {value!r}")
    return value, where


def _runner(item: pytest.Function, marker: pytest.Mark) -> Callable[..., list[Any]]:
    """The pool's run for reuse (marker > --ranks-reuse > ini ranks_reuse), else a fresh spawn_ranks."""
    reuse, _ = _settings(item.config, marker, "ranks_reuse")
    return _pool.run_pooled if reuse else spawn_ranks


# --- before the spawn -----------------------------------------------------------------------------------------------


def _ranks_options(item: pytest.Item, marker: pytest.Mark) -> tuple[int, float, str]:
    """``(n, timeout, backend)`` from ``@pytest.mark.ranks(n, ...)``; a clear failure for anything else."""
    usage = "use @pytest.mark.ranks(n), with optional timeout=seconds, backend='gloo' or 'nccl', reuse=True/False"
    kwargs = dict(marker.kwargs)
    args = list(marker.args)
    if "n" in kwargs and not args:
        args.append(kwargs.pop("n"))
    backend = kwargs.pop("backend", "gloo")
    for known in ("timeout", "reuse"):
        kwargs.pop(known, None)  # read by _settings
    if len(args) != 1 or kwargs:
        pytest.fail(f"{item.nodeid}: bad ranks marker {marker.args!r} {marker.kwargs!r}: {usage}", pytrace=False)
    n = args[0]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        pytest.fail(f"{item.nodeid}: the number of ranks must be a positive int, got {n!r}: {usage}", pytrace=False)
    try:
        timeout, _ = _settings(item.config, marker, "ranks_timeout")
    except pytest.UsageError as err:
        pytest.fail(f"{item.nodeid}: {err}", pytrace=False)
    if backend not in _BACKENDS:
        pytest.fail(f"{item.nodeid}: backend must be one of {_BACKENDS}, got {backend!r}", pytrace=False)
    return n, timeout, str(backend)


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
            timeout, _ = _settings(config, marker, "ranks_timeout")
            reuse, _ = _settings(config, marker, "ranks_reuse")
        except pytest.UsageError:
            continue  # the test fails with the reason when it runs
        backstop = timeout + (_pool.STARTUP_TIMEOUT if reuse else 0.0) + _BACKSTOP
        current = item.get_closest_marker("timeout")
        if current is not None and current.args and isinstance(current.args[0], (int, float)):
            backstop = max(backstop, float(current.args[0]))
        item.add_marker(pytest.mark.timeout(backstop), append=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A marked test whose backend cannot run here is skipped at once, before fixtures or ranks start."""
    marker = item.get_closest_marker("ranks")
    if marker is None:
        return
    n, backend = (marker.args or (marker.kwargs.get("n"),))[0], marker.kwargs.get("backend", "gloo")
    if backend == "nccl" and isinstance(n, int):  # a bad marker fails the call, with the reason
        found = _cuda_devices()
        if found < n:
            reason = f"ranks({n}, backend='nccl') needs {n} CUDA devices (one per rank); this machine has {found}"
            raise pytest.skip.Exception(reason, _use_item_location=True)  # at the test, not in this plugin


def _cuda_devices() -> int:
    """How many CUDA devices torch would see; 0 without importing torch where the machine has no GPU driver."""
    if "torch" not in sys.modules and not any(
        os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd")
    ):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _refuse_hypothesis(item: pytest.Function) -> None:
    if getattr(item.obj, "is_hypothesis_test", False):
        pytest.fail(
            f"{item.nodeid}: @given cannot be combined with @pytest.mark.ranks: each rank would draw and shrink "
            f"its own examples, so the ranks would test different data and their collectives would not match. "
            f"Give every rank the same data: @pytest.mark.parametrize with fixed examples, or examples drawn in "
            f"the test body from a generator seeded the same on every rank.",
            pytrace=False,
        )


def _unsendable(name: str, value: Any) -> str | None:
    """Why an unpicklable pytest object cannot go to a rank (it belongs to the pytest process), or None."""
    module = type(value).__module__ or ""
    if not module.startswith(("_pytest", "pytest")):
        return None
    advice = _PYTEST_FIXTURES.get(name, "use it in a fixture of your own and return plain data")
    return (
        f"{name!r} is pytest's {type(value).__name__} object: it belongs to the pytest process (it holds the "
        f"session, the configuration or the capture) and a rank cannot use it. Instead: {advice}."
    )


def _pickled_or_fail(values: dict[str, Any], what: str, item: pytest.Function) -> bytes:
    """Pickle ``values``; fail the test naming the first value that cannot be sent, and why."""
    for name, value in values.items():
        try:
            pickle.dumps(value)
        except Exception as err:
            problem = _unsendable(name, value) or (
                f"{what} {name!r} cannot be sent to the ranks: its value {type(value).__name__} cannot be "
                f"pickled ({type(err).__name__}: {err}). Ranks get fixture values pickled from the pytest "
                f"process: return something picklable (a path, numbers, tensors) or build the object in the "
                f"test body. A fixture needed only for what it does in the pytest process (monkeypatch.setenv: "
                f"the ranks inherit the environment) can be requested with @pytest.mark.usefixtures."
            )
        else:
            continue
        pytest.fail(f"{item.nodeid}: {problem}", pytrace=False)  # outside except: pickle's traceback is noise
    return pickle.dumps(values)


def _rewritten_modules() -> dict[str, str]:
    """Every module the pytest process imported through pytest's assertion-rewriting import hook."""
    from _pytest.assertion.rewrite import AssertionRewritingHook

    found = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(getattr(module, "__loader__", None), AssertionRewritingHook) and file:
            found[name] = file
    return found


def _argnames(item: pytest.Function) -> list[str]:
    """The names the test function takes (what pytest passes it), from its signature."""
    parameters = inspect.signature(item.obj).parameters.values()
    positional = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]


def _describe(item: pytest.Function, outbox: str, backend: str) -> RankTest:
    classes = []
    node = item.parent
    while isinstance(node, pytest.Class):
        classes.append(node.name)
        node = node.parent
    module = item.module
    assert module is not None and module.__file__ is not None
    funcargs = {name: item.funcargs[name] for name in _argnames(item)}
    funcargs = {k: FreshMonkeyPatch() if isinstance(v, pytest.MonkeyPatch) else v for k, v in funcargs.items()}
    instance = getattr(item, "instance", None)
    state = vars(instance) if instance is not None and hasattr(instance, "__dict__") else {}
    return RankTest(
        module=module.__name__,
        path=module.__file__,
        classes=tuple(reversed(classes)),
        function=item.originalname,
        rewrite=_rewritten_modules(),
        kwargs=_pickled_or_fail(funcargs, "fixture", item),
        instance_state=_pickled_or_fail(state, "test class attribute", item) if state else None,
        showlocals=bool(item.config.getoption("showlocals", False)),
        tbstyle=str(item.config.getoption("tbstyle", "auto")),
        outbox=outbox,
        capture_output=item.config.getoption("capture", "fd") in ("sys", "tee-sys"),
        coverage=_coverage.parent_config(),
        backend=backend,
    )


# --- the run and its outcome ----------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a ``ranks``-marked test on its ranks; leave every other test to pytest."""
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        return None
    n, timeout, backend = _ranks_options(pyfuncitem, marker)
    _refuse_hypothesis(pyfuncitem)
    with _outbox() as outbox:
        failure = _run_on_ranks(_runner(pyfuncitem, marker), _describe(pyfuncitem, outbox, backend), n, timeout)
        records = {}
        for rank in range(n):
            path = record_path(outbox, rank)
            if path.is_file():
                records[rank] = pickle.loads(path.read_bytes())
    _deliver(pyfuncitem, records)
    if failure is not None:
        _fail(pyfuncitem, n, failure, records)
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


def _deliver(item: pytest.Function, records: dict[int, RankRecord]) -> None:
    """Hand the pytest process what the ranks left: coverage, output, warnings, the return-value warning."""
    seen = set()
    for record in records.values():
        _coverage.merge(record.coverage)
        sys.stdout.write(record.stdout)
        sys.stderr.write(record.stderr)
        for entry in record.warnings:
            if entry in seen:
                continue
            seen.add(entry)
            blob, message, filename, lineno = entry
            try:
                category = pickle.loads(blob)
            except Exception:
                category = UserWarning
            warnings.warn_explicit(message, category, filename, lineno)
    returned = next((record.returned for record in records.values() if record.returned), None)
    if returned is not None:  # where pytest would put it: at the test function
        warnings.warn_explicit(
            pytest.PytestReturnNotNoneWarning(
                f"Test functions should return None, but {item.nodeid} returned {returned} on its ranks.\n"
                "Did you mean to use `assert` instead of `return`?"
            ),
            pytest.PytestReturnNotNoneWarning,
            str(item.path),
            (item.location[1] or 0) + 1,
        )


def _left_early(failure: RankError, n: int, records: dict[int, RankRecord]) -> str:
    """Name ranks that finished while their peers waited for them: "rank 1 returned; rank 0 waited in all_reduce"."""
    finished = [r for r in records.values() if r.outcome != "failed"]
    waiting = [(rank, failure.collectives.get(rank)) for rank in range(n) if rank not in records]
    waiting += [(r.rank, r.report.collective) for r in records.values() if r.report is not None]
    waited = [f"rank {rank} waited in {where}" for rank, where in sorted(waiting) if where]
    if not finished or not waited:
        return ""
    verbs = {"passed": "returned", "skipped": "skipped", "xfailed": "xfailed"}
    left = [f"rank {r.rank} {verbs[r.outcome]}" + (f" ({r.reason})" if r.reason else "") for r in finished]
    return "; ".join(left + waited)


def _as_raised(record: RankRecord | None, message: str) -> BaseException:
    """An exception of the rank's own type (so ``xfail(raises=...)`` matches) with the rank's text.

    A subclass made here, so that no constructor of the user's runs; a rank that died or timed out, or an
    exception that is not an ``Exception`` (pytest's outcomes, KeyboardInterrupt), gives a plain error instead.
    """
    report = record.report if record is not None else None
    try:
        exc_type = pickle.loads(report.exc_type) if report is not None and report.exc_type is not None else None
        if exc_type is None or not issubclass(exc_type, Exception):
            return _RanksFailedError(message)
        text = report.message if report is not None else message
        proxy = type(exc_type.__name__, (exc_type,), {"__str__": lambda self: text, "__module__": exc_type.__module__})
        error: BaseException = proxy.__new__(proxy)  # type: ignore[call-overload]
        BaseException.__init__(error, text)
        return error
    except Exception:  # a class that cannot be unpickled here, or subclassed
        return _RanksFailedError(message)


class _RanksFailedError(Exception):
    """A rank died or timed out (or raised something that cannot be re-created here)."""


def _fail(item: pytest.Function, n: int, failure: RankError, records: dict[int, RankRecord]) -> None:
    """Fail the test with the ranks' story: the first failure, what the other ranks did, every traceback."""
    details, headline, crash = failure.details, "", None
    for rank, record in records.items():
        if record.report is not None:  # the runner's details hold str(report): put pytest's explanations in
            finished = record.report.finished()
            details = details.replace(str(record.report), finished)
            if rank == failure.rank:
                headline, crash = " " + RankReport.headline(finished), record.report.crash
    during = " while the rank pool was starting (not counted in the test's timeout)" if failure.starting else ""
    first = f"rank {failure.rank} of {n} {failure.reason}{during}:{headline}"
    note = _left_early(failure, n, records)
    if note:
        first = f"{note}: {first}"
    others = [] if note else [f"rank {r.rank} {r.outcome}: {r.reason}" for r in records.values() if r.reason]
    message = "\n\n".join([first, *others, details])
    item.stash[_FAILURE] = (message, crash)
    raise _as_raised(records.get(failure.rank), first)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failure on the ranks is shown as the ranks' story, located at the rank's line in the test file."""
    outcome = yield
    report = outcome.get_result()
    failure = item.stash.get(_FAILURE, None)
    if call.when == "call" and failure is not None and report.failed:
        from _pytest._code.code import ReprExceptionInfo, ReprFileLocation, ReprTracebackNative

        message, crash = failure
        path, lineno = crash if crash is not None else (str(item.path), (item.location[1] or 0) + 1)
        lines = [line + "\n" for line in message.splitlines()]
        report.longrepr = ReprExceptionInfo(
            reprtraceback=ReprTracebackNative(lines), reprcrash=ReprFileLocation(str(Path(path)), lineno, message)
        )
