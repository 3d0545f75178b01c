"""The suite tests the installed package, never the checkout: pytest's ``--import-mode=append`` puts the checkout's
root after site-packages on ``sys.path``, so the pytest process and every rank import the wheel tox built and
installed, although the package's source sits at the checkout's root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._ranks import run_ranks

pytestmark = pytest.mark.python

ROOT = Path(__file__).resolve().parent.parent

# Outside tox the package may well be an editable install of this checkout (the quick path); inside, tox installs
# the wheel it built into the environment it names.
in_tox = pytest.mark.skipif("TOX_ENV_DIR" not in os.environ, reason="not a tox environment: may be an editable install")


def imported_from() -> Path:
    import torchmetrics_gradpatch

    return Path(torchmetrics_gradpatch.__file__).resolve()


def assert_installed(where: Path) -> None:
    env = Path(os.environ["TOX_ENV_DIR"]).resolve()
    # tox keeps its environments under the checkout (.tox/), so "not under ROOT" would not do: the checkout's own
    # copy is the one directly at ROOT/torchmetrics_gradpatch.
    assert ROOT / "torchmetrics_gradpatch" not in where.parents, f"imported from the checkout: {where}"
    assert env in where.parents and "site-packages" in where.parts, f"not the environment's wheel: {where}"


@in_tox
def test_the_pytest_process_imports_the_installed_wheel() -> None:
    assert_installed(imported_from())


def _imported_from(rank: int, world_size: int) -> str:
    return str(imported_from())


@in_tox
def test_every_rank_imports_the_installed_wheel() -> None:
    for where in run_ranks(_imported_from, 2):
        assert_installed(Path(where))
