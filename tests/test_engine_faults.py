"""Faults and bad input at the engine and API: a replaced module attribute, a status read during toggling, our
trampoline put back by another tool, misuse of the API, a bad environment variable and who patched.

In this process where a test can restore what it changed and needs no process group; on a one-rank gloo world
(``run_ranks``) where it runs a gather; in a fresh interpreter where the case is an import.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import torch
import torchmetrics.utilities.distributed as tm_dist

import torchmetrics_gradpatch as tg
from tests._ranks import run_ranks
from tests._subprocess import WORLD_OF_ONE, ok, run_python
from torchmetrics_gradpatch import _engine

pytestmark = pytest.mark.once

NATIVE = tg.status().native
MODE = "global" if NATIVE else "local"  # the mode that installs the trampoline on this torchmetrics
FUNCTION = tm_dist.gather_all_tensors


@pytest.fixture(autouse=True)
def from_unpatched() -> Iterator[None]:
    tg.unpatch()
    yield
    while _engine._state.blocks:
        _engine.exit_block()
    tg.compile_support(False)
    tg.patch()


# --- a replaced module attribute ----------------------------------------------------------------------------------

REPLACED = (
    """
import torchmetrics, torchmetrics.metric as tm_metric, torchmetrics.utilities.distributed as tm_dist
OWN = tm_dist.gather_all_tensors
OWN_CODE = OWN.__code__

def foreign(result, group=None):  # another tool's function of the same signature, put in before the import
    return ["foreign"]

FOREIGN_CODE = foreign.__code__
tm_dist.gather_all_tensors = foreign
import torchmetrics_gradpatch as tg
MODE = "global" if tg.status().native else "local"
tg.patch(MODE)
"""
    + WORLD_OF_ONE
    + """
assert foreign.__code__ is FOREIGN_CODE and tm_dist.gather_all_tensors(torch.ones(1)) == ["foreign"]
assert tm_metric.gather_all_tensors is OWN and OWN.__code__ is not OWN_CODE
NATIVE = tg.status().native
x = torch.arange(3.0, requires_grad=True)
entry = OWN(x)[0]  # through our gather: x itself in local mode, a new output with a graph in global mode
assert (entry is x) if MODE == "local" else (entry is not x and entry.grad_fn is not None), entry
s = tg.status()
assert s.state == "patched" and s.attribute_replaced_by == "__main__.foreign", s
assert s.references["torchmetrics.utilities.distributed.gather_all_tensors"] is False, s.references
assert s.references["torchmetrics.metric.gather_all_tensors"] is True, s.references
assert "module attribute: torchmetrics.utilities.distributed.gather_all_tensors holds __main__.foreign" in str(s)
tg.unpatch()
assert OWN.__code__ is OWN_CODE
assert (OWN(x)[0] is x) is NATIVE, "torchmetrics' own gather again (native torchmetrics returns x itself)"
print("OK")
"""
)


def test_a_replaced_module_attribute_is_not_hijacked() -> None:
    assert ok(REPLACED, timeout=120).strip().endswith("OK")


# --- status(): one snapshot, and graph preservation from what is installed ------------------------------------------


def test_status_read_while_others_toggle_never_contradicts_itself() -> None:
    stop = threading.Event()
    errors: list[BaseException] = []

    def toggle() -> None:
        try:
            while not stop.is_set():
                tg.patch(MODE)
                with tg.patched(mode="global"):
                    tg.unpatch()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=toggle) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: inside a status() if it can be torn
    for thread in threads:
        thread.start()
    bad = []
    try:
        for _ in range(30_000):
            s = tg.status()
            facts = (
                s.in_force == (s.state != "off"),
                s.in_force == (bool(s.switched_on_by) or s.open_blocks > 0),
                bool(s.applied_to) == (s.state == "patched"),
                (s.mode == "off") == (not s.in_force),
                (s.mode_chosen_by == "patched(mode=...)") == (s.in_force and s.open_blocks > 0),
            )
            if not all(facts):
                bad.append((facts, s))
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        for thread in threads:
            thread.join(30)
    assert errors == [] and bad == [], bad[:3]


def _our_trampoline_put_back(rank: int, world_size: int) -> None:
    tg.unpatch()  # what the module's fixture does in this process
    tg.patch(MODE)
    trampoline = FUNCTION.__code__
    tg.unpatch()
    original = FUNCTION.__code__
    assert trampoline is not original
    FUNCTION.__code__ = trampoline  # another tool restores what it saw there
    try:
        s = tg.status()
        assert s.state == "off" and s.applied_to == () and not s.in_force, s
        assert s.graph_preserving is NATIVE and ("graph preserved:  NO" in str(s)) is not NATIVE, s
        x = torch.arange(3.0, requires_grad=True)
        # the original: a copy before 1.6, x itself on native torchmetrics (where our global mode would not be)
        assert (FUNCTION(x)[0] is x) is NATIVE, "the trampoline runs the original while the patch is off"
    finally:
        FUNCTION.__code__ = original
        tg.patch()


def test_our_trampoline_put_back_after_unpatch_is_not_reported_as_preserving() -> None:
    run_ranks(_our_trampoline_put_back, 1)  # the gather runs in a one-rank gloo world


# --- misuse of the API ---------------------------------------------------------------------------------------------


def test_an_unhashable_mode_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"mode=\['global'\] is not a gradient mode; use one of 'local', 'global'"):
        tg.gather_all_tensors(torch.ones(1), mode=["global"])  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["no", 0, None, "False"])
def test_compile_support_takes_only_a_bool(value: object) -> None:
    with pytest.raises(TypeError, match=rf"compile_support\(enabled={value!r}\): enabled must be True or False"):
        tg.compile_support(value)  # type: ignore[arg-type]
    assert tg.status().state == "off" and not _engine._state.compile_native


# --- the environment at import, and who patched ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("TORCHMETRICS_GRADPATCH_MODE", "foo", "use one of: local, global"),
        ("TORCHMETRICS_GRADPATCH_AUTOPATCH", "maybe", "0, false, no, off (import without patching) / 1, true, yes, on"),
    ],
)
def test_a_bad_environment_variable_is_a_value_error_naming_it_and_its_values(
    variable: str, value: str, allowed: str
) -> None:
    proc = run_python("import torchmetrics_gradpatch", env={variable: value})
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: {variable}={value!r} is not") and allowed in last, proc.stderr


def test_status_credits_the_import_not_patch() -> None:
    out = ok(
        """
import torchmetrics, torchmetrics_gradpatch as tg
s = tg.status()
print(s.switched_on_by, s.mode_chosen_by, "|", str(s).splitlines()[2])
tg.unpatch(); tg.patch()
s = tg.status()
print(s.switched_on_by, s.mode_chosen_by, "|", str(s).splitlines()[2])
"""
    )
    first, second = out.strip().splitlines()
    if NATIVE:
        assert first.startswith("import import | in force:         nothing is needed in local mode"), first
        assert "switched on: the import patched" in first, first
    else:
        assert first == "import import | in force:         yes: the import patched", first
    assert second.split("|")[0].split() == ["patch()", "patch()"] and "patch() is on" in second, second


def test_status_on_native_torchmetrics_says_nothing_is_needed_in_local_mode(
    pretend_native: Callable[[], AbstractContextManager[bool]],
) -> None:
    """torchmetrics >= 1.6 (faked where it is not): in local mode the status says nothing is needed."""
    tg.patch("local")
    with pretend_native():
        text = str(tg.status())
        assert "in force:         nothing is needed in local mode" in text and "yes: patch() is on" not in text


# --- the suite's reset between pooled tests (tests/_patch_state.py) ---------------------------------------------------


def test_reset_patch_state_puts_back_what_a_fresh_import_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests._patch_state import reset_patch_state

    tg.patch("global")
    tg.patched(MODE).__enter__()  # left open, as a careless test would
    tg.compile_support(True)
    assert reset_patch_state() == "the test left a torchmetrics_gradpatch.patched() block open"
    s = tg.status()
    assert (s.open_blocks, s.switched_on_by, s.mode, s.mode_chosen_by) == (0, "import", "local", "import"), s
    assert not _engine._state.compile_native
    assert reset_patch_state() is None
    monkeypatch.setenv("TORCHMETRICS_GRADPATCH_AUTOPATCH", "0")
    monkeypatch.setenv("TORCHMETRICS_GRADPATCH_MODE", "global")
    assert reset_patch_state() is None
    s = tg.status()
    monkeypatch.undo()
    assert reset_patch_state() is None  # this process's own environment again: the default mode back to local
    assert (s.in_force, s.default_mode, s.state) == (False, "global", "off"), s
    assert tg.status().default_mode == "local"
