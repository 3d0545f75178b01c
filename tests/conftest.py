"""Shared pytest configuration.

Do not import torch or torchmetrics_gradpatch at module level here, except through ``_ranks_plugin()``: the
torch1.13 tox environment loads this file too, and there ``import torchmetrics_gradpatch`` refuses by design.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest


# --- the suite's rank harness: @pytest.mark.ranks (tests/harness/plugin.py) -------------------------------------
# Its ranks import the package; on torch below 2.0 that import refuses by design. That environment runs only the
# refusal and CLI tests, which never use the marker, so the harness stays out there. Any other error is raised.
def _ranks_plugin() -> list[str]:
    try:
        import torchmetrics_gradpatch  # noqa: F401
    except ImportError as error:
        if type(error).__name__ != "UnsupportedVersionError":
            raise
        return []
    return ["tests.harness.plugin"]


pytest_plugins = _ranks_plugin()

# --- fixtures several modules share ------------------------------------------------------------------------------
# Each imports the package inside the fixture (see the module docstring: torch1.13 loads this file too).


@pytest.fixture
def suite_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Subprocesses (pytester's runs included) can import ``tests.harness`` and still import the installed package,
    not the checkout's copy (see ``tests._subprocess.suite_path``)."""
    from tests._subprocess import python_path

    monkeypatch.setenv("PYTHONPATH", python_path())


@pytest.fixture
def restore_patch_state() -> Iterator[None]:
    """Whatever the test does to the patch state, put it back as found: open blocks closed, then ``patch()``'s
    switch and mode as before (``patch(mode)`` if it was on, ``unpatch()`` if not)."""
    import torchmetrics_gradpatch as tg
    from torchmetrics_gradpatch import _engine

    before = _engine.snapshot()
    assert before.blocks == 0, "a patched() block was left open before this test"
    yield
    while _engine.snapshot().blocks:
        _engine.exit_block()
    tg.patch(before.manual_mode) if before.manual else tg.unpatch()


@pytest.fixture
def pretend_native() -> Callable[[], AbstractContextManager[bool]]:
    """``with pretend_native() as really_native:`` makes the engine treat torchmetrics as native (>= 1.6, whose
    gather keeps the graph) inside the block, and restores the real flag, re-syncing, when it ends, even on
    torchmetrics 1.9 (forcing the flag to False there would leak a wrongly installed trampoline)."""
    from torchmetrics_gradpatch import _engine

    @contextmanager
    def native() -> Iterator[bool]:
        was_native = _engine._state.native
        with _engine._lock:
            _engine._state.native = True
            _engine._sync()
        try:
            yield was_native
        finally:
            with _engine._lock:
                _engine._state.native = was_native
                _engine._sync()

    return native


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    """A one-process gloo group in the pytest process, for the module, so the gather runs without spawning.

    At the end gloo's worker is left holding only a barrier's internal tensors, none owned by Python: on torch 2.0
    a worker that frees a Python-owned tensor while destroy_process_group joins it (holding the GIL) deadlocks
    now and then; it also gets 0.2 s to finish there.
    """
    import gc

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    gc.collect()
    dist.barrier()
    if torch.__version__.startswith("2.0."):
        time.sleep(0.2)
    dist.destroy_process_group()


# --- machine-readable result of a tox environment --------------------------------------------------------------
# tox.ini sets TMGP_RESULT_JSON=results/raw/<env>.json; scripts/compat_table.py turns those files into the README's
# compatibility table. Without the variable nothing is written.
_started = time.monotonic()


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _compile_summary(stats: dict[str, list[pytest.TestReport]]) -> dict[str, object] | None:
    """Outcomes of tests/test_compile.py alone (``None`` if it did not run): passed, failed, skipped, xfailed, why."""
    mine = {
        key: [r for r in stats.get(key, []) if r.nodeid.startswith("tests/test_compile.py")]
        for key in ("passed", "failed", "error", "skipped", "xfailed")
    }
    if not any(mine.values()):
        return None
    return {
        **{key: len({r.nodeid for r in reports}) for key, reports in mine.items()},
        "skip_reasons": sorted({_skip_reason(r) for r in mine["skipped"]}),
        "xfail_reasons": sorted({str(getattr(r, "wasxfail", "")) for r in mine["xfailed"]}),
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get("TMGP_RESULT_JSON")
    if not target or hasattr(session.config, "workerinput"):  # xdist workers: only the controller writes
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {}) if reporter is not None else {}
    counts = {key: len(stats.get(key, [])) for key in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    # which tests did not pass, and why a test was skipped: the table must not show a skip as a silent pass
    not_passed = sorted({report.nodeid for key in ("failed", "error") for report in stats.get(key, [])})
    skipped = sorted({(report.nodeid, _skip_reason(report)) for report in stats.get("skipped", [])})
    result = {
        "env": os.environ.get("TOX_ENV_NAME"),
        "torch": _dist_version("torch"),
        "torchmetrics": _dist_version("torchmetrics"),
        "python": platform.python_version(),
        "exitstatus": int(exitstatus),
        "outcome": "passed" if int(exitstatus) == 0 else "failed",
        "counts": counts,
        "not_passed": not_passed,
        "skipped": [{"test": test, "reason": reason} for test, reason in skipped],
        "compile": _compile_summary(stats),  # the compatibility table's torch.compile column
        "duration_s": round(time.monotonic() - _started, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


# --- slow tests ------------------------------------------------------------------------------------------------
# Tests marked @pytest.mark.slow are skipped unless --run-slow is given (tox -e slow does), so the default suite
# stays fast on 2 cores.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (tox -e slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
