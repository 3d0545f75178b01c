"""The ``ranks`` marker (tests/harness/plugin.py), checked the way a user meets it: pytest run in a
subprocess on example test files, enabled with ``-p``.

The example project below keeps its tests in a ``tests/`` folder without ``__init__.py`` and imports a helper
from its ``conftest.py``, so it only works if each rank imports the test module the way pytest found it. Every
rank records its pid in a directory; after each run none of those processes may be alive ("no process outlives
the test", checked against ``/proc``, not against the runner's bookkeeping). Each spawn costs a few seconds on a
2-core machine, so the cases share runs: one run for pass/fail/parametrize/class/fixtures, one for a hang on warm
ranks under ``-x``, one interrupted with SIGINT and one under pytest-xdist.
"""

from __future__ import annotations

import importlib.metadata
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import torchmetrics_gradpatch
from tests._procs import alive

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.harness, pytest.mark.usefixtures("suite_importable")]  # tox's harness environment

PLUGIN = "tests.harness.plugin"
#: the hang case's marker timeout, and how much later its failure may come (stack dump + terminate/kill grace).
#: The hang runs on warm ranks, where a test takes 0.03 s at load 8 on 2 cores before its body's first line; a
#: fresh spawn's timeout would have to cover the ranks' start too (seconds, more than 10 under load).
HANG_TIMEOUT = 3.0
GRACE = 10.0

CONFTEST = """
import os
import pathlib
import threading

import pytest


def record_pid():
    '''Called in a rank: leave this process's pid where the outer test looks for leftovers.'''
    (pathlib.Path(os.environ["TMGP_PID_DIR"]) / str(os.getpid())).write_text("")


@pytest.fixture
def numbers():
    return [1, 2, 3]


@pytest.fixture
def lock():
    return threading.Lock()
"""

CASES = """
import os
import pathlib

import pytest
import torch
import torch.distributed as dist
from conftest import record_pid


@pytest.mark.ranks(2)
def test_ranks_share_tmp_path(tmp_path, numbers):
    record_pid()
    assert (dist.get_world_size(), numbers) == (2, [1, 2, 3])
    (tmp_path / f"rank{dist.get_rank()}").write_text("")
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


@pytest.mark.ranks(1)
@pytest.mark.parametrize("value", [2, 3])
def test_parametrized(value):
    record_pid()
    (pathlib.Path(os.environ["TMGP_PID_DIR"]) / f"value{value}").write_text("")
    assert dist.get_world_size() == 1
    from _pytest.assertion import rewrite

    assert rewrite._call_reprcompare.__module__ == "_pytest.assertion.rewrite"  # the harness replaces none of pytest's


@pytest.mark.ranks(2)
class TestOnRanks:
    def test_method(self):
        record_pid()
        total = torch.tensor(float(dist.get_rank() + 1))
        dist.all_reduce(total)
        assert total.item() == 3.0


@pytest.mark.ranks(2)
def test_rank_one_fails(numbers):
    record_pid()
    if dist.get_rank() == 1:
        assert numbers == [1, 2, 4]


@pytest.mark.ranks(1)
def test_skipped_in_the_rank():
    record_pid()
    pytest.skip("not on this torch")


@pytest.mark.ranks(2)
def test_unpicklable_fixture(lock):
    record_pid()


def test_no_rank_left_running():
    '''Unmarked, so it runs in the pytest process, after the marked tests: none of their ranks is left.'''
    mine = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and b"resource_tracker" not in cmdline:
            mine.append(entry.name)
    assert mine == []
"""

HANG = f"""
import time

import pytest
import torch.distributed as dist
from conftest import record_pid


def hang_here_forever():
    while True:
        time.sleep(0.1)


@pytest.mark.ranks(2, reuse=True)
def test_pool_started():
    record_pid()


@pytest.mark.ranks(2, reuse=True, timeout={HANG_TIMEOUT})
def test_rank_one_hangs():
    record_pid()
    if dist.get_rank() == 1:
        hang_here_forever()
    dist.barrier()


@pytest.mark.ranks(2)
def test_not_run_after_x():
    record_pid()
"""

SLEEP = """
import time

import pytest
from conftest import record_pid


@pytest.mark.ranks(2)
def test_sleeps():
    record_pid()
    time.sleep(120)
"""

ALL_REDUCE = """
import pytest
import torch
import torch.distributed as dist
from conftest import record_pid


@pytest.mark.ranks(2)
@pytest.mark.parametrize("tag", range(2))
def test_all_reduce(tag):
    record_pid()
    total = torch.tensor(float(tag * 10 + dist.get_rank()))
    dist.all_reduce(total)
    assert total.item() == 2 * tag * 10 + 1
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A user's project: ``tests/`` without ``__init__.py``, a conftest; yields (pytester, the pid directory)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("TMGP_PID_DIR", str(pids))
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "conftest.py").write_text(CONFTEST)
    yield pytester, pids
    # whatever the run did, none of its ranks may still be running
    deadline = time.monotonic() + 2.0
    while (left := [p.name for p in pids.iterdir() if p.name.isdigit() and alive(int(p.name))]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert left == [], f"rank processes left behind: {left}"


def _write(pytester: pytest.Pytester, name: str, source: str) -> str:
    (pytester.path / "tests" / name).write_text(source)
    return f"tests/{name}"


def _rank_pids(pids: Path) -> list[str]:
    return [p.name for p in pids.iterdir() if p.name.isdigit()]


def test_not_auto_loaded() -> None:
    """Installing the package must not change other projects' test runs: no pytest11 entry point."""
    entry_points = importlib.metadata.entry_points(group="pytest11")
    assert [ep for ep in entry_points if ep.value.startswith("torchmetrics_gradpatch")] == []


def test_pass_fail_parametrize_class_and_fixtures(project: tuple[pytest.Pytester, Path]) -> None:
    pytester, pids = project
    path = _write(pytester, "test_cases.py", CASES)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "--strict-markers", "-rfs", "-p", "no:cacheprovider", path)
    out = result.stdout.str()
    result.assert_outcomes(passed=5, failed=2, skipped=1)
    # every rank really ran: 2 + 1 + 1 + 2 + 2 + 1 ranks, and each parametrized value reached its rank
    assert len(_rank_pids(pids)) == 9
    assert {p.name for p in pids.iterdir() if not p.name.isdigit()} == {"value2", "value3"}
    # a failed assert: the rank's number, its traceback, pytest's own comparison explanation
    result.stdout.fnmatch_lines(
        [
            "*_ test_rank_one_fails _*",
            "rank 1 of 2 raised: assert [[]1, 2, 3[]] == [[]1, 2, 4[]]",
            ">           assert numbers == [[]1, 2, 4[]]",
            "E           assert [[]1, 2, 3[]] == [[]1, 2, 4[]]",
            "E*At index 2 diff: 3 != 4",
            "tests/test_cases.py:*: AssertionError",
        ]
    )
    # the fixture that cannot be pickled is named, and no rank was started for it
    result.stdout.fnmatch_lines(["*fixture 'lock' cannot be sent to the ranks*cannot be pickled*"])
    # pytest.skip() in the ranks skips the test, with the reason
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] tests/test_cases.py:*: rank 0 of 1: not on this torch"])
    assert "test_unpicklable_fixture" in out and "FAILED tests/test_cases.py::test_unpicklable_fixture" in out


def test_hang_is_named_with_its_stack_in_time_and_x_stops(project: tuple[pytest.Pytester, Path]) -> None:
    pytester, pids = project
    path = _write(pytester, "test_hang.py", HANG)
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-x", f"--junitxml={junit}", path, timeout=240)
    result.assert_outcomes(passed=1, failed=1)  # -x: the test after the hang never ran
    assert len(_rank_pids(pids)) == 2  # the pool's two ranks ran the first test and the hang
    result.stdout.fnmatch_lines(
        [
            "rank 1 of 2 timed out*",  # the rank outside a collective leads; its peer waits for it
            "not inside a collective: rank 1; rank 0 waits in barrier",
            "--- rank 1, still running at the deadline; its threads:",
            "*hang_here_forever*",
        ]
    )
    (case,) = [c for c in ET.parse(junit).iter("testcase") if c.get("name") == "test_rank_one_hangs"]
    assert HANG_TIMEOUT <= float(case.get("time", "0")) < HANG_TIMEOUT + GRACE


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_keyboard_interrupt_leaves_no_rank(project: tuple[pytest.Pytester, Path]) -> None:
    pytester, pids = project
    path = _write(pytester, "test_sleep.py", SLEEP)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", path],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As in a terminal: a suite started in the background by a non-interactive shell (nohup, `cmd &`, some CI
        # runners) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all.
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 90
        while len(_rank_pids(pids)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(_rank_pids(pids)) == 2, "the ranks never started"
        proc.send_signal(signal.SIGINT)  # to the pytest process only, as a debugger or CI runner would
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "KeyboardInterrupt" in out


def test_under_xdist(project: tuple[pytest.Pytester, Path]) -> None:
    pytest.importorskip("xdist")
    pytester, pids = project
    path = _write(pytester, "test_all_reduce.py", ALL_REDUCE)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-n", "2", "-p", "no:cacheprovider", path, timeout=300)
    result.assert_outcomes(passed=2)
    assert len(_rank_pids(pids)) == 4


# --- outcomes: every order of the ranks gives the same answer (failure > xfail > skip > pass) ----------------------

OUTCOMES = """
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import record_pid


@pytest.fixture
def env_set(monkeypatch):
    monkeypatch.setenv("TMGP_FROM_FIXTURE", "yes")


@pytest.mark.xfail(raises=ZeroDivisionError)
@pytest.mark.ranks(2)
def test_xfail_raises_the_same():
    record_pid()
    if dist.get_rank() == 1:
        1 / 0


@pytest.mark.xfail(raises=KeyError)
@pytest.mark.ranks(2)
def test_xfail_raises_another():
    if dist.get_rank() == 1:
        1 / 0


@pytest.mark.ranks(2)
@pytest.mark.parametrize("early", ["skip", "xfail"])
def test_early_outcome_then_failure(early):
    record_pid()
    if dist.get_rank() == 0:
        getattr(pytest, early)(f"rank 0 {early}s early")
    time.sleep(1.5)  # rank 0 is long finished: its outcome must not hide this failure
    assert "late failure" == "on rank 1"


@pytest.mark.ranks(2)
def test_failure_then_late_skip():
    if dist.get_rank() == 0:
        time.sleep(0.5)
        pytest.skip("rank 0 skips late")
    assert "early failure" == "on rank 1"


@pytest.mark.ranks(2)
def test_skip_and_xfail():
    if dist.get_rank() == 0:
        pytest.skip("rank 0 skips")
    pytest.xfail("rank 1 xfails")


@pytest.mark.ranks(2)
def test_skip_leaves_peer_in_collective():
    if dist.get_rank() == 0:
        pytest.skip("only rank 0 skips")
    dist.all_reduce(torch.ones(1))


@pytest.mark.ranks(2)
def test_returns_while_peer_waits():
    print("RANK-PRINTED", dist.get_rank())
    if dist.get_rank() == 1:
        return
    dist.all_reduce(torch.ones(1))


@pytest.mark.ranks(2)
def test_warns_and_returns_a_value(env_set, monkeypatch):
    print("PASSING-RANK-PRINTED")
    monkeypatch.setattr(os, "sep", "!")  # a fresh MonkeyPatch in each rank, undone when the body ends
    assert os.environ["TMGP_FROM_FIXTURE"] == "yes"
    warnings.warn(f"warned on rank {dist.get_rank()}")
    return 42


@pytest.mark.ranks(1)
def test_capsys(capsys):
    pass


@pytest.mark.ranks(1)
def test_request(request):
    pass


@pytest.mark.ranks(2, backend="nccl")
def test_nccl():
    pass
"""

HYPOTHESIS = """
import pytest
from hypothesis import given, strategies as st


@pytest.mark.ranks(2)
@given(st.integers())
def test_given(x):
    pass
"""


def test_outcome_rules_and_what_ranks_leave(project: tuple[pytest.Pytester, Path]) -> None:
    """Failure > xfail > skip > pass, whichever rank finishes first; warnings, output and fixtures as documented."""
    pytester, _ = project
    path = _write(pytester, "test_outcomes.py", OUTCOMES)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-rfsxX", "--capture=sys", "-p", "no:cacheprovider", path)
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=8, skipped=1, xfailed=2)
    xfailed = {line.split()[1] for line in out.splitlines() if line.startswith("XFAIL ")}
    assert xfailed == {
        "tests/test_outcomes.py::test_xfail_raises_the_same",
        "tests/test_outcomes.py::test_skip_and_xfail",
    }
    failed = {line.split()[1] for line in out.splitlines() if line.startswith("FAILED ")}
    assert {
        "tests/test_outcomes.py::test_xfail_raises_another",
        "tests/test_outcomes.py::test_early_outcome_then_failure[skip]",
        "tests/test_outcomes.py::test_early_outcome_then_failure[xfail]",
        "tests/test_outcomes.py::test_failure_then_late_skip",
        "tests/test_outcomes.py::test_skip_leaves_peer_in_collective",
        "tests/test_outcomes.py::test_returns_while_peer_waits",
    } <= failed
    result.stdout.fnmatch_lines(["rank 1 of 2 raised: assert 'late failure' == 'on rank 1'*"])
    # a rank that left while its peer waited in a collective is named, and torch's source is not printed
    result.stdout.fnmatch_lines(["rank 0 skipped (only rank 0 skips); rank 1 waited in all_reduce: rank 1 of 2*"])
    result.stdout.fnmatch_lines(["rank 1 returned; rank 0 waited in all_reduce: rank 0 of 2 raised: *"])
    section = out.partition("_ test_returns_while_peer_waits _")[2].partition("Captured stdout call")
    assert len(section[0].splitlines()) < 30 and "def all_reduce" not in section[0]
    # --capture=sys: the ranks' print output goes to pytest's capture, shown for the failed test only
    assert "RANK-PRINTED 0" in section[2] and "RANK-PRINTED 1" in section[2]
    assert "PASSING-RANK-PRINTED" not in out
    # warnings from the ranks, and pytest's return-value warning, in the warnings summary at the test file
    result.stdout.fnmatch_lines(["*tests/test_outcomes.py:*: UserWarning: warned on rank 0"])
    result.stdout.fnmatch_lines(["*tests/test_outcomes.py:*: PytestReturnNotNoneWarning: *returned <class 'int'>*"])
    # pytest objects are refused with the true reason; a nccl test skips without GPUs
    result.stdout.fnmatch_lines(["*'capsys' is pytest's CaptureFixture object: it belongs to the pytest process*"])
    result.stdout.fnmatch_lines(["*'request' is pytest's *Request object: it belongs to the pytest process*"])
    result.stdout.fnmatch_lines(["SKIPPED*ranks(2, backend='nccl') needs 2 CUDA devices (one per rank)*"])


LINE = """
import pytest
import torch.distributed as dist


@pytest.mark.ranks(1)
def test_fails():
    value = dist.get_world_size()
    assert value == 2
"""


def test_tb_line_points_at_the_test_file_and_given_is_refused(project: tuple[pytest.Pytester, Path]) -> None:
    pytester, _ = project
    path = _write(pytester, "test_line.py", LINE)
    given = _write(pytester, "test_given.py", HYPOTHESIS)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "--tb=line", "-p", "no:cacheprovider", path, given)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([f"{pytester.path}/tests/test_line.py:9: rank 0 of 1 raised: assert 1 == 2"])
    assert "tests/harness/" not in result.stdout.str().partition("test_given")[0]
    result.stdout.fnmatch_lines(["*@given cannot be combined with @pytest.mark.ranks*"])


# --- coverage of code that runs only in the ranks ------------------------------------------------------------------

MYMOD = """
def in_the_pytest_process():
    return 1


def in_the_ranks_only(x):
    if x > 0:
        return "positive"
    return "other"
"""

COVERED = """
import pytest
import mymod


def test_in_the_pytest_process():
    assert mymod.in_the_pytest_process() == 1


@pytest.mark.ranks(2)
def test_in_the_ranks():
    assert mymod.in_the_ranks_only(1) == "positive"
"""


def _coverage_rows(text: str) -> dict[str, str]:
    """``{file: missing}`` from a ``term-missing`` report (``Name Stmts Miss Cover Missing`` rows)."""
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith(".py") and parts[3].endswith("%"):
            rows[parts[0]] = " ".join(parts[4:])
    return rows


@pytest.mark.parametrize("runner", ["pytest-cov", "coverage run"])
def test_rank_lines_count_as_covered(project: tuple[pytest.Pytester, Path], runner: str) -> None:
    """pytest-cov 7 measures no subprocess, nor does ``coverage run`` unconfigured: the ranks send their data back.

    The report holds the project's files, the harness's, and this package's own when it is installed editable
    (outside site-packages): nothing that only the ranks ran (multiprocessing's start-up, the outbox) joins it, and the
    ranks leave no data file of their own.
    """
    pytest.importorskip("pytest_cov" if runner == "pytest-cov" else "coverage", reason=f"no {runner} here")
    pytester, _ = project
    _write(pytester, "mymod.py", MYMOD)
    args = ["-p", PLUGIN, "-p", "no:cacheprovider", _write(pytester, "test_covered.py", COVERED)]
    if runner == "pytest-cov":
        run = pytester.runpytest_subprocess(*args, "--cov=mymod", "--cov-report=term-missing")
        report = run.stdout.str()
    else:
        run = pytester.run(sys.executable, "-m", "coverage", "run", "-m", "pytest", *args)
        report = pytester.run(sys.executable, "-m", "coverage", "report", "-m").stdout.str()
    run.assert_outcomes(passed=2)
    rows = _coverage_rows(report)
    # only the branch no test takes is missing (line 9); lines 6-8, run only in the ranks, count as covered
    assert rows.get("tests/mymod.py") == "9", report
    # besides the project's files: this package (when installed editable) and the harness with the suite's
    # tests/__init__.py, which the pytest process runs too (imported from this checkout, outside the project)
    suite = Path(__file__).resolve().parent
    ours = (Path(torchmetrics_gradpatch.__file__).parent, suite / "harness", suite / "__init__.py")
    assert {n for n in rows if not n.startswith("tests/") and not any(Path(n).is_relative_to(p) for p in ours)} == set()
    if runner == "coverage run":
        assert {"tests/conftest.py", "tests/test_covered.py"} <= set(rows), report
    assert sorted(p.name for p in pytester.path.glob(".coverage*")) == [".coverage"]


def test_the_symptom_of_a_forgotten_plugin(project: tuple[pytest.Pytester, Path]) -> None:
    """Without ``-p``: what the testing page says a user sees (the marker unknown, no process group)."""
    pytester, _ = project
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", _write(pytester, "test_line.py", LINE))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*PytestUnknownMarkWarning: Unknown pytest.mark.ranks*"])
    result.stdout.fnmatch_lines(["*ValueError: Default process group has not been initialized*"])
