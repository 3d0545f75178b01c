"""The data a marked test's ranks and the pytest process exchange: the test sent, the record left, the report.

:class:`RankTest` goes to every rank (plain data, pickled once per test); each rank leaves a :class:`RankRecord`
in the test's outbox (:func:`record_path`), with a :class:`RankReport` when it failed; the pytest process
finishes the report's assert message with its own comparison hooks (:meth:`RankReport.finished`).

Invariant: used on both sides; imports only the standard library (pytest inside functions). pytest's private
names used: ``_pytest.assertion.util.format_explanation`` and ``util._reprcompare`` (pytest's own explanation of
a failed comparison, with the user's ``pytest_assertrepr_compare`` hooks).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "PLACEHOLDER",
    "TOKEN_END",
    "TOKEN_START",
    "FreshMonkeyPatch",
    "RankFailedError",
    "RankRecord",
    "RankReport",
    "RankTest",
    "record_path",
]

#: The line a rank's failed assert shows until the pytest process writes the message (see RankReport).
PLACEHOLDER = "assert <torchmetrics_gradpatch: assertion message>"
TOKEN_START, TOKEN_END = "\x02tmgp-compare-{}\x03", "\x02/tmgp-compare-{}\x03"


class FreshMonkeyPatch:
    """Sent in place of a ``monkeypatch`` fixture: the rank gets its own, undone when the test body ends."""


@dataclass(frozen=True)
class RankTest:
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
    outbox: str  # directory where each rank leaves its RankRecord
    capture_output: bool = False  # --capture=sys/tee-sys: send print output back instead of writing to the fds
    coverage: bytes | None = None  # the pytest process's coverage configuration (see _rank_coverage)
    backend: str = "gloo"


@dataclass
class RankReport:
    """A rank's failure: pytest's rendering of its traceback, finished in the pytest process.

    ``text`` has the assert message as a placeholder line when the message contains comparisons; ``raw`` is the
    message before formatting with each comparison's standard explanation between tokens, and ``comparisons``
    the pickled ``(op, left, right)`` of each token (``None`` when the values did not pickle). ``crash`` is the
    deepest frame outside torch (where ``--tb=line`` points), ``collective`` the torch.distributed function
    the traceback went through, ``exc_type`` the pickled exception class (for ``xfail(raises=...)``).
    """

    text: str
    raw: str | None = None
    comparisons: dict[int, bytes | None] = field(default_factory=dict)
    crash: tuple[str, int] | None = None
    collective: str | None = None
    exc_type: bytes | None = None
    message: str = ""

    def _message(self, explain: Callable[[str, object, object], str | None] | None) -> str:
        from _pytest.assertion.util import format_explanation

        assert self.raw is not None
        raw = self.raw
        for index, blob in self.comparisons.items():
            start, end = TOKEN_START.format(index), TOKEN_END.format(index)
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
            if PLACEHOLDER in line:
                prefix = line[: line.index(PLACEHOLDER)]
                lines.extend(prefix + part for part in message.splitlines())
            else:
                lines.append(line)
        return "\n".join(lines)

    @staticmethod
    def headline(finished: str) -> str:
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


@dataclass
class RankRecord:
    """What one rank leaves in the outbox when its test body ends, whatever the outcome."""

    rank: int
    outcome: str = "passed"  # "skipped", "xfailed" (pytest.skip()/xfail() in the rank) or "failed"
    reason: str = ""
    returned: str | None = None  # repr of the type of a non-None return value
    warnings: list[tuple[bytes, str, str, int]] = field(default_factory=list)  # category, message, file, line
    stdout: str = ""
    stderr: str = ""
    coverage: bytes | None = None
    report: RankReport | None = None


def record_path(outbox: str, rank: int) -> Path:
    return Path(outbox) / f"rank{rank}.pickle"


class RankFailedError(Exception):
    """Carries a :class:`RankReport` to the runner, which sends it instead of a plain traceback."""

    def __init__(self, report: RankReport) -> None:
        super().__init__(str(report))
        self.rank_report = report
