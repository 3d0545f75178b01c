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
  file (``importlib`` mode, whose names are not importable, is loaded straight from the file).
* **Asserts are rewritten as in the pytest process.** Every module pytest had rewritten (test modules,
  conftests, ``register_assert_rewrite`` helpers) is rewritten again when a rank imports it. pytest's
  comparison explanations (list and dict diffs, ``pytest_assertrepr_compare`` hooks of conftests and plugins)
  need the pytest configuration, which lives in the pytest process, so a rank records the compared values of a
  failed assert (when they pickle) and the pytest process writes the explanation with its own hooks.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import pickle
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from torchmetrics_gradpatch import _pool
from torchmetrics_gradpatch.testing import DEFAULT_TIMEOUT, RankError, spawn_ranks

__all__ = ["pytest_addoption", "pytest_configure", "pytest_pyfunc_call", "pytest_unconfigure"]

_MARKER_HELP = (
    "ranks(n, timeout=seconds): run the test body on n spawned processes, each in an initialised gloo default "
    f"process group (torchmetrics_gradpatch); timeout defaults to {DEFAULT_TIMEOUT:g} s, start-up included; "
    "reuse=True runs it in warm processes kept across tests (default: the ranks_reuse ini option)"
)
#: The line a rank's failed assert shows until the pytest process writes the message (see _RankReport).
_PLACEHOLDER = "assert <torchmetrics_gradpatch: assertion message>"
_TOKEN_START, _TOKEN_END = "\x02tmgp-compare-{}\x03", "\x02/tmgp-compare-{}\x03"


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


# --- the pytest process -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RankTest:
    """What a rank needs to find and call the test: everything plain data, pickled once per test."""

    module: str
    path: str
    classes: tuple[str, ...]
    function: str
    rewrite: dict[str, str]  # module name -> file, for every module pytest rewrote the asserts of
    kwargs: bytes  # pickled fixture values, unpickled in the rank after the test module is imported
    instance_state: bytes | None
    showlocals: bool
    tbstyle: str


def _ranks_options(item: pytest.Function, marker: pytest.Mark) -> tuple[int, float]:
    """``(n, timeout)`` from ``@pytest.mark.ranks(n, timeout=...)``; a clear failure for anything else."""
    usage = "use @pytest.mark.ranks(n) or @pytest.mark.ranks(n, timeout=seconds)"
    kwargs = dict(marker.kwargs)
    args = list(marker.args)
    if "n" in kwargs and not args:
        args.append(kwargs.pop("n"))
    timeout = kwargs.pop("timeout", DEFAULT_TIMEOUT)
    kwargs.pop("reuse", None)  # read by _runner (warm rank pool)
    if len(args) != 1 or kwargs:
        pytest.fail(f"{item.nodeid}: bad ranks marker {marker.args!r} {marker.kwargs!r}: {usage}", pytrace=False)
    n = args[0]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        pytest.fail(f"{item.nodeid}: the number of ranks must be a positive int, got {n!r}: {usage}", pytrace=False)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        pytest.fail(f"{item.nodeid}: timeout must be a positive number of seconds, got {timeout!r}", pytrace=False)
    return n, float(timeout)


def _pickled_or_fail(values: dict[str, Any], what: str, item: pytest.Function) -> bytes:
    """Pickle ``values``; fail the test naming the first value that cannot be pickled."""
    for name, value in values.items():
        try:
            pickle.dumps(value)
        except Exception as err:
            problem = f"{type(err).__name__}: {err}"
        else:
            continue
        pytest.fail(  # outside the except block: the pickling traceback is noise here
            f"{item.nodeid}: {what} {name!r} cannot be sent to the ranks: its value {type(value).__name__} "
            f"cannot be pickled ({problem}). Ranks get fixture values pickled from the pytest "
            f"process: return something picklable (a path, numbers, tensors) or build the object in the test "
            f"body. A fixture needed only for what it does in the pytest process (monkeypatch.setenv: the ranks "
            f"inherit the environment) can be requested with @pytest.mark.usefixtures or by another fixture.",
            pytrace=False,
        )
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


def _describe(item: pytest.Function) -> _RankTest:
    classes = []
    node = item.parent
    while isinstance(node, pytest.Class):
        classes.append(node.name)
        node = node.parent
    module = item.module
    assert module is not None and module.__file__ is not None
    funcargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    instance = getattr(item, "instance", None)
    state = vars(instance) if instance is not None and hasattr(instance, "__dict__") else {}
    return _RankTest(
        module=module.__name__,
        path=module.__file__,
        classes=tuple(reversed(classes)),
        function=item.originalname,
        rewrite=_rewritten_modules(),
        kwargs=_pickled_or_fail(funcargs, "fixture", item),
        instance_state=_pickled_or_fail(state, "test class attribute", item) if state else None,
        showlocals=bool(item.config.getoption("showlocals", False)),
        tbstyle=str(item.config.getoption("tbstyle", "auto")),
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a ``ranks``-marked test on its ranks; leave every other test to pytest."""
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        return None
    n, timeout = _ranks_options(pyfuncitem, marker)
    run = _runner(pyfuncitem, marker)
    spec = _describe(pyfuncitem)
    try:
        run(_run_in_rank, n, args=(spec,), timeout=timeout)
    except RankError as error:
        failure = error
    else:
        return True
    primary = failure.reports.get(failure.rank)
    if isinstance(primary, _RankReport) and primary.outcome == "skipped":
        # reported at the test's own location, as a skip inside the test would be
        raise pytest.skip.Exception(f"rank {failure.rank} of {n}: {primary.reason}", _use_item_location=True)
    if isinstance(primary, _RankReport) and primary.outcome == "xfailed":
        pytest.xfail(f"rank {failure.rank} of {n}: {primary.reason}")
    details, headline = failure.details, ""
    for rank, report in failure.reports.items():
        if isinstance(report, _RankReport):
            finished = report.finished()
            details = details.replace(str(report), finished)
            if rank == failure.rank:
                headline = " " + report.headline(finished)
    # outside the except block: the report is the ranks' story, not this frame's. The first line is what pytest's
    # short summary shows.
    pytest.fail(f"rank {failure.rank} of {n} {failure.reason}:{headline}\n\n{details}", pytrace=False)


# --- a rank ---------------------------------------------------------------------------------------------------------


@dataclass
class _RankReport:
    """A rank's failure: pytest's rendering of its traceback, finished in the pytest process.

    ``text`` has the assert message as a placeholder line when the message contains comparisons; ``raw`` is the
    message before formatting with each comparison's standard explanation between tokens, and ``comparisons``
    the pickled ``(op, left, right)`` of each token (``None`` when the values did not pickle).
    """

    text: str
    raw: str | None = None
    comparisons: dict[int, bytes | None] = field(default_factory=dict)
    outcome: str = "failed"  # or "skipped" / "xfailed": the rank called pytest.skip() / pytest.xfail()
    reason: str = ""

    def _message(self, explain: Callable[[str, object, object], str | None] | None) -> str:
        from _pytest.assertion.util import format_explanation

        assert self.raw is not None
        raw = self.raw
        for index, blob in self.comparisons.items():
            start, end = _TOKEN_START.format(index), _TOKEN_END.format(index)
            head, _, rest = raw.partition(start)
            standard, _, tail = rest.partition(end)
            custom = None
            if explain is not None and blob is not None:
                try:
                    custom = explain(*pickle.loads(blob))
                except Exception:  # an odd object's repr must not hide the rank's failure
                    custom = None
            # pytest escapes % in a custom explanation for the rewritten code's own % formatting, done already here
            raw = head + (custom.replace("%%", "%") if custom else standard) + tail
        return format_explanation(raw)

    def _with_message(self, message: str) -> str:
        lines: list[str] = []
        for line in self.text.splitlines():
            if _PLACEHOLDER in line:
                prefix = line[: line.index(_PLACEHOLDER)]
                lines.extend(prefix + part for part in message.splitlines())
            else:
                lines.append(line)
        return "\n".join(lines)

    def headline(self, finished: str) -> str:
        """The first line of the exception as pytest shows it (the ``E`` lines of the finished text)."""
        for line in finished.splitlines():
            if line.startswith("E   "):
                return line[1:].strip()
        return ""

    def finished(self) -> str:
        """The text with pytest's own comparison explanations (call inside the test, in the pytest process)."""
        if self.raw is None:
            return self.text
        from _pytest.assertion import util

        return self._with_message(self._message(util._reprcompare))

    def __str__(self) -> str:
        return self.text if self.raw is None else self._with_message(self._message(None))


class _RankFailedError(Exception):
    """Carries a :class:`_RankReport` to spawn_ranks, which sends it instead of a plain traceback."""

    def __init__(self, report: _RankReport) -> None:
        super().__init__(str(report))
        self.rank_report = report


class _RewritingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import the modules pytest rewrote, from the same files, with pytest's assertion rewriting."""

    def __init__(self, modules: dict[str, str]) -> None:
        self.modules = modules

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = self.modules.get(fullname)
        if file is None or not Path(file).is_file():
            return None
        package = Path(file).name == "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, file, loader=self, submodule_search_locations=[str(Path(file).parent)] if package else None
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        from _pytest.assertion.rewrite import rewrite_asserts

        file = self.modules[module.__name__]
        source = Path(file).read_bytes()
        tree = ast.parse(source, filename=file)
        rewrite_asserts(tree, source, file, None)
        exec(compile(tree, file, "exec", dont_inherit=True), module.__dict__)


class _Comparisons:
    """Stand-ins for the rewritten code's helpers: remember each failed comparison's operands, by token."""

    def __init__(self) -> None:
        self.pickled: dict[int, bytes | None] = {}
        self.messages: dict[str, str] = {}  # formatted standard message -> raw message with tokens

    def call_reprcompare(
        self, ops: Sequence[str], results: Sequence[bool], expls: Sequence[str], each_obj: Sequence[object]
    ) -> str:
        index = 0
        for index, result in enumerate(results):  # noqa: B007 - the first comparison that failed
            try:
                done = not result
            except Exception:
                done = True
            if done:
                break
        token = len(self.pickled)
        try:
            self.pickled[token] = pickle.dumps((ops[index], each_obj[index], each_obj[index + 1]))
        except Exception:
            self.pickled[token] = None
        return _TOKEN_START.format(token) + expls[index] + _TOKEN_END.format(token)

    def format_explanation(self, raw: str) -> str:
        from _pytest.assertion.util import format_explanation

        plain = raw
        for token in self.pickled:
            plain = plain.replace(_TOKEN_START.format(token), "").replace(_TOKEN_END.format(token), "")
        message = format_explanation(plain)
        self.messages[message] = raw
        return message

    def install(self) -> None:
        from _pytest.assertion import rewrite

        # the rewritten code looks both up on the module at every failed assert
        rewrite._call_reprcompare = self.call_reprcompare
        setattr(rewrite, "_format_explanation", self.format_explanation)  # noqa: B010 - not exported


def _import_test_module(spec: _RankTest) -> types.ModuleType:
    """Import the test module under pytest's name for it, from pytest's file, asserts rewritten if pytest did."""
    sys.meta_path.insert(0, _RewritingFinder(spec.rewrite))
    try:
        module = importlib.import_module(spec.module)
    except ImportError:
        module = None  # importlib import mode: the name is pytest's own, not importable from sys.path
    if module is None or Path(getattr(module, "__file__", "") or "").resolve() != Path(spec.path).resolve():
        loader = _RewritingFinder({**spec.rewrite, spec.module: spec.path}) if spec.module in spec.rewrite else None
        module_spec = importlib.util.spec_from_file_location(spec.module, spec.path, loader=loader)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[spec.module] = module
        module_spec.loader.exec_module(module)
    return module


def _shorten_middle_entries(info: Any) -> None:
    """What pytest's default ``--tb=auto`` does: every entry but the first and the last in the short style."""
    from _pytest._code import Traceback

    entries = list(info.traceback)
    if len(entries) <= 2:
        return
    try:
        middle = [entry.with_repr_style("short") for entry in entries[1:-1]]
    except AttributeError:  # pytest < 8 sets the style in place
        for entry in entries[1:-1]:
            entry.set_repr_style("short")
        middle = entries[1:-1]
    info.traceback = Traceback([entries[0], *middle, entries[-1]])


def _report(error: BaseException, spec: _RankTest, comparisons: _Comparisons) -> _RankReport:
    from _pytest._code import ExceptionInfo
    from _pytest._io import TerminalWriter

    raw = comparisons.messages.get(str(error)) if isinstance(error, AssertionError) else None
    if raw is not None:
        error.args = (_PLACEHOLDER,)  # the pytest process writes the message, with its comparison hooks
    assert error.__traceback__ is not None  # it was raised
    info = ExceptionInfo.from_exc_info((type(error), error, error.__traceback__))
    if spec.tbstyle == "auto":
        _shorten_middle_entries(info)
    style = {"native": "native", "short": "short", "line": "short", "no": "short"}.get(spec.tbstyle, "long")
    rendered = info.getrepr(style=style, showlocals=spec.showlocals, funcargs=False)  # type: ignore[arg-type]
    out = io.StringIO()
    rendered.toterminal(TerminalWriter(file=out))  # not str(): that strips the first line's indentation
    text = out.getvalue().strip("\n")
    tokens = {token: comparisons.pickled[token] for token in comparisons.pickled if raw and f"-{token}\x03" in raw}
    return _RankReport(text, raw, tokens)


def _run_in_rank(spec: _RankTest) -> None:
    """Body of every rank (the process group is up): import the test module, call the test with the fixtures."""
    comparisons = _Comparisons()
    comparisons.install()
    module = _import_test_module(spec)
    target: Any = module
    for name in spec.classes:
        target = getattr(target, name)
    if spec.classes:
        target = target()
        if spec.instance_state is not None:
            vars(target).update(pickle.loads(spec.instance_state))
    function = getattr(target, spec.function)
    kwargs = pickle.loads(spec.kwargs)
    try:
        function(**kwargs)
    except (pytest.skip.Exception, pytest.xfail.Exception) as outcome:
        kind = "xfailed" if isinstance(outcome, pytest.xfail.Exception) else "skipped"
        raise _RankFailedError(_RankReport(f"{kind}: {outcome.msg}", outcome=kind, reason=str(outcome.msg))) from None
    except BaseException as error:
        if error.__traceback__ is not None:  # drop this frame: the traceback starts in the test, as in pytest
            error = error.with_traceback(error.__traceback__.tb_next)
        raise _RankFailedError(_report(error, spec, comparisons)) from None
