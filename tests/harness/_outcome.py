"""What comes back from the ranks of a marked test: delivered in the pytest process, or told as one failure.

The ranks' coverage, output and warnings are handed to the pytest process (:func:`deliver`); a failure is raised
as the rank's own exception type, with the ranks' story (:func:`fail`): the first failure, what the other ranks
did ("rank 1 returned; rank 0 waited in all_reduce"), every traceback; :func:`longrepr` shows it at the rank's
line.

Invariant: parent side; imports pytest, :mod:`._collect` (the runner's error), :mod:`._coverage`,
:mod:`._records` and the standard library. pytest's private names used:
``_pytest._code.code.ReprExceptionInfo``/``ReprFileLocation``/``ReprTracebackNative`` (a report located at the
rank's line, as ``--tb=line`` and the short summary read it).
"""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.harness import _coverage
from tests.harness._collect import RankError
from tests.harness._records import RankRecord, RankReport

__all__ = ["FAILURE", "deliver", "fail", "longrepr"]

FAILURE = pytest.StashKey["tuple[str, tuple[str, int] | None]"]()


def deliver(item: pytest.Function, records: dict[int, RankRecord]) -> None:
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


def fail(item: pytest.Function, n: int, failure: RankError, records: dict[int, RankRecord]) -> None:
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
    item.stash[FAILURE] = (message, crash)
    raise _as_raised(records.get(failure.rank), first)


def longrepr(item: pytest.Item, failure: tuple[str, tuple[str, int] | None]) -> Any:
    """The failed report's representation: the ranks' story, located at the rank's line in the test file."""
    from _pytest._code.code import ReprExceptionInfo, ReprFileLocation, ReprTracebackNative

    message, crash = failure
    path, lineno = crash if crash is not None else (str(item.path), (item.location[1] or 0) + 1)
    lines = [line + "\n" for line in message.splitlines()]
    return ReprExceptionInfo(
        reprtraceback=ReprTracebackNative(lines), reprcrash=ReprFileLocation(str(Path(path)), lineno, message)
    )
