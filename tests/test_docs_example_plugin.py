"""A metric's own DDP test written on the ``ranks`` marker (tests/plugin_cases/docs_example.py), run as a fresh
pytest run with ``-p tests.harness.plugin`` in a subprocess.

The example fails where the gradient is wrong: on torchmetrics before 1.6 without the patch, ``loss.backward()``
raises (the synced state has no graph); with the patch, or natively from 1.6, each rank's gradient must equal its
slice of the single-process gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.harness, pytest.mark.usefixtures("suite_importable")]  # tox's harness environment

PLUGIN = "tests.harness.plugin"
EXAMPLE = Path(__file__).resolve().parent / "plugin_cases" / "docs_example.py"


def test_docs_example_passes_on_two_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_my_metric=EXAMPLE.read_text())
    result = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
