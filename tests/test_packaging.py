"""What a user or a packager reads before adopting the package: one version, the license, the classifiers, the
changelog, and ``--version``.

Building the sdist and the wheel and installing the wheel alone is ``tox -e wheel-smoke`` (scripts/check_dist.py);
these tests check the sources that build reads, so they stay fast and run in every environment.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests._subprocess import ROOT

pytestmark = pytest.mark.once

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT: dict[str, Any] = PYPROJECT["project"]
INIT = ROOT / "torchmetrics_gradpatch" / "__init__.py"
#: sha256 of the Apache License 2.0 exactly as apache.org publishes it (LICENSE-2.0.txt, 202 lines)
#: what the console script's generated wrapper does (entry point torchmetrics_gradpatch.cli:main)
CONSOLE_SCRIPT = "import sys; from torchmetrics_gradpatch.cli import main; sys.exit(main())"
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def version_assignments() -> list[ast.Assign]:
    tree = ast.parse(INIT.read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets)
    ]


def source_version() -> str:
    (assignment,) = version_assignments()
    assert isinstance(assignment.value, ast.Constant) and isinstance(assignment.value.value, str)
    return assignment.value.value


def test_version_is_one_string_literal_in_init() -> None:
    """setuptools reads ``attr:`` versions statically only from a literal; anything else makes it import the package,
    which needs torch -- absent from the isolated build environment, so the build would fail."""
    assignments = version_assignments()
    assert len(assignments) == 1, f"__version__ is assigned {len(assignments)} times in {INIT.name}"
    value = assignments[0].value
    assert isinstance(value, ast.Constant) and isinstance(value.value, str), ast.dump(value)
    assert str(Version(value.value)) == value.value, f"{value.value!r} is not a normalised PEP 440 version"


def test_pyproject_takes_the_version_from_init() -> None:
    assert "version" not in PROJECT, "pyproject.toml writes the version a second time"
    assert "version" in PROJECT["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "torchmetrics_gradpatch.__version__"


def test_no_other_file_writes_the_version() -> None:
    version = source_version()
    pattern = re.compile(rf"""(?<![\w.]){re.escape(version)}(?![\w.])""")
    candidates = [ROOT / "pyproject.toml", *(ROOT / "torchmetrics_gradpatch").glob("*.py")]
    copies = [p.name for p in candidates if p != INIT and pattern.search(p.read_text())]
    assert not copies, f"version {version} also written in {copies}"


def test_installed_metadata_reports_the_source_version() -> None:
    """The installed distribution (tox installs the built wheel) carries the version the sources write."""
    try:
        installed = importlib.metadata.version("torchmetrics-gradpatch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchmetrics-gradpatch is not installed in this interpreter's environment (tox installs it)")
    assert installed == source_version(), (
        f"installed metadata says {installed}, the sources say {source_version()}: reinstall the package"
    )


@pytest.mark.parametrize("command", [["-m", "torchmetrics_gradpatch"], ["-c", CONSOLE_SCRIPT]], ids=["-m", "script"])
def test_cli_version_prints_the_version(command: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, *command, "--version"], capture_output=True, text=True, env=env, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"torchmetrics-gradpatch {source_version()}"


def test_license_is_the_full_apache_text_and_declared_in_spdx() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256, "LICENSE is not the unmodified Apache-2.0 text"
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    # PEP 639's license expression needs setuptools >= 77, which also refuses a "License ::" classifier beside it
    (setuptools,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert not setuptools.specifier.contains("76.9"), setuptools
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]


def test_classifiers_match_what_is_supported_and_tested() -> None:
    classifiers = set(PROJECT["classifiers"])
    python = SpecifierSet(PROJECT["requires-python"])
    # the interpreters tox.ini tests: 3.11 everywhere, 3.10, 3.12 and 3.13 in their own environments
    tox = (ROOT / "tox.ini").read_text()
    tested = sorted({m for m in re.findall(r"python(3\.\d+)", tox)}, key=Version)
    assert tested == ["3.10", "3.11", "3.12", "3.13"], tested
    for minor in tested:
        assert minor in python, f"tox tests Python {minor}, requires-python is {python}"
        assert f"Programming Language :: Python :: {minor}" in classifiers
    listed = {c.rsplit(" ", 1)[1] for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    assert listed == set(tested), f"classifiers list {sorted(listed)}, tox tests {tested}"
    assert "Typing :: Typed" in classifiers and (ROOT / "torchmetrics_gradpatch" / "py.typed").exists()
    assert any(c.startswith("Development Status ::") for c in classifiers)


def test_changelog_has_an_entry_for_the_version_in_keep_a_changelog_layout() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n")
    assert "keepachangelog.com" in text
    releases = re.findall(r"^## \[([^\]]+)\](.*)$", text, flags=re.M)
    assert releases, "no '## [version] - date' entries"
    assert releases[0][0] in ("Unreleased", source_version()), releases[0]
    assert source_version() in [name for name, _ in releases], f"no entry for {source_version()}"
    for name, rest in releases:
        assert name == "Unreleased" or re.fullmatch(r" - (\d{4}-\d{2}-\d{2}|Unreleased)", rest), (name, rest)
    sections = set(re.findall(r"^### (.+)$", text, flags=re.M))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, sections


def test_lint_runs_actionlint_on_every_workflow() -> None:
    """tox's lint environment names the workflow files (actionlint finds none by itself outside a git checkout)."""
    tox = (ROOT / "tox.ini").read_text()
    (command,) = [line.strip() for line in tox.splitlines() if line.strip().startswith("actionlint ")]
    named = {word for word in command.split() if word.startswith(".github/workflows/")}
    workflows = {p.relative_to(ROOT).as_posix() for p in (ROOT / ".github" / "workflows").glob("*.y*ml")}
    assert workflows and named == workflows, f"lint checks {sorted(named)}, the workflows are {sorted(workflows)}"
