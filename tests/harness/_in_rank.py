"""A marked test inside a rank: import the test module as pytest did, call the test, leave a record.

The plugin (parent side) sends a :class:`~._records.RankTest`; :func:`run_in_rank` runs inside the rank's
initialised group and always leaves a :class:`~._records.RankRecord` in the test's outbox directory (outcome,
warnings, output, coverage data, and a report on failure), so the pytest process decides from every finished
rank, whichever the runner heard from first. Asserts are rewritten as pytest rewrote them; a failed comparison's
operands are pickled so the pytest process writes the explanation with its own hooks.

Invariant: rank side; imports pytest, :mod:`._coverage`, :mod:`._records` and the standard library, nothing of
the parent side.
pytest's private names used here, each for want of a public one: ``_pytest.assertion.rewrite.rewrite_asserts``
(the rewriting itself) and the helpers of that module that the rewritten code calls (read through a stand-in,
:class:`_AssertHelpers`, that the modules rewritten here use instead of the module, so nothing of pytest's is
replaced), ``_pytest.assertion.util.format_explanation``
(the standard explanation, with tokens around each comparison), ``_pytest._code.Traceback``
(restyling entries inside torch) and ``_pytest._io.TerminalWriter`` (rendering as pytest renders).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import pickle
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.harness import _coverage
from tests.harness._records import (
    PLACEHOLDER,
    TOKEN_END,
    TOKEN_START,
    FreshMonkeyPatch,
    RankFailedError,
    RankRecord,
    RankReport,
    RankTest,
    record_path,
)


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
        # the rewritten code imports pytest's helper module as "@pytest_ar"; it gets the stand-in instead (should
        # pytest name it otherwise, the import stays and only the explanations lose the pytest process's hooks)
        tree.body = [node for node in tree.body if not _imports_the_helpers(node)]
        module.__dict__["@pytest_ar"] = HELPERS
        exec(compile(tree, file, "exec", dont_inherit=True), module.__dict__)


def _imports_the_helpers(node: ast.stmt) -> bool:
    return isinstance(node, ast.Import) and [(alias.name, alias.asname) for alias in node.names] == [
        ("_pytest.assertion.rewrite", "@pytest_ar")
    ]


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
        return TOKEN_START.format(token) + expls[index] + TOKEN_END.format(token)

    def format_explanation(self, raw: str) -> str:
        from _pytest.assertion.util import format_explanation

        plain = raw
        for token in self.pickled:
            plain = plain.replace(TOKEN_START.format(token), "").replace(TOKEN_END.format(token), "")
        message = format_explanation(plain)
        self.messages[message] = raw
        return message


class _AssertHelpers:
    """``_pytest.assertion.rewrite`` as the modules rewritten in this rank see it: its helpers, except the two
    that explain a failed comparison, which go to the current test's :class:`_Comparisons`."""

    def __init__(self) -> None:
        self.comparisons = _Comparisons()

    def __getattr__(self, name: str) -> Any:
        from _pytest.assertion import rewrite

        return getattr(rewrite, name)

    def _call_reprcompare(self, *args: Any) -> str:
        return self.comparisons.call_reprcompare(*args)

    def _format_explanation(self, raw: str) -> str:
        return self.comparisons.format_explanation(raw)


#: One per process: a module rewritten for an earlier test of a pool worker keeps it, and sees the current test's.
HELPERS = _AssertHelpers()


def _import_test_module(spec: RankTest) -> types.ModuleType:
    """Import the test module under pytest's name for it, from pytest's file, asserts rewritten if pytest did."""
    # one finder per process: a rank that runs several tests (a pool) replaces the previous test's
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RewritingFinder)]
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


def _in_torch(entry: Any) -> bool:
    import torch

    return Path(str(entry.path)).is_relative_to(Path(torch.__file__).parent)


def _restyle(info: Any, tbstyle: str) -> None:
    """Entries inside torch in the short style; under ``--tb=auto`` also every entry but the first and last."""
    from _pytest._code import Traceback

    entries = list(info.traceback)
    restyled = []
    for index, entry in enumerate(entries):
        middle = tbstyle == "auto" and 0 < index < len(entries) - 1
        if middle or _in_torch(entry):
            try:
                entry = entry.with_repr_style("short")
            except AttributeError:  # pytest < 8 sets the style in place
                entry.set_repr_style("short")
        restyled.append(entry)
    info.traceback = Traceback(restyled)


def _collective(entries: list[Any]) -> str | None:
    """The torch.distributed function (all_reduce, barrier...) the traceback went through, if any."""
    for entry in entries:
        if Path(str(entry.path)).name == "distributed_c10d.py":
            return str(entry.name)
    return None


def _report(error: BaseException, spec: RankTest, comparisons: _Comparisons) -> RankReport:
    from _pytest._io import TerminalWriter

    message = str(error)
    raw = comparisons.messages.get(message) if isinstance(error, AssertionError) else None
    if raw is not None:
        error.args = (PLACEHOLDER,)  # the pytest process writes the message, with its comparison hooks
    assert error.__traceback__ is not None  # it was raised
    info = pytest.ExceptionInfo.from_exc_info((type(error), error, error.__traceback__))
    entries = list(info.traceback)
    outside = [entry for entry in entries if not _in_torch(entry)] or entries
    crash = (str(outside[-1].path), outside[-1].lineno + 1) if outside else None
    if spec.tbstyle in ("auto", "long"):
        _restyle(info, spec.tbstyle)
    style = {"native": "native", "short": "short", "line": "short", "no": "short"}.get(spec.tbstyle, "long")
    rendered = info.getrepr(style=style, showlocals=spec.showlocals, funcargs=False)  # type: ignore[arg-type]
    out = io.StringIO()
    rendered.toterminal(TerminalWriter(file=out))  # not str(): that strips the first line's indentation
    text = out.getvalue().strip("\n")
    tokens = {token: comparisons.pickled[token] for token in comparisons.pickled if raw and f"-{token}\x03" in raw}
    try:
        exc_type = pickle.dumps(type(error))
    except Exception:
        exc_type = None
    return RankReport(text, raw, tokens, crash, _collective(entries), exc_type, message)


def _use_backend(backend: str) -> None:
    """Move the default group from the runner's gloo to ``backend`` (nccl: on ``cuda:rank``), same store."""
    if backend == "gloo":
        return
    import torch
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"tmgp-{backend}/", store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world_size,
    )


@contextlib.contextmanager
def _captured(record: RankRecord, capture: bool) -> Iterator[None]:
    """Under ``--capture=sys``: the test's print output, kept for the pytest process to write to its capture."""
    if not capture:
        yield
        return
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        record.stdout, record.stderr = out.getvalue(), err.getvalue()


def _call(function: Callable[..., Any], kwargs: dict[str, Any], record: RankRecord) -> BaseException | None:
    """Call the test; fill ``record``'s outcome; return the exception that failed it, if any."""
    patchers = [name for name, value in kwargs.items() if isinstance(value, FreshMonkeyPatch)]
    for name in patchers:
        kwargs[name] = pytest.MonkeyPatch()
    try:
        result = function(**kwargs)
    except (pytest.skip.Exception, pytest.xfail.Exception) as outcome:
        record.outcome = "xfailed" if isinstance(outcome, pytest.xfail.Exception) else "skipped"
        record.reason = str(outcome.msg)
    except BaseException as error:
        record.outcome = "failed"
        return error.with_traceback(error.__traceback__.tb_next) if error.__traceback__ else error  # from the test
    else:
        if result is not None:
            record.returned = repr(type(result))
    finally:
        for name in patchers:
            kwargs[name].undo()
    return None


def _warnings(log: list[warnings.WarningMessage]) -> list[tuple[bytes, str, str, int]]:
    found: list[tuple[bytes, str, str, int]] = []
    for item in log:
        try:
            category = pickle.dumps(item.category)
        except Exception:
            category = pickle.dumps(UserWarning)
        entry = (category, str(item.message), item.filename, item.lineno)
        if entry not in found:
            found.append(entry)
    return found


def run_in_rank(spec: RankTest) -> None:
    """Body of every rank (the process group is up): import the test module, call the test with the fixtures."""
    import torch.distributed as dist

    _use_backend(spec.backend)
    comparisons = HELPERS.comparisons = _Comparisons()
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
    record = RankRecord(dist.get_rank())
    measuring = _coverage.start(spec.coverage)
    try:
        with _captured(record, spec.capture_output), warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")  # the pytest process applies its own filters when it re-issues them
            error = _call(function, kwargs, record)
    finally:
        record.coverage = _coverage.finish(measuring)
    record.warnings = _warnings(log)
    if error is not None:
        record.report = _report(error, spec, comparisons)
    path = record_path(spec.outbox, record.rank)
    path.with_suffix(".partial").write_bytes(pickle.dumps(record))
    path.with_suffix(".partial").replace(path)  # whole or absent, even if the rank is killed while writing
    if record.report is not None:
        raise RankFailedError(record.report) from None
