"""The runner and the pool under faults: what a rank starts, a parent that dies, a start that fails, bad input.

Every "nothing left" claim is checked against the operating system (``/proc``, the temp directory), not against
the runner's bookkeeping. Functions the ranks run are module-level here, as spawn requires.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from packaging.version import Version

from tests._procs import alive
from tests._subprocess import suite_path
from tests.harness import RankError, _pool, spawn_ranks

pytestmark = [pytest.mark.harness, pytest.mark.usefixtures("suite_importable")]  # tox's harness environment

pytest_plugins = ["pytester"]

PLUGIN = "tests.harness.plugin"
TIMEOUT = 60.0


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after ``seconds`` (polling)."""
    deadline = time.monotonic() + seconds
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# --- a rank's own children ------------------------------------------------------------------------------------------


def start_a_sleeper(out: str, fail: bool) -> int:
    """In a rank: start a child that would sleep for minutes, note its pid, then return (or raise)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(out, f"sleeper{dist.get_rank()}").write_text(str(sleeper.pid))
    if fail:
        raise RuntimeError("after starting a sleeper")
    return sleeper.pid


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_a_process_a_rank_started_goes_with_spawn_ranks(tmp_path: Path, fail: bool) -> None:
    if fail:
        with pytest.raises(RankError, match="after starting a sleeper"):
            spawn_ranks(start_a_sleeper, 2, args=(str(tmp_path), fail), timeout=TIMEOUT)
    else:
        spawn_ranks(start_a_sleeper, 2, args=(str(tmp_path), fail), timeout=TIMEOUT)
    sleepers = [int(path.read_text()) for path in sorted(tmp_path.glob("sleeper*"))]
    assert len(sleepers) == 2
    assert _gone_within(sleepers, 1.0) == [], "a process a rank started outlived spawn_ranks"


def test_a_process_a_pooled_rank_started_goes_with_the_pool(tmp_path: Path) -> None:
    pool = _pool.RankPool(2)
    try:
        sleepers = pool.run(start_a_sleeper, (str(tmp_path), False), timeout=TIMEOUT)
        assert all(alive(pid) for pid in sleepers)  # the pool is still up: its ranks' children may run
    finally:
        pool.close()
    assert _gone_within(sleepers, 1.0) == [], "a process a pooled rank started outlived the pool"


# --- a parent that dies ---------------------------------------------------------------------------------------------

JOB = """
import os, re, sys, pathlib
import torch.distributed as dist

def hold_the_gil(out):
    pathlib.Path(out, f"rank{dist.get_rank()}").write_text(str(os.getpid()))
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: C code, GIL held, for ages
"""


def test_ranks_die_with_a_killed_parent_even_in_c_code_holding_the_gil(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    script = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import job\n"
        "from tests.harness import spawn_ranks\n"
        f"spawn_ranks(job.hold_the_gil, 2, args=({str(tmp_path)!r},), timeout=600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=suite_path())
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(ranks := [int(p.read_text()) for p in tmp_path.glob("rank*") if p.read_text()]) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, "the ranks never started"
            time.sleep(0.1)
        time.sleep(0.3)  # both ranks inside re.match
        parent.kill()
        parent.wait()
        assert _gone_within(ranks, 1.5) == [], "a rank outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# --- a pool that cannot start ---------------------------------------------------------------------------------------

START_UNDER_EMFILE = """
import errno, json, multiprocessing, os, resource, sys, tempfile
from tests.harness import _pool

import torch.distributed as dist  # before the limit: the test is about the pool's start, not torch's import
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
before = len(os.listdir("/proc/self/fd"))
store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
store_needs = len(os.listdir("/proc/self/fd")) - before
del store
seen = []
# from just enough for the store (torch's store aborts the process when EMFILE hits its own thread) upwards, so
# the limit is reached at each later step of the start in turn
for spare in range(store_needs + 1, store_needs + 30):
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + spare, hard))
    pool = _pool.RankPool(2)
    try:
        # a function the ranks can import (one defined here, in `python -c`'s __main__, they cannot): the last
        # step is a start that succeeds and runs it
        ranks = pool.run(dist.get_rank, timeout=60)
        outcome = "started" if ranks == [0, 1] else f"started, but the ranks said {ranks}"
    except BaseException as error:
        outcome = f"{type(error).__name__}: {error}".splitlines()[0]
        outcome += f" [errno {error.errno}]" if isinstance(error, OSError) else ""
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    pool.close()
    _pool.close_all()
    children = [p.pid for p in multiprocessing.active_children() if "resource_tracker" not in p.name]
    seen.append({"spare": spare, "outcome": outcome, "children": children})
    if outcome == "started":
        break
print(json.dumps(seen))
"""


@pytest.mark.skipif(
    Version(importlib.metadata.version("torch")).release < (2, 1),
    reason="torch 2.0's TCPStore aborts the whole process (a C++ SocketError, no Python exception) when its accept "
    "thread hits EMFILE, so there is no cause to surface",
)
def test_a_pool_start_that_fails_raises_its_own_cause_and_leaves_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", START_UNDER_EMFILE],
        env=env,
        cwd=suite_path(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    outcomes = [entry["outcome"] for entry in seen]
    assert outcomes[-1] == "started", outcomes  # the limit was reached at every step of the start, up to none
    assert not any("can only join a started process" in outcome for outcome in outcomes), outcomes
    assert any(f"[errno {24}]" in outcome for outcome in outcomes), outcomes  # EMFILE itself, not a stand-in
    assert all(entry["children"] == [] for entry in seen), seen
    assert "Traceback" not in proc.stderr, proc.stderr  # close_all and the atexit hook raise nothing
    assert list(tmp_path.glob("tmgp-*")) == []


# --- bad input, refused before anything starts ----------------------------------------------------------------------


def echo(*args: object) -> tuple[object, ...]:
    return args


def test_args_may_be_any_iterable_read_once() -> None:
    assert spawn_ranks(echo, 1, args=(x for x in [1, 2]), timeout=TIMEOUT) == [(1, 2)]


@pytest.mark.parametrize("timeout", [True, math.inf, math.nan, "5", None, 0, -1.0], ids=repr)
def test_a_timeout_must_be_a_positive_finite_number(timeout: object) -> None:
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds \(finite, not a bool\)"):
        spawn_ranks(echo, 1, timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fn", "kwargs", "match"),
    [
        (None, {}, "fn must be a callable"),
        (echo, {"args": 5}, "args must be an iterable of fn's positional arguments"),
        (echo, {"args": "ab"}, "args must be an iterable of fn's positional arguments"),
        (echo, {"args": {"a": 1}}, "args must be an iterable of fn's positional arguments"),
    ],
    ids=["fn-None", "args-int", "args-str", "args-dict"],
)
def test_bad_input_is_refused_before_any_process_starts(fn: object, kwargs: dict[str, object], match: str) -> None:
    import multiprocessing

    before = set(multiprocessing.active_children())  # a warm pool of an earlier test may be alive: not ours
    start = time.monotonic()
    with pytest.raises(TypeError, match=match):
        spawn_ranks(fn, 1, **kwargs)  # type: ignore[arg-type]
    assert time.monotonic() - start < 1.0  # no rank was started (starting one takes seconds)
    started = set(multiprocessing.active_children()) - before
    assert all("resource_tracker" in child.name for child in started), started


def return_what_only_the_rank_can_import(directory: str) -> object:
    Path(directory, "only_in_rank_module.py").write_text("class Thing:\n    pass\n")
    sys.path.insert(0, directory)
    import only_in_rank_module  # type: ignore[import-not-found]

    return only_in_rank_module.Thing()


@pytest.fixture
def rank_only_dir(tmp_path: Path) -> Path:
    path = tmp_path / "rank-only"
    path.mkdir()
    return path


def test_a_return_value_the_parent_cannot_unpickle_names_the_rank_and_type(rank_only_dir: Path) -> None:
    with pytest.raises(RankError) as caught:
        spawn_ranks(return_what_only_the_rank_can_import, 1, args=(str(rank_only_dir),), timeout=TIMEOUT)
    error = caught.value
    assert (error.rank, error.reason) == (0, "raised")
    assert "rank 0's return value (only_in_rank_module.Thing) pickled in the rank" in error.details
    assert "cannot be unpickled in the parent: ModuleNotFoundError" in error.details


# --- a hang's report ------------------------------------------------------------------------------------------------


def one_sleeps_the_other_waits() -> None:
    import torch

    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_a_hang_report_leads_with_the_rank_outside_a_collective() -> None:
    # in a warm pool, where what this module imports is imported already, so the deadline finds rank 0 in
    # all_reduce however slowly a loaded machine starts ranks (spawn_ranks' deadline would include the start);
    # there a run reaches fn's first line in 0.03 s at load 8 on 2 cores
    pool = _pool.RankPool(2)
    try:
        pool.run(echo, timeout=TIMEOUT)
        with pytest.raises(RankError) as caught:
            pool.run(one_sleeps_the_other_waits, timeout=3.0)
    finally:
        pool.close()
    error = caught.value
    assert (error.rank, error.reason) == (1, "timed out")
    assert error.collectives == {0: "all_reduce"}
    assert str(error).startswith("rank 1 timed out:\nnot inside a collective: rank 1; rank 0 waits in all_reduce")
    assert re.search(r"--- rank 1, still running.*--- rank 0, still running", error.details, re.S)


# --- the pool: start-up apart from the test, a reset that imports nothing -------------------------------------------


def compiler_modules() -> list[str]:
    return sorted(name for name in sys.modules if name.startswith(("torch._dynamo", "torch._inductor")))


def set_deterministic() -> bool:
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    return before


def test_the_pool_start_is_not_charged_to_the_first_test() -> None:
    pool = _pool.RankPool(2)
    try:
        # a start takes seconds, the test none (a builtin: unpickling it imports nothing)
        assert pool.run(abs, (-1,), timeout=1.0) == [1, 1]
    finally:
        pool.close()


def test_a_pool_start_that_overruns_its_own_bound_is_reported_as_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "STARTUP_TIMEOUT", 0.5)  # no rank imports torch that fast
    pool = _pool.RankPool(2)
    try:
        with pytest.raises(RankError) as caught:
            pool.run(echo, timeout=TIMEOUT)
    finally:
        pool.close()
    assert caught.value.starting and caught.value.reason == "timed out"
    assert str(caught.value).startswith(f"rank {caught.value.rank} timed out while the rank pool was starting:")
    assert pool.pids == [] and pool.retired is not None and "at start-up" in pool.retired


def test_the_per_test_reset_imports_nothing_a_fresh_rank_does_not() -> None:
    fresh = spawn_ranks(compiler_modules, 1, timeout=TIMEOUT)
    pool = _pool.RankPool(1)
    try:
        pooled = [pool.run(compiler_modules, timeout=TIMEOUT) for _ in range(2)]
        assert pool.run(set_deterministic, timeout=TIMEOUT) == [False]
        assert pool.run(set_deterministic, timeout=TIMEOUT) == [False]  # a changed flag is still put back
    finally:
        pool.close()
    assert pooled == [fresh, fresh]


# --- SIGTERM to pytest ----------------------------------------------------------------------------------------------

SIGTERMED = """
import os, pathlib, subprocess, sys, time
import pytest
import torch.distributed as dist

def _sleep(name):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    out = pathlib.Path(os.environ["TMGP_OUT"])
    (out / f"{name}-sleeper{dist.get_rank()}").write_text(str(sleeper.pid))
    (out / f"{name}-rank{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(600)

@pytest.mark.ranks(2, reuse=True)
def test_a_pooled_passes():
    pass

@pytest.mark.ranks(2, timeout=300)
def test_b_fresh_sleeps():
    _sleep("fresh")
"""


def test_sigterm_to_pytest_leaves_no_temp_directory_or_process(pytester: pytest.Pytester, tmp_path: Path) -> None:
    temp, out = tmp_path / "temp", tmp_path / "out"
    temp.mkdir()
    out.mkdir()
    pytester.makepyfile(test_sigtermed=SIGTERMED)
    env = {**os.environ, "TMPDIR": str(temp), "TMGP_OUT": str(out)}
    command = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider"]
    proc = subprocess.Popen(command, cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(list(out.glob("fresh-*"))) < 4:
            assert time.monotonic() < deadline and proc.poll() is None, "the sleeping test never started"
            time.sleep(0.1)
        time.sleep(0.3)
        assert list(temp.glob("tmgp-*")), "the run holds a directory of its own while the ranks run"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGTERM  # it still dies of SIGTERM
    pids = [int(path.read_text()) for path in out.iterdir()]
    assert _gone_within(pids, 2.0) == [], "a rank or a process it started outlived SIGTERM to pytest"
    assert list(temp.glob("tmgp-*")) == []


# --- the marker: settings, one timeout, an immediate skip -----------------------------------------------------------

MARKED = """
import os, pathlib, sys, time
import pytest

@pytest.fixture
def noted():
    pathlib.Path("fixture-ran").write_text("yes")

@pytest.mark.ranks(2, backend="nccl")
def test_nccl(noted):
    pass

def test_torch_not_imported_by_the_skip():
    assert "torch" not in sys.modules

@pytest.mark.ranks(1, timeout=float("inf"))
def test_infinite_timeout():
    pass

@pytest.mark.ranks(1, timeout=30)
def test_outlasts_pytest_timeout():
    time.sleep(2.5)  # longer than --timeout=2, which would end it were the limit not raised
"""


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="this machine has a GPU: the nccl case would run")
def test_the_marker_settings_and_timeout_story(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_marked=MARKED)
    result = pytester.runpytest_subprocess(
        "-p", PLUGIN, "-p", "no:cacheprovider", "-p", "timeout", "--timeout=2",
        "--ranks-timeout=50", "-rs", timeout=300,
    )  # fmt: skip
    out = result.stdout.str()
    result.assert_outcomes(passed=2, failed=1, skipped=1)
    assert "torchmetrics_gradpatch ranks: timeout 50s (--ranks-timeout), reuse false (default)" in out
    # the missing backend is a skip before the fixtures (and without importing torch)
    assert "needs 2 CUDA devices (one per rank); this machine has 0" in out
    assert not (pytester.path / "fixture-ran").exists()
    # inf is refused by name, not an OverflowError
    assert "ranks(timeout=...) must be a positive number of seconds (finite, not a bool), got inf" in out
    assert "OverflowError" not in out


def test_a_bad_command_line_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", PLUGIN, "--ranks-timeout=soon")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--ranks-timeout: timeout must be a number of seconds, got 'soon'" in result.stderr.str()


PRECEDENCE = """
import time
import pytest

# each sleeps longer than --ranks-timeout=1.5, and far less than the marker's or the ini's timeout

@pytest.mark.ranks(1, timeout=40)
def test_marker_wins():
    time.sleep(2)

@pytest.mark.ranks(1)
def test_command_line_wins_over_ini():
    time.sleep(2)
"""


def test_marker_over_command_line_over_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nranks_timeout = 60\n")
    pytester.makepyfile(test_precedence=PRECEDENCE)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "--ranks-timeout=1.5", timeout=300)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*_ test_command_line_wins_over_ini _*", "rank 0 of 1 timed out:*"])
    assert "ranks: timeout 1.5s (--ranks-timeout)" in result.stdout.str()


# --- the layout: one way, no engine; working without the patch -----------------------------------------------------

HARNESS = Path(__file__).resolve().parent / "harness"
RANK_SIDE = {"_rank", "_worker", "_in_rank", "_records", "_coverage"}
PARENT_SIDE = {"_spawn", "_processes", "_collect", "_pool", "_reaper", "plugin", "_settings", "_sending", "_outcome"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at any depth of the file: imports inside functions count)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_harness_imports_nothing_of_the_package_and_the_rank_side_nothing_of_the_parent_side() -> None:
    assert {path.stem for path in HARNESS.glob("*.py")} == RANK_SIDE | PARENT_SIDE | {"__init__"}
    for path in HARNESS.glob("*.py"):
        imported = _imports(path)
        package = {name for name in imported if name.startswith("torchmetrics_gradpatch")}
        assert package == set(), f"{path.name} imports the package: {package}"
        if path.stem in RANK_SIDE:
            ours = {name for name in imported if name.startswith("tests.harness")}
            parent = {name for name in ours if name.rpartition(".")[2] in PARENT_SIDE}
            assert parent == set(), f"{path.name} (rank side) imports the parent side: {parent}"


RANK_JOB = """
import sys
import torchmetrics_gradpatch

def what_the_rank_loaded():
    harness = sorted(name for name in sys.modules if name.startswith("tests.harness"))
    return harness, torchmetrics_gradpatch.is_patched()
"""


def test_a_rank_loads_no_parent_side_module_and_runs_without_the_patch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "rank_job.py").write_text(RANK_JOB)
    monkeypatch.syspath_prepend(str(tmp_path))
    import rank_job  # type: ignore[import-not-found]

    parent_side = {f"tests.harness.{name}" for name in PARENT_SIDE}
    monkeypatch.setenv("TORCHMETRICS_GRADPATCH_AUTOPATCH", "0")
    (loaded, patched), _ = spawn_ranks(rank_job.what_the_rank_loaded, 2, timeout=TIMEOUT)
    assert set(loaded) & parent_side == set() and not patched
    pool = _pool.RankPool(1)
    try:
        [(loaded, patched)] = pool.run(rank_job.what_the_rank_loaded, timeout=TIMEOUT)
        assert set(loaded) & parent_side == set() and not patched
        monkeypatch.delenv("TORCHMETRICS_GRADPATCH_AUTOPATCH")
        [(_, patched)] = pool.run(rank_job.what_the_rank_loaded, timeout=TIMEOUT)
        assert patched  # the pool's reset reads each test's environment, as a fresh import would
    finally:
        pool.close()


def test_a_rank_error_pickles_whole_and_is_named_where_it_is_imported_from() -> None:
    import pickle

    error = RankError(1, "timed out", "stacks", {1: "report"}, collectives={0: "all_reduce"}, starting=True)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.reason, copy.details, copy.reports) == (1, "timed out", "stacks", {1: "report"})
    assert (copy.collectives, copy.starting, str(copy)) == ({0: "all_reduce"}, True, str(error))
    assert f"{RankError.__module__}.{RankError.__qualname__}" == "tests.harness.RankError"
