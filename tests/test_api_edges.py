"""The API's edges: mode names, ``@patched`` bare, ``status()`` text, the docstring.

In-process, with no process group; the one case that gathers runs on one gloo rank (``tests/_ranks.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from tests._subprocess import ROOT
from torchmetrics_gradpatch import _engine
from torchmetrics_gradpatch.cli import build_parser

pytestmark = pytest.mark.python

NATIVE = tg.status().native
MODE = "global" if NATIVE else "local"  # the mode that installs the trampoline on this torchmetrics

# --- mode names: one rule everywhere ------------------------------------------------------------------------------


@pytest.fixture
def restored() -> Iterator[None]:
    yield
    while _engine._state.blocks:
        _engine.exit_block()
    tg.patch()


def test_mode_names_are_case_insensitive_in_the_api(restored: None) -> None:
    tg.patch(mode="Local")
    assert tg.status().mode == "local"
    with tg.patched(mode=" GLOBAL "):
        assert tg.status().mode == "global"
    with pytest.raises(ValueError, match="is not a gradient mode"):
        tg.patch(mode="globl")


def test_mode_names_are_case_insensitive_in_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchmetrics_gradpatch._api import mode_requested

    for raw, mode in (("Global", "global"), (" LOCAL ", "local"), ("", "local")):
        monkeypatch.setenv("TORCHMETRICS_GRADPATCH_MODE", raw)
        assert mode_requested() == mode
    monkeypatch.setenv("TORCHMETRICS_GRADPATCH_MODE", "globl")
    with pytest.raises(ValueError, match="TORCHMETRICS_GRADPATCH_MODE='globl' is not a gradient mode"):
        mode_requested()


def test_mode_names_are_case_insensitive_on_the_command_line() -> None:
    assert build_parser().parse_args(["check", "--mode", "Global"]).mode == "global"


def _any_case(rank: int, world_size: int) -> None:
    x = torch.tensor([1.0, 2.0])
    for mode in ("Local", "GLOBAL"):
        out = tg.gather_all_tensors(x, mode=mode)
        assert out[0] is x, (mode, out)
    with pytest.raises(ValueError, match="is not a gradient mode"):
        tg.gather_all_tensors(x, mode="both")


def test_the_direct_gather_takes_any_case() -> None:
    run_ranks(_any_case, 1)


# --- @patched without parentheses ---------------------------------------------------------------------------------


def test_patched_without_parentheses_is_patched_with_them(restored: None) -> None:
    tg.unpatch()

    @tg.patched
    def inside(x: int) -> tuple[int, bool]:
        """Doc."""
        return x, tg.is_patched()

    assert inside(2) == (2, True) and inside.__name__ == "inside" and inside.__doc__ == "Doc."
    assert not tg.is_patched()
    with pytest.raises(ValueError, match=r"not a gradient mode; use one of 'local', 'global' \(to decorate"):
        tg.patch(inside)  # type: ignore[arg-type]


# --- status() -----------------------------------------------------------------------------------------------------


def _consistent(status: tg.Status) -> None:
    assert status.in_force == (status.state != "off"), status
    assert bool(status.applied_to) == (status.state == "patched"), status
    if status.state == "native":
        assert status.native and status.graph_preserving and status.mode == "local"


def test_status_is_consistent_and_plain_in_every_state(restored: None) -> None:
    import torchmetrics.utilities.distributed  # noqa: F401 - the patch lands when torchmetrics is imported

    tg.patch(MODE)
    on = tg.status()
    _consistent(on)
    assert on.state == "patched" and "in force:         yes: patch() is on" in str(on)
    assert "reaches the patched function" in str(on)
    tg.unpatch()
    off = tg.status()
    _consistent(off)
    text = str(off)
    assert off.state == "off" and "in force:         no: unpatch() has switched off" in text
    assert "reaches" not in text and "autopatch: on" not in text and "applied to" not in text
    assert "gradient mode:    off (not in force)" in text
    with tg.patched():
        block = tg.status()
        _consistent(block)
        assert "1 patched() block is open" in str(block)
        assert f"gradient mode:    {tg.status().mode}, the default mode" in str(block)


def test_status_on_native_torchmetrics_in_local_mode_says_nothing_needs_applying(restored: None) -> None:
    """On torchmetrics >= 1.6 (faked here where it is not) local mode is in force with nothing applied."""
    was_native = _engine._state.native
    tg.patch("local")
    with _engine._lock:
        _engine._state.native = True
        _engine._sync()
    try:
        native = tg.status()
        _consistent(native)
        assert native.in_force and native.state == "native" and native.applied_to == ()
        assert "nothing needs applying" in str(native) and "reaches" not in str(native)
    finally:
        with _engine._lock:
            _engine._state.native = was_native
            _engine._sync()
    assert _engine.installed() == (not was_native)


# --- help(torchmetrics_gradpatch) ---------------------------------------------------------------------------------


def test_the_package_docstring_points_only_at_public_names_and_docs() -> None:
    doc = tg.__doc__ or ""
    assert not re.search(r"torchmetrics_gradpatch\._|:mod:`[^`]*\._", doc), "private modules in the docstring"
    for name in re.findall(r":(?:func|class):`(\w+)`", doc):
        assert name in tg.__all__, f"{name} is not a public name"
    assert set(tg.__all__) <= set(re.findall(r":(?:func|class):`(\w+)`", doc)), "a public name is missing"
    for page in re.findall(r"docs/[\w-]+\.md", doc):
        assert (ROOT / page).is_file(), page
