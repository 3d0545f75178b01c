"""The warm rank pool (``@pytest.mark.ranks(n, reuse=True)``, ini ``ranks_reuse``), checked from outside.

Each case runs pytest in a subprocess on a small project whose rank bodies write, per test, the pid of the
process and what it saw into a directory. Reuse is proven by pids (the same processes ran consecutive tests),
recycling by new pids after a failing, hanging or group-breaking test, and "nothing left behind" against
``/proc`` after the session, not against the pool's own bookkeeping. Starting a pool costs seconds here, so the
cases share runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._procs import alive, interrupt_once
from tests.harness import _pool

pytestmark = [pytest.mark.harness, pytest.mark.usefixtures("suite_importable")]  # tox's harness environment

pytest_plugins = ["pytester"]

PLUGIN = "tests.harness.plugin"
#: The hanging test's timeout. It runs on warm ranks (the test before it started the pool), where a test takes
#: 0.03 s at load 8 on 2 cores before its body's first line: 3 s is a hundred times that.
HANG_TIMEOUT = 3.0

CONFTEST = """
import json
import os
import pathlib

import pytest
import torch.distributed as dist


def record(test, **seen):
    '''In a rank: note which process ran `test` as which rank, and what it saw.'''
    entry = {"pid": os.getpid(), "rank": dist.get_rank(), **seen}
    out = pathlib.Path(os.environ["TMGP_POOL_DIR"]) / f"{test}.rank{dist.get_rank()}.json"
    out.write_text(json.dumps(entry))


@pytest.fixture
def parent_cwd():
    return os.getcwd()


@pytest.fixture
def fixture_env(monkeypatch):
    monkeypatch.setenv("TMGP_FROM_FIXTURE", "yes")
"""

LIFECYCLE = f"""
import os
import sys
import time

import numpy
import pytest
import torch
import torch.distributed as dist

import torchmetrics_gradpatch
from conftest import record

SEEN = []  # a module global: a test that appends to it must not be seen by the next one


def leak_everything():
    os.environ["TMGP_LEAK"] = "1"
    os.chdir("/")
    sys.path.append("/tmgp-leaked-path")
    torch.manual_seed(1234)
    numpy.random.seed(1234)
    torch.set_default_dtype(torch.float64)
    torchmetrics_gradpatch.unpatch()
    SEEN.append("a")


def all_reduce_rank_sum():
    total = torch.tensor(float(dist.get_rank()))
    dist.all_reduce(total)
    return total.item()


@pytest.mark.ranks(2, reuse=True)
def test_a_leaks():
    record("a", draw=torch.rand(1).item(), np_draw=numpy.random.rand(), patched=torchmetrics_gradpatch.is_patched())
    leak_everything()


@pytest.mark.ranks(2, reuse=True)
def test_b_sees_none_of_it(parent_cwd):
    record(
        "b",
        draw=torch.rand(1).item(),
        np_draw=numpy.random.rand(),
        leak="TMGP_LEAK" in os.environ,
        cwd=os.getcwd() == parent_cwd,
        path="/tmgp-leaked-path" in sys.path,
        dtype=str(torch.get_default_dtype()),
        patched=torchmetrics_gradpatch.is_patched(),
        seen=list(SEEN),
        total=all_reduce_rank_sum(),
    )


@pytest.mark.ranks(2, reuse=True)
@pytest.mark.usefixtures("fixture_env")
def test_c_fixture_env_reaches_the_ranks():
    record("c", env=os.environ.get("TMGP_FROM_FIXTURE"))


@pytest.mark.ranks(2, reuse=True)
def test_d_fails():
    record("d")
    assert dist.get_rank() == 0, "rank 1 fails on purpose"


@pytest.mark.ranks(2, reuse=True)
def test_e_after_a_failure():
    record("e", total=all_reduce_rank_sum())


@pytest.mark.ranks(2, reuse=True)
def test_f_breaks_the_group():
    record("f")
    dist.destroy_process_group()


@pytest.mark.ranks(2, reuse=True)
def test_g_after_a_broken_group():
    record("g", total=all_reduce_rank_sum())


def hang_here_forever():
    while True:
        time.sleep(0.1)


@pytest.mark.ranks(2, reuse=True, timeout={HANG_TIMEOUT})
def test_h_hangs():
    record("h")
    if dist.get_rank() == 1:
        hang_here_forever()
    dist.barrier()


@pytest.mark.ranks(2, reuse=True)
def test_i_after_a_hang():
    record("i", total=all_reduce_rank_sum())


@pytest.mark.ranks(2)
def test_j_fresh():
    record("j")
"""


@pytest.fixture
def project(pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A user's project with the conftest above; yields (pytester, the record directory).

    Afterwards, no process that ran a test may still be alive.
    """
    (tmp_path / "seen").mkdir()
    monkeypatch.setenv("TMGP_POOL_DIR", seen := str(tmp_path / "seen"))
    (pytester.path / "conftest.py").write_text(CONFTEST)
    yield pytester, Path(seen)
    pids = {entry["pid"] for entry in _records(Path(seen)).values()}
    deadline = time.monotonic() + 5.0
    while (left := sorted(pid for pid in pids if alive(pid))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"rank processes left behind: {left}"


def _records(seen: Path) -> dict[str, dict[str, Any]]:
    return {path.name.removesuffix(".json"): json.loads(path.read_text()) for path in seen.glob("*.json")}


def _pids(records: dict[str, dict[str, Any]], test: str) -> tuple[int, int]:
    return records[f"{test}.rank0"]["pid"], records[f"{test}.rank1"]["pid"]


def test_reuse_reset_and_recycling(project: tuple[pytest.Pytester, Path]) -> None:
    pytester, seen = project
    pytester.makepyfile(test_lifecycle=LIFECYCLE)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "-rf", timeout=600)
    result.assert_outcomes(passed=8, failed=2)
    records = _records(seen)
    pools = {test: _pids(records, test) for test in "abcdefghij"}
    # one pool ran a-d; the failure retired it; e-f ran in a new one; the destroyed group retired that; g-h in a
    # third; the hang retired it; i in a fourth. The fresh test j ran in processes of its own.
    assert pools["a"] == pools["b"] == pools["c"] == pools["d"]
    assert pools["e"] == pools["f"] != pools["d"]
    assert pools["g"] == pools["h"] != pools["f"]
    assert pools["i"] != pools["h"]
    assert len({pid for pair in pools.values() for pid in pair}) == 2 * 5
    for rank in (0, 1):
        a, b = records[f"a.rank{rank}"], records[f"b.rank{rank}"]
        assert a["patched"] is True
        # nothing test a changed reached test b: the same first random draw as a fresh pool, the environment,
        # directory, path, dtype, patch state and module globals as at the start
        assert (b["draw"], b["np_draw"]) == (a["draw"], a["np_draw"])
        assert (b["leak"], b["cwd"], b["path"], b["dtype"], b["patched"], b["seen"]) == (
            False,
            True,
            False,
            "torch.float32",
            True,
            [],
        )
        assert records[f"c.rank{rank}"]["env"] == "yes"
        for test in "begi":
            assert records[f"{test}.rank{rank}"]["total"] == 1.0
    # the failure and the hang are reported as without the pool
    result.stdout.fnmatch_lines(["rank 1 of 2 raised*", "*rank 1 fails on purpose*"])
    result.stdout.fnmatch_lines(
        [
            "rank 1 of 2 timed out*",  # the rank outside a collective leads; its peer waits for it
            "not inside a collective: rank 1; rank 0 waits in barrier",
            "--- rank 1, still running at the deadline; its threads:",
            "*hang_here_forever*",
        ]
    )


INI_AND_X = """
import pytest
import torch.distributed as dist
from conftest import record


@pytest.mark.ranks(2)
def test_a_pooled_by_the_ini_option():
    record("a")


@pytest.mark.ranks(2, reuse=False)
def test_b_opted_out():
    record("b")


@pytest.mark.ranks(2)
def test_c_pooled_and_fails():
    record("c")
    assert dist.get_rank() == 1


@pytest.mark.ranks(2)
def test_d_not_run_after_x():
    record("d")
"""


def test_ini_option_marker_override_and_x(project: tuple[pytest.Pytester, Path]) -> None:
    pytester, seen = project
    pytester.makeini("[pytest]\nranks_reuse = true\n")
    pytester.makepyfile(test_ini=INI_AND_X)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "-x", timeout=300)
    result.assert_outcomes(passed=2, failed=1)
    records = _records(seen)
    assert _pids(records, "a") == _pids(records, "c")
    assert set(_pids(records, "b")).isdisjoint(_pids(records, "a"))
    assert not any(name.startswith("d.") for name in records)


def test_bad_reuse_value_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "import pytest\n\n@pytest.mark.ranks(2, reuse='yes')\ndef test_x():\n    pass\n",
    )
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ranks(reuse=...) must be True or False, got 'yes'*"])


XDIST = """
import pytest
from conftest import record


@pytest.mark.ranks(2, reuse=True)
@pytest.mark.parametrize("case", "abcd")
def test_pooled(case):
    record(case)
"""


def test_each_xdist_worker_has_its_own_pool(project: tuple[pytest.Pytester, Path]) -> None:
    pytest.importorskip("xdist")
    pytester, seen = project
    pytester.makepyfile(test_xdist=XDIST)
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "-n", "2", timeout=300)
    result.assert_outcomes(passed=4)
    pairs = {_pids(_records(seen), case) for case in "abcd"}
    assert 1 <= len(pairs) <= 2  # one pool per xdist worker that ran tests, reused within it
    assert len({pid for pair in pairs for pid in pair}) == 2 * len(pairs)


SLEEP = """
import time

import pytest
from conftest import record


@pytest.mark.ranks(2, reuse=True)
def test_a_warms_the_pool():
    record("a")


@pytest.mark.ranks(2, reuse=True)
def test_b_sleeps():
    record("b")
    time.sleep(120)
"""


def test_keyboard_interrupt_stops_the_pool(project: tuple[pytest.Pytester, Path]) -> None:
    pytester, seen = project
    path = pytester.makepyfile(test_sleep=SLEEP)
    command = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", str(path)]
    status, out = interrupt_once(command, pytester.path, lambda: len(list(seen.glob("b.*"))) == 2)
    assert status == pytest.ExitCode.INTERRUPTED, out
    assert _pids(_records(seen), "a") == _pids(_records(seen), "b")


# --- the pool without pytest in between -----------------------------------------------------------------------------


def rank_and_pid() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), os.getpid()


def test_pool_api_reuses_then_closes() -> None:
    pool = _pool.RankPool(2)
    try:
        first = pool.run(rank_and_pid, timeout=120)
        second = pool.run(rank_and_pid, timeout=120)
    finally:
        pool.close()
    assert [rank for rank, _ in first] == [0, 1]  # process r is rank r, and its result comes back as r's
    assert first == second
    assert pool.pids == [] and pool.retired == "closed"
    assert not any(alive(pid) for _, pid in first)
    with pytest.raises(ValueError, match="world_size"):
        _pool.run_pooled(rank_and_pid, 0)


def leave_a_thread() -> int:
    import threading

    threading.Thread(target=time.sleep, args=(60,), daemon=True, name="tmgp-left-behind").start()
    return os.getpid()


def make_a_subgroup() -> int:
    import torch.distributed as dist

    dist.new_group(list(range(dist.get_world_size())))
    return os.getpid()


def test_pool_api_retires_after_what_it_cannot_undo() -> None:
    pool = _pool.RankPool(2)
    try:
        threaded = pool.run(leave_a_thread, timeout=120)
        assert pool.pids == [] and "tmgp-left-behind" in str(pool.retired)
        grouped = pool.run(make_a_subgroup, timeout=120)
        assert pool.pids == [] and "new_group" in str(pool.retired)
    finally:
        pool.close()
    assert set(threaded).isdisjoint(grouped)
    assert not any(alive(pid) for pid in [*threaded, *grouped])
