"""pytest plugin: ``@pytest.mark.ranks(n)`` runs a test's body on ``n`` real spawned gloo ranks.

Enable it explicitly, with ``-p torchmetrics_gradpatch.pytest_plugin`` or
``pytest_plugins = ["torchmetrics_gradpatch.pytest_plugin"]`` in a conftest. It has no ``pytest11`` entry point on
purpose: loading it imports :mod:`torchmetrics_gradpatch`, which patches torchmetrics, and installing the package
must never change another project's test run.

How a marked test runs, and why:

* **One spawn per test.** The fixtures are set up in the pytest process as usual; their values are pickled and
  :func:`torchmetrics_gradpatch.testing.spawn_ranks` starts ``n`` fresh interpreters, each inside its gloo
  group before the test body runs (so rank ``r`` is the process that runs the body as rank ``r``). Every rank
  gets the same fixture values: ``tmp_path`` is the same directory everywhere. spawn_ranks also gives the
  timeout, the hung rank's stack and "no process left behind".
* **The module is imported the way pytest found it.** A rank starts with the pytest process's ``sys.path``
  (which holds what pytest's ``prepend``/``append`` import modes put there: the rootdir-relative basedir of the
  module, conftest directories), then imports the test module under the name pytest gave it, from the same
  file (``importlib`` mode, whose names are not importable, is loaded straight from the file). The rank's side
  is :mod:`torchmetrics_gradpatch._in_rank`.
* **The outcome does not depend on which rank finishes first.** Every rank that finishes leaves a record (see
  ``_in_rank``); the pytest process decides from all of them: a failure on any rank wins, then xfail, then
  skip, then pass. The failure is raised as an exception of the rank's own type (so ``xfail(raises=...)``
  matches) and reported at the rank's line in the test file (so ``--tb=line`` points there).
* **What a test leaves in the pytest process is delivered there**: the ranks' warnings (re-issued under
  pytest's filters), pytest's return-value warning, print output under ``--capture=sys``, and the ranks'
  coverage data (:mod:`torchmetrics_gradpatch._rank_coverage`).
"""

from __future__ import annotations

import pickle
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

from torchmetrics_gradpatch.testing import _coverage as _rank_coverage
from torchmetrics_gradpatch.testing import _pool
from torchmetrics_gradpatch.testing._in_rank import (
    FreshMonkeyPatch,
    RankRecord,
    RankReport,
    RankTest,
    record_path,
    run_in_rank,
)
from torchmetrics_gradpatch.testing._spawn import DEFAULT_TIMEOUT, RankError, spawn_ranks

__all__ = [
    "pytest_addoption",
    "pytest_configure",
    "pytest_pyfunc_call",
    "pytest_runtest_makereport",
    "pytest_unconfigure",
]

_MARKER_HELP = (
    "ranks(n, timeout=seconds, backend='gloo'): run the test body on n spawned processes, each in an initialised "
    f"default process group (torchmetrics_gradpatch); timeout defaults to {DEFAULT_TIMEOUT:g} s, start-up "
    "included; backend='nccl' puts rank r on cuda:r; reuse=True runs it in warm processes kept across tests "
    "(default: the ranks_reuse ini option)"
)
_BACKENDS = ("gloo", "nccl")
_FAILURE = pytest.StashKey["tuple[str, tuple[str, int] | None]"]()

#: Why a pytest fixture cannot reach a rank, and what to do instead (monkeypatch is replaced, not refused).
_PYTEST_FIXTURES = {
    "request": "read what the test needs from request in a fixture of your own and return plain data",
    "capsys": "the ranks' output goes to pytest's capture; write what you want to check to a file in tmp_path",
    "capfd": "the ranks' output goes to pytest's capture; write what you want to check to a file in tmp_path",
    "caplog": "log records stay in the rank; return or write what you want to check to a file in tmp_path",
    "recwarn": "a rank's warnings are re-issued in the pytest process; use pytest.warns inside the test body",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)


# --- warm rank pool (issue 18 item 5): the ini option, the choice of runner, the teardown -------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "ranks_reuse",
        "run @pytest.mark.ranks tests in warm rank processes kept across tests (torchmetrics_gradpatch); "
        "a marker's reuse=True/False overrides it",
        type="bool",
        default=False,
    )


def _runner(item: pytest.Function, marker: pytest.Mark) -> Callable[..., list[Any]]:
    """The pool's run for ``reuse=True`` (or the ``ranks_reuse`` ini option), else a fresh spawn_ranks."""
    reuse = marker.kwargs.get("reuse", item.config.getini("ranks_reuse"))
    if not isinstance(reuse, bool):
        pytest.fail(f"{item.nodeid}: ranks(reuse=...) must be True or False, got {reuse!r}", pytrace=False)
    return _pool.run_pooled if reuse else spawn_ranks


def pytest_unconfigure(config: pytest.Config) -> None:
    """No pool outlives the session (each pytest-xdist worker stops its own)."""
    _pool.close_all()


# --- end of the warm rank pool's part -----------------------------------------------------------------------------


# --- before the spawn -----------------------------------------------------------------------------------------------


def _ranks_options(item: pytest.Function, marker: pytest.Mark) -> tuple[int, float, str]:
    """``(n, timeout, backend)`` from ``@pytest.mark.ranks(n, ...)``; a clear failure for anything else."""
    usage = "use @pytest.mark.ranks(n), with optional timeout=seconds and backend='gloo' or 'nccl'"
    kwargs = dict(marker.kwargs)
    args = list(marker.args)
    if "n" in kwargs and not args:
        args.append(kwargs.pop("n"))
    timeout = kwargs.pop("timeout", DEFAULT_TIMEOUT)
    backend = kwargs.pop("backend", "gloo")
    kwargs.pop("reuse", None)  # read by _runner (warm rank pool)
    if len(args) != 1 or kwargs:
        pytest.fail(f"{item.nodeid}: bad ranks marker {marker.args!r} {marker.kwargs!r}: {usage}", pytrace=False)
    n = args[0]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        pytest.fail(f"{item.nodeid}: the number of ranks must be a positive int, got {n!r}: {usage}", pytrace=False)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        pytest.fail(f"{item.nodeid}: timeout must be a positive number of seconds, got {timeout!r}", pytrace=False)
    if backend not in _BACKENDS:
        pytest.fail(f"{item.nodeid}: backend must be one of {_BACKENDS}, got {backend!r}", pytrace=False)
    return n, float(timeout), str(backend)


def _refuse_hypothesis(item: pytest.Function) -> None:
    if getattr(item.obj, "is_hypothesis_test", False):
        pytest.fail(
            f"{item.nodeid}: @given cannot be combined with @pytest.mark.ranks: each rank would draw and shrink "
            f"its own examples, so the ranks would test different data and their collectives would not match. "
            f"Give every rank the same data: @pytest.mark.parametrize with fixed examples, or examples drawn in "
            f"the test body from a generator seeded the same on every rank.",
            pytrace=False,
        )


def _skip_without_gpus(n: int, backend: str) -> None:
    if backend != "nccl":
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < n:
        reason = f"ranks({n}, backend='nccl') needs {n} CUDA devices (one per rank); this machine has {found}"
        raise pytest.skip.Exception(reason, _use_item_location=True)


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


def _describe(item: pytest.Function, outbox: str, backend: str) -> RankTest:
    classes = []
    node = item.parent
    while isinstance(node, pytest.Class):
        classes.append(node.name)
        node = node.parent
    module = item.module
    assert module is not None and module.__file__ is not None
    funcargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
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
        coverage=_rank_coverage.parent_config(),
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
    _skip_without_gpus(n, backend)
    with tempfile.TemporaryDirectory(prefix="tmgp-outbox-") as outbox:
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
        _rank_coverage.merge(record.coverage)
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


def _hung_in(failure: RankError, rank: int) -> str | None:
    """The collective a rank that left no record was stuck in at the timeout, from its stack dump."""
    if failure.reason != "timed out":
        return None
    part = failure.details.partition(f"--- rank {rank}, still running")[2].partition("--- rank ")[0]
    found = re.search(r'distributed_c10d\.py", line \d+ in (\w+)', part)
    return found.group(1) if found else None


def _left_early(failure: RankError, n: int, records: dict[int, RankRecord]) -> str:
    """Name ranks that finished while their peers waited for them: "rank 1 returned; rank 0 waited in all_reduce"."""
    finished = [r for r in records.values() if r.outcome != "failed"]
    waiting = [(rank, _hung_in(failure, rank)) for rank in range(n) if rank not in records]
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
    first = f"rank {failure.rank} of {n} {failure.reason}:{headline}"
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
