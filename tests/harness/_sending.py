"""What goes to the ranks for a marked test: a :class:`~._records.RankTest`, or a failure saying why it cannot go.

Fixture values and a test class's attributes are pickled in the pytest process; one that cannot be (pytest's own
objects, locks, open files) fails the test naming it and what to do instead. ``@given`` is refused: each rank
would draw its own examples.

Invariant: parent side; imports pytest, :mod:`._coverage`, :mod:`._records` (the data it sends) and the standard
library. pytest's private name used: ``_pytest.assertion.rewrite.AssertionRewritingHook`` (which modules pytest
rewrote, so the ranks rewrite the same).
"""

from __future__ import annotations

import inspect
import pickle
import sys
from typing import Any

import pytest

from tests.harness import _coverage
from tests.harness._records import FreshMonkeyPatch, RankTest

__all__ = ["describe", "refuse_hypothesis"]

#: Why a pytest fixture cannot reach a rank, and what to do instead (monkeypatch is replaced, not refused).
_PYTEST_FIXTURES = {
    "request": "read what the test needs from request in a fixture of your own and return plain data",
    "capsys": "the ranks' output goes to pytest's capture; write what you want to check to a file in tmp_path",
    "capfd": "the ranks' output goes to pytest's capture; write what you want to check to a file in tmp_path",
    "caplog": "log records stay in the rank; return or write what you want to check to a file in tmp_path",
    "recwarn": "a rank's warnings are re-issued in the pytest process; use pytest.warns inside the test body",
}


def refuse_hypothesis(item: pytest.Function) -> None:
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


def describe(item: pytest.Function, outbox: str, backend: str) -> RankTest:
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
