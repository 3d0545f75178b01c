"""``status()`` says what is true of its process: the import line, why each replaced place is replaced, the sync
check's line, and the JSON fields docs/api.md lists. Each case is an import, so each runs in a fresh interpreter."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tests._subprocess import ROOT, ok
from torchmetrics_gradpatch import Status, _version

NATIVE = _version.is_native(_version.parse(_version.installed_version("torchmetrics") or "0", "torchmetrics"))


def test_the_api_page_lists_every_json_field() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    table = page[page.index("### JSON fields") :]
    listed = re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE)
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(Status)), listed
    assert len(listed) == len(set(listed)), listed


IMPORT_LINE = """
import json, os
import torchmetrics_gradpatch as tg
os.environ["TORCHMETRICS_GRADPATCH_AUTOPATCH"] = "maybe"  # read at import only: a later change says nothing
status = tg.status()
lines = dict(line.split(":", 1) for line in str(status).splitlines() if not line.startswith(" "))
print(json.dumps({"at": lines["at import"].strip(), "in": lines["in force"].strip(), "json": status.as_dict()}))
"""


@pytest.mark.parametrize(
    ("value", "at_import", "in_force"),
    [
        (None, "switched the patch on (the default)", "yes: the import patched"),
        ("1", "switched the patch on (TORCHMETRICS_GRADPATCH_AUTOPATCH=1)", "yes: the import patched"),
        (
            " Off ",
            "left the patch off (TORCHMETRICS_GRADPATCH_AUTOPATCH= Off )",
            "no: TORCHMETRICS_GRADPATCH_AUTOPATCH= Off  kept the import from patching, and patch() has not switched "
            "it on since",
        ),
    ],
)
def test_the_import_line_names_the_variable_only_when_it_is_set(
    value: str | None, at_import: str, in_force: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value is None:
        monkeypatch.delenv("TORCHMETRICS_GRADPATCH_AUTOPATCH", raising=False)
    else:
        monkeypatch.setenv("TORCHMETRICS_GRADPATCH_AUTOPATCH", value)
    if NATIVE and in_force.startswith("yes: "):  # in force, with nothing to install in local mode
        in_force = "nothing is needed in local mode (torchmetrics >= 1.6 keeps the graph itself); switched on: " + (
            in_force.removeprefix("yes: ")
        )
    seen = json.loads(ok(IMPORT_LINE).splitlines()[-1])
    assert seen["at"] == at_import, seen
    assert "TORCHMETRICS_GRADPATCH_AUTOPATCH" not in seen["at"] + seen["in"] or value is not None, seen
    assert seen["in"] == in_force, seen
    assert seen["json"]["autopatch_variable"] == value and seen["json"]["autopatch"] is (value != " Off "), seen


def test_unpatch_says_what_it_switched_off() -> None:
    out = ok(
        """
import torchmetrics_gradpatch as tg
tg.unpatch()
print(str(tg.status()).splitlines()[2])
tg.patch(); tg.unpatch()
print(str(tg.status()).splitlines()[2])
print(tg.status().switched_off_from)
"""
    )
    assert out.splitlines() == [
        "in force:         no: unpatch() has switched off the patch the import switched on",
        "in force:         no: unpatch() has switched off the patch patch() switched on",
        "patch()",
    ], out


def test_a_replaced_sync_dist_says_why() -> None:
    """The trampoline brings ``Metric._sync_dist`` along (a graph break under torch.compile); the fused sync replaces
    it to run. Each ``applied to`` line says which."""
    out = ok(
        f"""
import json
import torchmetrics, torchmetrics_gradpatch as tg
tg.patch(sync="torchmetrics")  # whatever TORCHMETRICS_GRADPATCH_SYNC says
if {NATIVE}:
    tg.compile_support()  # native torchmetrics: local mode installs the trampoline only with compile support
with_gather = tg.status()
tg.patch(sync="fused")
fused = tg.status()
print(json.dumps([with_gather.sync_applied_to, str(with_gather), fused.sync_applied_to, str(fused)]))
"""
    )
    with_gather, with_gather_text, fused, fused_text = json.loads(out.splitlines()[-1])
    assert with_gather == [
        "torchmetrics.Metric._sync_dist (runs the 'torchmetrics' sync: torchmetrics' own method, replaced along with "
        "the gather so that under torch.compile the whole sync runs eagerly behind one graph break)"
    ], with_gather
    assert f"applied to:       {with_gather[0]}" in with_gather_text.splitlines(), with_gather_text
    assert fused[0] == (
        "torchmetrics.Metric._sync_dist (runs the 'fused' sync: replaced because that sync strategy is chosen; one "
        "graph break under torch.compile)"
    ), fused
    assert all(f"applied to:       {where}" in fused_text.splitlines() for where in fused), fused_text


CHECK_LINE = """
import json
import torchmetrics_gradpatch as tg
status = tg.status()
lines = dict(line.split(":", 1) for line in str(status).splitlines() if not line.startswith(" "))
print(json.dumps({"line": lines["sync check"].strip(), "json": status.as_dict()}))
"""
CHECKED = "each fused sync also runs torchmetrics' own sync on the same states and compares bit for bit"


@pytest.mark.parametrize(
    ("env", "line", "fields"),
    [
        ({}, "off", (False, "import", False)),
        ({"CHECK": "1", "SYNC": "fused"}, f"on: {CHECKED}", (True, "import", True)),
        (
            {"CHECK": "true"},
            "on, idle: only the fused sync is checked, and torchmetrics' own sync runs",
            (True, "import", True),
        ),
        (
            {"CHECK": "yes", "AUTOPATCH": "0"},
            "off; patch() without check= uses on (from TORCHMETRICS_GRADPATCH_CHECK)",
            (False, "", True),
        ),
    ],
    ids=["unset", "on-fused", "on-torchmetrics-sync", "on-not-in-force"],
)
def test_the_sync_check_line_says_what_a_sync_does_now(
    env: dict[str, str], line: str, fields: tuple[bool, str, bool]
) -> None:
    """The line says what a sync called now does: under torchmetrics' own sync a check that is on is idle, and while
    nothing is in force the line names the variable that turned the default on."""
    full = {f"TORCHMETRICS_GRADPATCH_{name}": "" for name in ("CHECK", "SYNC", "AUTOPATCH")}  # blank: unset
    full.update({f"TORCHMETRICS_GRADPATCH_{name}": value for name, value in env.items()})
    seen = json.loads(ok(CHECK_LINE, env=full).splitlines()[-1])
    assert seen["line"] == line, seen
    data = seen["json"]
    assert (data["check"], data["check_chosen_by"], data["default_check"]) == fields, data
