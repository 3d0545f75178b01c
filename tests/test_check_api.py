"""The sync check's switch through the public API: ``patch(check=)``, ``patched(check=)``,
``TORCHMETRICS_GRADPATCH_CHECK``, ``_engine.effective_check()`` and ``status()``.

In this process, with no process group: the switch and its reporting only (the comparison itself is the fused
sync's). The import's reading of the variable runs in a fresh interpreter. The check follows the sync strategy's
layering rule, so several cases drive both through the same calls and require the same choices.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import torchmetrics_gradpatch as tg
from tests._patch_state import reset_patch_state
from tests._subprocess import ok, run_python
from torchmetrics_gradpatch import _api, _engine

pytestmark = pytest.mark.python

NATIVE = tg.status().native
MODE = "global" if NATIVE else "local"  # the mode that installs the trampoline on this torchmetrics


def seen() -> tuple[bool, str]:
    """The check a fused sync called now uses, and what chose it; the engine's answer and status() agree."""
    status = tg.status()
    assert _engine.effective_check() is status.check, (_engine.effective_check(), status)
    return status.check, status.check_chosen_by


def default_check() -> bool:
    return _engine.snapshot().default_check


@pytest.fixture
def restored() -> Iterator[None]:
    """After the test (and after ``monkeypatch`` has put the environment back): the state a fresh import leaves."""
    yield
    reset_patch_state()


@pytest.fixture
def nothing_set(restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state a fresh import leaves with neither ``TORCHMETRICS_GRADPATCH_CHECK`` nor ``..._SYNC`` set."""
    monkeypatch.delenv(_api.CHECK_ENV, raising=False)
    monkeypatch.delenv(_api.SYNC_ENV, raising=False)
    reset_patch_state()


# --- in force or not ------------------------------------------------------------------------------------------------


def test_effective_check_is_false_while_the_patch_is_not_in_force(restore_patch_state: None) -> None:
    tg.unpatch()
    assert seen() == (False, "")
    tg.patch(check=True)
    assert seen() == (True, "patch()")
    tg.unpatch()  # patch()'s check is kept for nothing: the switch is off
    assert seen() == (False, "") and not tg.is_patched()
    with tg.patched(check=True):  # a block alone puts the patch, and its check, in force
        assert seen() == (True, "patched(check=...)")
    assert seen() == (False, "")
    previous = default_check()
    _engine.set_defaults(check=True)
    try:
        assert seen() == (False, ""), "a default that is on does not check while nothing is in force"
        with tg.patched():
            assert seen() == (True, "default")
        assert tg.status().default_check is True
    finally:
        _engine.set_defaults(check=previous)
    assert seen() == (False, "")


# --- the layering rule ----------------------------------------------------------------------------------------------


def test_blocks_layer_over_patch_and_inner_over_outer(restore_patch_state: None) -> None:
    tg.patch(check=True)
    assert seen() == (True, "patch()")
    with tg.patched(check=False):
        assert seen() == (False, "patched(check=...)")
        with tg.patched(check=True), tg.patched(mode=MODE):  # a newer block naming no check leaves it alone
            assert seen() == (True, "patched(check=...)")
        assert seen() == (False, "patched(check=...)")
        tg.patch(check=True)  # inside a block patch() changes only the switch
        assert seen() == (False, "patched(check=...)")
    assert seen() == (True, "patch()")
    tg.patch()  # no check named: the default
    assert seen() == (default_check(), "patch()")


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=lambda o: "-".join(map(str, o)))
def test_blocks_closing_in_any_order_leave_the_newest_open_choice(
    restore_patch_state: None, order: tuple[int, ...]
) -> None:
    """Three blocks entered by hand, oldest first: ``check=True``, none named, ``check=False``; closed in ``order``.
    After each exit the newest open block that names a check chooses it, else the default (the switch is off)."""
    tg.unpatch()
    checks = [True, None, False]
    blocks = [tg.patched(check=check) for check in checks]
    for block in blocks:
        block.__enter__()
    assert seen() == (False, "patched(check=...)")
    still_open = [0, 1, 2]
    for index in order:
        blocks[index].__exit__(None, None, None)
        still_open.remove(index)
        named = [checks[i] for i in still_open if checks[i] is not None]
        if named:
            expected = (named[-1], "patched(check=...)")
        else:
            expected = (default_check(), "default") if still_open else (False, "")
        assert seen() == expected, (order, still_open)
    assert not tg.is_patched()


def test_a_decorated_function_runs_with_its_check(restore_patch_state: None) -> None:
    @tg.patched(check=True)
    def inside() -> tuple[bool, str]:
        return seen()

    @tg.patched(check=True)
    async def inside_async() -> tuple[bool, str]:
        return seen()

    tg.unpatch()
    assert inside() == (True, "patched(check=...)")
    assert asyncio.run(inside_async()) == (True, "patched(check=...)")
    assert seen() == (False, "")


# Each step, once with the sync strategy and once with the check: "on" is sync="fused" / check=True, "off" is
# sync="torchmetrics" / check=False, None names neither.
STEPS: list[tuple[str, str | None]] = [
    ("patch", "on"),
    ("patch", None),  # patch() without one: back to the default
    ("patch", "on"),
    ("patch", "on"),  # idempotent
    ("enter", "off"),
    ("enter", None),
    ("patch", None),  # inside blocks: only patch()'s own choice changes, the blocks still choose
    ("exit", None),
    ("exit", None),
    ("patch", "on"),
    ("unpatch", None),
    ("enter", "on"),
    ("exit", None),
    ("patch", "off"),
    ("enter", "on"),
    ("unpatch", None),
    ("exit", None),
]


def run_steps(name: str) -> list[tuple[bool, str]]:
    """Run :data:`STEPS` naming ``name`` ("sync" or "check") only; after each, whether it is on and what chose it,
    spelled as the check's ``check_chosen_by``."""
    values: dict[str, Any] = {"on": "fused", "off": "torchmetrics"} if name == "sync" else {"on": True, "off": False}
    open_blocks: list[Any] = []
    seen_after: list[tuple[bool, str]] = []
    tg.unpatch()
    for action, value in STEPS:
        named = {} if value is None else {name: values[value]}
        if action == "patch":
            tg.patch(**named)
        elif action == "unpatch":
            tg.unpatch()
        elif action == "enter":
            open_blocks.append(tg.patched(**named))
            open_blocks[-1].__enter__()
        else:
            open_blocks.pop().__exit__(None, None, None)
        status = tg.status()
        if name == "sync":
            seen_after.append((status.sync == "fused", status.sync_chosen_by.replace("sync=", "check=")))
        else:
            seen_after.append((status.check, status.check_chosen_by))
    assert not open_blocks
    return seen_after


def test_patch_and_blocks_choose_the_check_exactly_as_they_choose_the_sync(nothing_set: None) -> None:
    """Both defaults are off here, so the check and the sync take the same choices at every step."""
    assert (tg.status().default_sync, tg.status().default_check) == ("torchmetrics", False)
    by_sync = run_steps("sync")
    by_check = run_steps("check")
    assert by_check == by_sync
    # the steps reach every chooser, and the expected choices (a mistake common to both would pass the line above)
    assert by_check == [
        (True, "patch()"),
        (False, "patch()"),
        (True, "patch()"),
        (True, "patch()"),
        (False, "patched(check=...)"),
        (False, "patched(check=...)"),
        (False, "patched(check=...)"),
        (False, "patched(check=...)"),
        (False, "patch()"),
        (True, "patch()"),
        (False, ""),
        (True, "patched(check=...)"),
        (False, ""),
        (False, "patch()"),
        (True, "patched(check=...)"),
        (True, "patched(check=...)"),
        (False, ""),
    ]


# --- bad values -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, 0, "True", 1.0, [True]])
def test_a_check_that_is_not_a_bool_or_none_is_a_type_error_naming_it(restore_patch_state: None, value: Any) -> None:
    tg.patch(mode=MODE, check=True)
    before = seen(), tg.status().mode
    message = "torchmetrics_gradpatch: {}(check={!r}): check must be True, False or None."
    with pytest.raises(TypeError, match=f"^{re.escape(message.format('patch', value))}$"):
        tg.patch(mode="global" if MODE == "local" else "local", check=value)
    with pytest.raises(TypeError, match=f"^{re.escape(message.format('patched', value))}$"):
        tg.patched(check=value)
    with pytest.raises(TypeError, match=r"patched\(check="):

        @tg.patched(check=value)
        def decorated() -> None:
            pass

    assert (seen(), tg.status().mode) == before, "a refused call changed nothing"
    assert tg.status().open_blocks == 0


# --- the environment variable ---------------------------------------------------------------------------------------


def test_the_variable_takes_the_autopatch_flag_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("1", "true", "YES", " On ", "True"):
        monkeypatch.setenv(_api.CHECK_ENV, raw)
        assert _api.check_requested() is True, raw
    for raw in ("0", "false", "No", " OFF ", "", "  "):
        monkeypatch.setenv(_api.CHECK_ENV, raw)
        assert _api.check_requested() is False, raw
    monkeypatch.delenv(_api.CHECK_ENV)
    assert _api.check_requested() is False
    monkeypatch.setenv(_api.CHECK_ENV, "maybe")
    with pytest.raises(
        ValueError, match=r"^TORCHMETRICS_GRADPATCH_CHECK='maybe' is not a flag; use one of: 0, false, "
    ):
        _api.check_requested()


def test_the_variable_sets_the_default_check(restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_api.CHECK_ENV, "on")
    monkeypatch.setenv(_api.SYNC_ENV, "fused")
    reset_patch_state()  # what a fresh import does with the environment
    status = tg.status()
    assert (status.check, status.check_chosen_by, status.default_check) == (True, "import", True)
    assert _engine.effective_check() is True
    tg.patch(check=False)
    assert seen() == (False, "patch()") and tg.status().default_check is True
    tg.patch()
    assert seen() == (True, "patch()")


# --- status() -------------------------------------------------------------------------------------------------------


def check_line(status: tg.Status) -> str:
    lines = [line for line in str(status).splitlines() if line.startswith("sync check:")]
    assert len(lines) == 1, str(status)
    return lines[0]


def test_status_reports_the_check_in_fields_json_and_text(nothing_set: None) -> None:
    tg.unpatch()
    off = tg.status()
    assert (off.check, off.check_chosen_by, off.default_check) == (False, "", False)
    assert check_line(off) == "sync check:       off"
    data = off.as_dict()
    assert (data["check"], data["check_chosen_by"], data["default_check"]) == (False, "", False)
    assert '"check": false' in off.to_json() and '"default_check": false' in off.to_json()

    tg.patch(sync="fused", check=True)
    on = tg.status()
    assert (on.check, on.check_chosen_by, on.as_dict()["check"]) == (True, "patch()", True)
    assert '"check_chosen_by": "patch()"' in on.to_json()
    assert check_line(on) == (
        "sync check:       on: each fused sync also runs torchmetrics' own sync on the same states and compares bit "
        "for bit"
    )
    with tg.patched(check=True):
        assert check_line(tg.status()) == (
            "sync check:       on (chosen by an open patched(check=...) block): each fused sync also runs "
            "torchmetrics' own sync on the same states and compares bit for bit"
        )
    # on, but nothing to compare: torchmetrics' own sync runs
    with tg.patched(sync="torchmetrics"):
        assert check_line(tg.status()) == (
            "sync check:       on, idle: only the fused sync is checked, and torchmetrics' own sync runs"
        )
    with tg.patched(check=False):
        assert check_line(tg.status()) == "sync check:       off"
    # the line sits after the sync's
    lines = str(on).splitlines()
    assert lines[lines.index(check_line(on)) - 1].startswith("sync:             fused"), lines


def test_status_text_names_the_variable_when_it_made_the_default(
    restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_api.CHECK_ENV, "1")
    reset_patch_state()
    tg.patch(check=False)
    assert check_line(tg.status()) == (
        "sync check:       off; patch() without check= uses on (from TORCHMETRICS_GRADPATCH_CHECK)"
    )
    tg.unpatch()
    assert check_line(tg.status()).startswith("sync check:       off; patch() without check= uses on"), tg.status()


# --- the import, in a fresh interpreter -----------------------------------------------------------------------------

READ_AT_IMPORT = """
import os, sys
import torchmetrics_gradpatch as tg
from torchmetrics_gradpatch import _engine
assert "torch" not in sys.modules and "torchmetrics" not in sys.modules, sorted(sys.modules)
os.environ["TORCHMETRICS_GRADPATCH_CHECK"] = "0"  # read at import only: a later change says nothing
s = tg.status()
print(s.check, repr(s.check_chosen_by), s.default_check, _engine.effective_check())
tg.patch()
print(tg.status().check, repr(tg.status().check_chosen_by), _engine.effective_check())
"""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TORCHMETRICS_GRADPATCH_CHECK": "Yes"}, ["True 'import' True True", "True 'patch()' True"]),
        ({"TORCHMETRICS_GRADPATCH_CHECK": " "}, ["False 'import' False False", "False 'patch()' False"]),
        (
            {"TORCHMETRICS_GRADPATCH_CHECK": "on", "TORCHMETRICS_GRADPATCH_AUTOPATCH": "0"},
            ["False '' True False", "True 'patch()' True"],
        ),
    ],
    ids=["on", "blank", "on-without-autopatch"],
)
def test_the_import_reads_the_variable(env: dict[str, str], expected: list[str]) -> None:
    assert ok(READ_AT_IMPORT, env=env).splitlines() == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param(
            {_api.CHECK_ENV: "maybe"},
            "ValueError: TORCHMETRICS_GRADPATCH_CHECK='maybe' is not a flag; use one of: 0, false, no, off (do not "
            "check, the default) / 1, true, yes, on (check the fused sync), in any case (unset means 0). See "
            "docs/fused-sync.md.",
            id="a bad value",
        ),
        pytest.param(
            {_api.CHECK_ENV: "on", _api.SYNC_ENV: "torchmetrics"},
            "ValueError: TORCHMETRICS_GRADPATCH_CHECK='on' checks the fused sync, but "
            "TORCHMETRICS_GRADPATCH_SYNC='torchmetrics' chooses torchmetrics' own sync, so nothing would be checked. "
            "Set TORCHMETRICS_GRADPATCH_SYNC=fused, or unset TORCHMETRICS_GRADPATCH_CHECK. See docs/fused-sync.md.",
            id="beside torchmetrics' own sync",
        ),
    ],
)
def test_variables_the_import_refuses_are_named(env: dict[str, str], message: str) -> None:
    proc = run_python("import torchmetrics_gradpatch", env=env, timeout=120)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines()[-1] == message, proc.stderr


# --- the check beside torchmetrics' own sync --------------------------------------------------------------------------


def test_check_beside_torchmetrics_own_sync_in_one_call_is_refused(nothing_set: None) -> None:
    """One call that chooses both is refused and changes nothing; chosen in different places, the check is idle and
    status() says so."""
    tg.patch(sync="fused")
    calls: dict[str, Callable[[], object]] = {
        "patch": lambda: tg.patch(sync="torchmetrics", check=True),
        "patched": lambda: tg.patched(sync="TorchMetrics", check=True),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as raised:
            call()
        assert str(raised.value) == (
            f"torchmetrics_gradpatch: {name}(sync='torchmetrics', check=True): the check mode compares the fused "
            "sync with torchmetrics' own, and torchmetrics' own sync was chosen, so nothing would be checked. Choose "
            "sync='fused' with check=True, or leave check out."
        )
    assert (tg.status().sync, tg.status().check, tg.status().open_blocks) == ("fused", False, 0)
    with tg.patched(check=True), tg.patched(sync="torchmetrics"):
        assert "idle: only the fused sync is checked" in check_line(tg.status())
