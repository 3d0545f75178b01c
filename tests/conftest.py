"""Shared pytest configuration: fixtures several modules use, and the ``slow`` option.

Nothing here imports torch or the package at module level: the torch1.13 environment loads this file too, where
``import torchmetrics_gradpatch`` refuses by design. No process group lives in a pytest process (``tests._ranks``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest


@pytest.fixture
def restore_patch_state() -> Iterator[None]:
    """Whatever the test does to the patch state, put it back as found: open blocks closed, then ``patch()``'s
    switch, mode, sync and check as before (``patch(mode, sync, check)`` if it was on, ``unpatch()`` if not)."""
    import torchmetrics_gradpatch as tg
    from torchmetrics_gradpatch import _engine

    before = _engine.snapshot()
    assert before.blocks == 0, "a patched() block was left open before this test"
    yield
    while _engine.snapshot().blocks:
        _engine.exit_block()
    tg.patch(before.manual_mode, before.manual_sync, before.manual_check) if before.manual else tg.unpatch()


@pytest.fixture
def pretend_native() -> Callable[[], AbstractContextManager[bool]]:
    """``with pretend_native() as really_native:``: the engine treats torchmetrics as native (>= 1.6) inside the
    block; the real flag comes back, re-synced, at its end (forcing False on 1.9 would leak a trampoline)."""
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


# Tests marked @pytest.mark.slow are skipped unless --run-slow is given, so the default suite stays fast on 2 cores.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
