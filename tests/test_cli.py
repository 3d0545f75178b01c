"""The command line: ``python -m torchmetrics_gradpatch`` and the ``torchmetrics-gradpatch`` console script.

Every run of the CLI happens in a fresh interpreter, exactly as a user types it. Nothing here imports the package at
module level, so this file also runs on torch below 2.0, where the refusal tests use the real installed torch and
the rest is skipped; on a supported torch the refusal is exercised with a fake ``torch`` distribution (metadata
only) placed first on ``PYTHONPATH``, which is what the version gate reads.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from tests._subprocess import cli, console_script, fake_torchmetrics, show

pytestmark = pytest.mark.python

TORCH = Version(importlib.metadata.version("torch"))
TORCHMETRICS = Version(importlib.metadata.version("torchmetrics"))
BELOW_MINIMUM = Version(TORCH.base_version) < Version("2.0")
NATIVE = Version("1.6.0") <= TORCHMETRICS

needs_supported_torch = pytest.mark.skipif(BELOW_MINIMUM, reason=f"torch {TORCH} is below 2.0: the CLI refuses")


# --- the refusal on torch < 2.0 --------------------------------------------------------------------------------------


@pytest.fixture
def old_torch(tmp_path: Path) -> list[str]:
    """``PYTHONPATH`` entries that make the installed torch look like 1.13.1 to the version gate.

    On a real torch below 2.0 nothing needs faking. Otherwise a ``torch-1.13.1.dist-info`` holding only metadata is
    put first on the path: ``importlib.metadata`` finds it before the real distribution, the gate reads "1.13.1"
    and refuses before anything imports torch.
    """
    if BELOW_MINIMUM:
        return []
    dist_info = tmp_path / "fake-torch" / "torch-1.13.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 1.13.1\n")
    return [str(dist_info.parent)]


def old_version() -> str:
    return str(TORCH) if BELOW_MINIMUM else "1.13.1"


def assert_clean_refusal(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 3, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    assert proc.stdout == "", show(proc)
    first = proc.stderr.splitlines()[0]
    assert first == (
        f"torchmetrics-gradpatch: cannot run with torch {old_version()} and torchmetrics {TORCHMETRICS}."
    ), show(proc)
    assert "torch >= 2.0" in proc.stderr, show(proc)


@pytest.mark.parametrize(
    "how",
    [
        ["-m", "torchmetrics_gradpatch", "check"],
        ["-m", "torchmetrics_gradpatch", "status", "--json"],
        ["-m", "torchmetrics_gradpatch.__main__", "check", "--world-size", "2"],
        ["-X", "dev", "-W", "default", "-m", "torchmetrics_gradpatch", "check"],
        ["-Im", "torchmetrics_gradpatch", "check"],  # -I drops PYTHONPATH: only meaningful when installed
    ],
    ids=["m-check", "m-status", "m-__main__", "m-with-options", "m-combined-flags"],
)
def test_python_m_refuses_old_torch_with_one_message(old_torch: list[str], how: list[str]) -> None:
    if "-Im" in how and not BELOW_MINIMUM:
        pytest.skip("-I ignores PYTHONPATH, so the faked torch version cannot be seen")
    if "-Im" in how and importlib.util.find_spec("torchmetrics_gradpatch") is None:
        pytest.skip("the package is not installed, and -I ignores PYTHONPATH")
    assert_clean_refusal(cli(pythonpath=old_torch, command=[sys.executable, *how]))


def test_console_script_refuses_old_torch_with_one_message(old_torch: list[str], tmp_path: Path) -> None:
    assert_clean_refusal(cli("check", pythonpath=old_torch, command=console_script(tmp_path)))


IMPORT_STILL_RAISES = """
import sys
for attempt in (1, 2):
    try:
        import torchmetrics_gradpatch
    except ImportError as err:
        assert type(err).__name__ == "UnsupportedVersionError", repr(err)
        assert not [n for n in sys.modules if n.split(".")[0] == "torchmetrics_gradpatch"], sorted(sys.modules)
    else:
        raise AssertionError("the import did not refuse")
print("refused twice, nothing left in sys.modules")
"""


def test_plain_import_still_raises_on_old_torch(old_torch: list[str]) -> None:
    """Only the CLI turns the refusal into a message; a program's import raises, every time, and leaves nothing."""
    proc = cli(pythonpath=old_torch, command=[sys.executable, "-c", IMPORT_STILL_RAISES])
    assert proc.returncode == 0, show(proc)


def test_another_programs_python_m_still_gets_the_exception(old_torch: list[str], tmp_path: Path) -> None:
    """``python -m someone_elses_tool`` whose package imports ours: the exception, not our CLI's exit."""
    package = tmp_path / "pkgs" / "someone_elses_tool"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import torchmetrics_gradpatch\n")
    (package / "__main__.py").write_text("print('ran')\n")
    proc = cli(pythonpath=[*old_torch, str(package.parent)], command=[sys.executable, "-m", "someone_elses_tool"])
    assert proc.returncode == 1, show(proc)
    assert "Traceback" in proc.stderr and "UnsupportedVersionError" in proc.stderr, show(proc)


# --- recognising how the process was started (unit) ------------------------------------------------------------------


@needs_supported_torch
@pytest.mark.parametrize(
    ("argv", "orig_argv", "expected"),
    [
        (["-m", "check"], ["python", "-m", "torchmetrics_gradpatch", "check"], True),
        (["-m"], ["python", "-mtorchmetrics_gradpatch"], True),
        (["-m", "status"], ["python", "-Im", "torchmetrics_gradpatch.__main__", "status"], True),
        (
            ["-m", "check"],
            ["python", "-X", "dev", "-Wdefault", "-W", "error", "-m", "torchmetrics_gradpatch", "check"],
            True,
        ),
        (["-m"], ["python", "--check-hash-based-pycs", "always", "-m", "torchmetrics_gradpatch"], True),
        (["-m"], ["python", "-W", "torchmetrics_gradpatch", "-m", "pytest"], False),
        (["-m", "torchmetrics_gradpatch"], ["python", "-m", "pytest", "torchmetrics_gradpatch"], False),
        (["-m"], ["python", "-m", "pytest"], False),
        (["/venv/bin/torchmetrics-gradpatch"], ["python", "/venv/bin/torchmetrics-gradpatch"], True),
        (["C:\\venv\\Scripts\\torchmetrics-gradpatch.exe"], [], os.sep == "\\"),
        (["/venv/bin/pytest"], ["python", "/venv/bin/pytest"], False),
        (["train.py"], ["python", "train.py"], False),
    ],
)
def test_launched_as_cli(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], orig_argv: list[str], expected: bool
) -> None:
    """While runpy imports the package, ``sys.argv`` is ``["-m", *arguments]``: the word before them names it."""
    from torchmetrics_gradpatch.cli import exit as cli_exit

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert cli_exit.launched_as_cli() is expected


# --- --version and --help answer without torch -------------------------------------------------------------------

_WITHOUT_TORCH = """
import runpy, sys
sys.argv = ["torchmetrics_gradpatch", *{args!r}]
try:
    runpy.run_module("torchmetrics_gradpatch", run_name="__main__", alter_sys=True)
except SystemExit as done:
    code = done.code
heavy = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "torchmetrics"))
print("EXIT", code, "HEAVY", heavy)
"""


@needs_supported_torch
@pytest.mark.parametrize("args", [["--version"], ["--help"], ["check", "--help"]])
def test_version_and_help_import_neither_torch_nor_torchmetrics(args: list[str]) -> None:
    """They run ``python -m torchmetrics_gradpatch`` as runpy does, then list what got imported."""
    proc = cli(command=[sys.executable, "-c", _WITHOUT_TORCH.format(args=args)])
    assert proc.returncode == 0, show(proc)
    assert proc.stdout.strip().endswith("EXIT 0 HEAVY []"), show(proc)
    if args == ["--version"]:
        assert proc.stdout.startswith(f"torchmetrics-gradpatch {importlib.metadata.version('torchmetrics_gradpatch')}")
    else:
        assert proc.stdout.startswith("usage: torchmetrics-gradpatch"), show(proc)


@needs_supported_torch
def test_version_through_python_m() -> None:
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("torchmetrics-gradpatch "), show(proc)


# --- status -------------------------------------------------------------------------------------------------------


@needs_supported_torch
def test_status_prints_versions_and_mode() -> None:
    proc = cli("status")
    assert proc.returncode == 0, show(proc)
    assert f"torchmetrics:     {TORCHMETRICS}" in proc.stdout, show(proc)
    assert ("native" if NATIVE else "gather:           patched") in proc.stdout, show(proc)
    # why it is in force (tests/test_cli_contract.py); on native torchmetrics, that local mode needs nothing
    in_force = "in force:         nothing is needed in local mode" if NATIVE else "in force:         yes: "
    assert in_force in proc.stdout, show(proc)


@needs_supported_torch
def test_status_json_without_autopatch() -> None:
    proc = cli("status", "--json", env={"TORCHMETRICS_GRADPATCH_AUTOPATCH": "0", "TORCHMETRICS_GRADPATCH_CHECK": "on"})
    assert proc.returncode == 0, show(proc)
    data = json.loads(proc.stdout)
    assert data["torchmetrics_version"] == str(TORCHMETRICS)
    assert data["autopatch"] is False and data["in_force"] is False
    assert data["graph_preserving"] is NATIVE
    # the variable sets the default; nothing in force checks
    assert (data["check"], data["check_chosen_by"], data["default_check"]) == (False, "", True), data


@needs_supported_torch
def test_status_shows_the_sync_check() -> None:
    env = {"TORCHMETRICS_GRADPATCH_CHECK": "1", "TORCHMETRICS_GRADPATCH_SYNC": "fused"}
    text = cli("status", env=env)
    assert text.returncode == 0, show(text)
    line = "sync check:       on: each fused sync also runs torchmetrics' own sync on the same states and compares"
    assert line in text.stdout, show(text)
    data = json.loads(cli("status", "--json", env=env).stdout)
    assert (data["check"], data["check_chosen_by"], data["default_check"]) == (True, "import", True), data


@needs_supported_torch
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from torchmetrics_gradpatch.cli import main

    for argv in ([], ["check", "--world-size", "0"], ["check", "--timeout", "-1"], ["frobnicate"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
    assert "at least 1" in capsys.readouterr().err


# --- check (spawns real gloo ranks) ----------------------------------------------------------------------------------

CHECK_TITLES = [
    "gather, equal shapes",
    "gather, uneven shapes",
    "Metric loss, sum state (MeanSquaredError)",
    "Metric loss, cat state, uneven batches",
]


def result_of(stdout: str, title: str) -> str:
    for line in stdout.splitlines():
        if line.strip().startswith(title):
            return line[len(line) - len(line.lstrip()) + len(title) :].split()[0]
    raise AssertionError(f"no row {title!r} in\n{stdout}")


@needs_supported_torch
@pytest.mark.parametrize(("mode", "sync"), [(None, None), ("global", "fused")], ids=["console-script", "m-global"])
def test_check_passes_on_this_install(mode: str | None, sync: str | None) -> None:
    """The defaults through the installed ``torchmetrics-gradpatch`` console script on 3 ranks; global mode and the
    fused sync through ``python -m torchmetrics_gradpatch check`` on 2."""
    ranks = 2 if mode else 3
    if mode:
        proc = cli("check", "--mode", mode, *(["--sync", sync] if sync else []))
    elif script := shutil.which("torchmetrics-gradpatch", path=str(Path(sys.executable).parent)):
        proc = cli("check", "--world-size", "3", "--timeout", "120", command=[script])
    else:
        pytest.skip("the package is not installed in this interpreter's environment (tox installs it)")
    assert proc.returncode == 0, show(proc)
    assert f"{ranks} ranks" in proc.stdout, show(proc)
    assert f"torch         {TORCH}" in proc.stdout and f"torchmetrics  {TORCHMETRICS}" in proc.stdout, show(proc)
    assert ("native" if NATIVE and not mode else "patched") in proc.stdout, show(proc)
    assert f"gradient mode {mode or 'local'} (" in proc.stdout, show(proc)
    assert f"sync          {sync or 'torchmetrics'} (" in proc.stdout, show(proc)
    assert [result_of(proc.stdout, title) for title in CHECK_TITLES] == ["pass"] * 4, show(proc)
    assert "all 4 checks passed" in proc.stdout, show(proc)
    assert f"starting {ranks} gloo ranks" in proc.stderr and "ranks finished in" in proc.stderr, show(proc)
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, show(proc)


@needs_supported_torch
@pytest.mark.skipif(NATIVE, reason=f"torchmetrics {TORCHMETRICS} keeps the graph natively: nothing to show")
def test_check_without_the_patch_shows_the_failures() -> None:
    """On an old torchmetrics, the same checks without the patch fail: this is what the package fixes."""
    proc = cli("check", env={"TORCHMETRICS_GRADPATCH_AUTOPATCH": "0"})
    assert proc.returncode == 1, show(proc)
    assert "NOT patched" in proc.stdout, show(proc)
    assert [result_of(proc.stdout, title) for title in CHECK_TITLES] == ["FAIL"] * 4, show(proc)
    assert "does not require grad" in proc.stdout, show(proc)
    assert "Warning" not in proc.stderr, show(proc)


@needs_supported_torch
@pytest.mark.parametrize("command", ["status", "check"])
@pytest.mark.parametrize(
    ("version", "mode"), [("1.5.9", None), ("1.10.0", "global")], ids=["old-torchmetrics", "native-global-mode"]
)
def test_unrecognised_torchmetrics_refused_with_one_message(
    tmp_path: Path, command: str, version: str, mode: str | None
) -> None:
    """torchmetrics is imported after the package; where its gather is not recognised: one message, exit 3."""
    fake = fake_torchmetrics(tmp_path / "fake", version)
    proc = cli(command, pythonpath=[fake], env={"TORCHMETRICS_GRADPATCH_MODE": mode} if mode else None)
    assert proc.returncode == 3, show(proc)
    assert "Traceback" not in proc.stderr and proc.stdout == "", show(proc)
    first = proc.stderr.splitlines()[0]
    # The CLI names torch's __version__ once torch is imported (2.0.1+cu117 from PyPI), else its metadata's (2.0.1).
    # This fake torchmetrics imports no torch, and the package imports none either, so: the metadata's.
    expected = (
        f"torchmetrics-gradpatch: cannot run with torch {importlib.metadata.version('torch')} and torchmetrics "
        f"{version}."
    )
    assert first == expected, show(proc)
    assert "unrecognised signature gather_all_tensors(result, group=None, *, async_op=False)" in proc.stderr
    assert "starting" not in proc.stderr, show(proc)  # refused before any rank was spawned


def analytic_gradient(name: str, rank: int, world_size: int) -> list[Any]:
    """The local-mode gradient of a check, written out by hand (the reference computes it with autograd)."""
    import torch

    from torchmetrics_gradpatch.cli import checks as _checks

    with torch.no_grad():
        if name.startswith("gather"):
            # loss = sum_i (i + 1) * |e_i|^2 + (sum of every element)^2
            entries = [_checks._inputs(name, q)[0] for q in range(world_size)]
            total = sum(float(e.sum()) for e in entries)
            return [2 * (rank + 1) * entries[rank] + 2 * total]
        # loss = mean over every rank's samples of (w.x + b - y)^2; only this rank's predictions carry a graph
        model = _checks._model()
        count = sum(len(_checks._inputs(name, q)[0]) for q in range(world_size))
        x, y = _checks._inputs(name, rank)
        residual = model(x).squeeze(-1) - y
        return [(2 / count) * (residual @ x).unsqueeze(0), (2 / count) * residual.sum().reshape(1)]


@needs_supported_torch
def test_checks_compare_against_a_reference_that_catches_a_wrong_gradient() -> None:
    """The parent's comparison is not vacuous: the reference differs between ranks, and a wrong gradient fails."""
    from torchmetrics_gradpatch.cli import checks as _checks

    for name in _checks.CHECKS:
        r0, r1 = _checks.reference(name, 0, 2), _checks.reference(name, 1, 2)
        assert _checks.matches(analytic_gradient(name, 0, 2), r0), name  # the reference itself is right
        assert _checks.matches([2 * g for g in analytic_gradient(name, 1, 2)], _checks.reference(name, 1, 2, "global"))
        assert not _checks.matches(None, r0)
        assert not _checks.matches([g * 1.001 for g in r0], r0), name
        assert not _checks.matches([g * 0.5 for g in r0], r0), name
        if name.startswith("metric"):
            assert not _checks.matches(r1, r0), name  # the ranks' gradients differ: a swap would be caught
