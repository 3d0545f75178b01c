"""Every measured figure in README.md and docs/*.md is found in the committed artifact its text names
(``scripts/check_figures.py``), and the checker itself finds what it should and only that."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._subprocess import ROOT

_spec = importlib.util.spec_from_file_location("check_figures", ROOT / "scripts" / "check_figures.py")
assert _spec is not None and _spec.loader is not None
check_figures = importlib.util.module_from_spec(_spec)
sys.modules["check_figures"] = check_figures  # dataclasses look their module up by name
_spec.loader.exec_module(check_figures)


def _page_params() -> list[object]:
    return [pytest.param(page, id=page.relative_to(ROOT).as_posix()) for page in check_figures.default_pages(ROOT)]


@pytest.mark.parametrize("page", _page_params())
def test_every_figure_is_in_its_artifact(page: Path) -> None:
    problems = check_figures.check([page], ROOT)
    assert not problems, "\n".join(problems)


def found(line: str) -> list[str]:
    return [str(figure.text) for figure in check_figures.figures(1, line)]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "took 1218 s and 20.3 minutes, 6.4 ms, 1.49 µs or 7.7 us",
            ["1218 s", "20.3 minutes", "6.4 ms", "1.49 µs", "7.7 us"],
        ),
        ("retained 192 MiB (14.2 GB of cache), 0.18% and 9 %", ["192 MiB", "14.2 GB", "0.18%", "9 %"]),
        (
            "gathers of 0.8-8 ms, 10-20 minutes, 1.1-1.7\u00d7 and 5x",
            ["0.8-8 ms", "10-20 minutes", "1.1-1.7\u00d7", "5x"],
        ),
        ("the ratio 1.064 [1.03-1.12] and an interval 0.93-1.14", ["1.064 [1.03-1.12]", "0.93-1.14"]),
        ("a ratio of 0.00140; 1,417 modules in 4.33 ms", ["0.00140", "4.33 ms"]),
        ("intervals about +-5-15 % wide, or \u00b13 %", ["5-15 %", "3 %"]),
        ("| 2 ranks | 0.921 [0.82-1.06] | 1.023 [0.93-1.07] **missed** |", ["0.921 [0.82-1.06]", "1.023 [0.93-1.07]"]),
    ],
)
def test_figures_are_found(line: str, expected: list[str]) -> None:
    assert found(line) == expected


@pytest.mark.parametrize(
    "line",
    [
        "torch 2.13.0+cpu, torchmetrics 1.5.2 and 1.6.0; Python 3.10 to 3.13; wrapt>=1.14, packaging>=21",
        "torch 2.0-2.4 and Python 3.11-3.13 and torchmetrics 0.11-1.5",
        "upstream PR #2754, 2 ranks, world size 3, 25 steps, 1,500 gathers, >= 50,000 toggles",
        "the median with its 95% CI, or a 95 % confidence interval; target <= 1.05 and <= 5 %",
        "an error of 8.9e-16 and a tolerance of 1e-12; 0.5 x the single-process gradient",
        "`timeout=120` and `torch2.15-tm1.5` in code; [a link](results/v1.064/x.md); <!-- 5 ms -->",
        "127.0.0.1:18851, https://keepachangelog.com/en/1.1.0/ and 09:36 UTC",
    ],
)
def test_versions_counts_and_bounds_are_not_figures(line: str) -> None:
    assert found(line) == []


def _tree(tmp_path: Path, page: str, artifact: str = "", name: str = "results/run.txt") -> list[str]:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(page)
    if artifact:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(artifact)
    problems: list[str] = check_figures.check([tmp_path / "docs" / "page.md"], tmp_path)
    return problems


PROVENANCE = "command: python run.py\ncommit 1986336\nload average 0.1 (end 1.2)\n"


def test_a_figure_in_its_artifact_passes(tmp_path: Path) -> None:
    page = "It took 1218 s and 1,417 modules took 4.33 ms ([run](../results/run.txt)).\n"
    assert _tree(tmp_path, page, PROVENANCE + "wall_s 1218; 1417 modules, 4.33 ms\n") == []


def test_a_rounded_or_missing_figure_fails_with_its_line(tmp_path: Path) -> None:
    page = "# Title\n\nIt took about 20 minutes (`results/run.txt`),\nabout 9 % longer.\n"
    problems = _tree(tmp_path, page, PROVENANCE + "wall_s 1218; ratio 1.087\n")
    assert problems == [
        "docs/page.md:3: '20 minutes': 20 is not in results/run.txt "
        "(write it with the artifact's digits, or name the artifact that shows it)",
        "docs/page.md:4: '9 %': 9 is not in results/run.txt "
        "(write it with the artifact's digits, or name the artifact that shows it)",
    ]


def test_the_digits_must_match_not_just_begin_alike(tmp_path: Path) -> None:
    problems = _tree(tmp_path, "Ratios 0.90-1.06 in `results/run.txt`.\n", PROVENANCE + "ratios 0.902, 1.064\n")
    assert len(problems) == 1 and "0.90 and 1.06 are not in results/run.txt" in problems[0], problems


def test_a_figure_whose_block_names_no_artifact_fails(tmp_path: Path) -> None:
    page = "The flake check takes 43 minutes.\n\n- it found 2 flakes in `results/run.txt`\n"
    problems = _tree(tmp_path, page, PROVENANCE)
    assert len(problems) == 1 and problems[0].startswith("docs/page.md:1: '43 minutes': its paragraph names no"), (
        problems
    )


def test_a_missing_artifact_is_named(tmp_path: Path) -> None:
    problems = _tree(tmp_path, "It took 43 minutes (`results/raw/flake.json`).\n")
    assert problems[0] == "docs/page.md:1: names `results/raw/flake.json`, which does not exist", problems


def test_tables_code_blocks_and_lists_belong_to_their_lead_in(tmp_path: Path) -> None:
    page = (
        "From [the run](../results/run.txt):\n\n| case | time |\n|---|---|\n| a | 6.4 ms |\n\n"
        "Its output, `results/run.txt`:\n\n```text\ngather  12.0 ms\n```\n\n"
        "Each took, per `results/run.txt`:\n\n- 21.0 ms\n- 15.3 ms\n\nAlone: 7.7 ms.\n"
    )
    problems = _tree(tmp_path, page, PROVENANCE + "6.4 ms 12.0 ms 21.0 ms 15.3 ms 7.7 ms\n")
    assert problems == [
        "docs/page.md:18: '7.7 ms': its paragraph names no artifact (link or name in backticks a committed file "
        "under results/ or benchmarks/results/ that shows it; if it is not a measurement: "
        "<!-- not-measured: 7.7 ms -->)"
    ]


def test_not_measured_comments_allow_exactly_what_they_quote(tmp_path: Path) -> None:
    page = (
        "A timeout of 120 s and a target of 5 %. <!-- not-measured: 120 s; 5 % -->\n\n"
        "<!-- not-measured: 10 ms -->\n```bash\nrun --every 10 ms   # 3 ms\n```\n"
    )
    problems = _tree(tmp_path, page)
    assert len(problems) == 1 and "'3 ms': its code names no artifact" in problems[0], problems


def test_an_artifact_without_provenance_is_reported_once(tmp_path: Path) -> None:
    page = "It took 6.4 ms and 12.0 ms (`results/run.txt`).\n"
    problems = _tree(tmp_path, page, "6.4 ms 12.0 ms\n")
    assert problems == [
        "docs/page.md:1: '6.4 ms': results/run.txt does not state its command, its commit, the machine load "
        "(said once per page, for the first figure found in it)"
    ]


def test_a_folder_or_pattern_names_every_file_in_it(tmp_path: Path) -> None:
    page = "Rounds retained 192 MiB (`results/memory/`) and 64 MiB (`results/memory/*.json`).\n"
    (tmp_path / "results" / "memory").mkdir(parents=True)
    (tmp_path / "results" / "memory" / "b.json").write_text(PROVENANCE + '{"retained": [64, 192]}\n')
    assert _tree(tmp_path, page) == []


def test_the_command_line_exits_non_zero_and_prints_each_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Fast: 5x.\n")
    assert check_figures.main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "README.md:1: '5x': its paragraph names no artifact" in out and "1 problem(s) in 1 page(s)" in out


def test_an_artifact_named_after_a_code_span_that_wraps_is_found(tmp_path: Path) -> None:
    page = "A marked test took 1.56 s (`python\nbench.py --rounds 20`, `results/run.txt`).\n"
    assert _tree(tmp_path, page, PROVENANCE + "1.56 s\n") == []


def _compat_table_module() -> Any:
    spec = importlib.util.spec_from_file_location("compat_table", ROOT / "scripts" / "compat_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_compatibility_table_is_generated_from_the_record() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compat_table.py"), "--from", "results/matrix.json", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, (
        "docs/compatibility.md's table differs from `python scripts/compat_table.py --from results/matrix.json`: "
        f"regenerate it\n{proc.stdout}{proc.stderr}"
    )


def test_the_compatibility_table_shows_current_verdicts_and_the_record_keeps_their_history() -> None:
    record = json.loads((ROOT / "results" / "matrix.json").read_text())
    rerun = {name: entry for name, entry in record["environments"].items() if "first_run" in entry}
    assert rerun, "the record has no re-run cell: this test needs one to mean anything"
    table = _compat_table_module().table(record)
    for mark in ("†", "‡", "first run", "re-run"):
        assert mark not in table, f"the table shows history ({mark!r}); it belongs in results/matrix.json"
    for name, entry in rerun.items():  # a re-run never erases what the first run said
        assert entry["first_run"] and name in {env for run in record["reruns"] for env in run["environments"]}
