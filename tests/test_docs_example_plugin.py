"""The docs' "Testing your own metrics on real ranks" example, run as a user runs it: ``pytest -p
torchmetrics_gradpatch.pytest_plugin`` in a subprocess, on the file the docs quote (tests/plugin_cases/docs_example.py).

The example fails where the gradient is wrong: on torchmetrics before 1.6 without the patch, ``loss.backward()``
raises (the synced state has no graph); with the patch, or natively from 1.6, each rank's gradient must equal its
slice of the single-process gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

EXAMPLE = Path(__file__).resolve().parent / "plugin_cases" / "docs_example.py"


def test_docs_example_passes_on_two_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_my_metric=EXAMPLE.read_text())
    result = pytester.runpytest_subprocess("-p", "torchmetrics_gradpatch.pytest_plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_docs_quote_this_very_file() -> None:
    """docs/testing-your-metrics.md shows the example verbatim, so what users read is what this module runs."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "testing-your-metrics.md").read_text()
    quoted = page.split("<!-- docs-example:begin -->\n```python\n", 1)[1].split("```\n<!-- docs-example:end -->", 1)[0]
    assert quoted == EXAMPLE.read_text()
