"""Turn a matrix run's results into the compatibility table of docs/compatibility.md (never edit it by hand).

    tox -m matrix                         # or: python scripts/run_matrix.py (the same, in bounded disk)
    python scripts/compat_table.py        # rewrites docs/compatibility.md between the compat-table markers

Reads ``results/raw/<env>.json`` (pytest's result, written by tests/conftest.py in every tox environment),
``results/raw/<env>.run.json`` (tox's exit code and failed stage) and ``results/raw/run.json`` (the run), the last
two written by scripts/run_matrix.py only. Writes ``results/matrix.json`` (everything merged) and the table between
``<!-- compat-table:begin -->`` and ``<!-- compat-table:end -->`` in docs/compatibility.md. ``results/`` is
git-ignored: the table is what the repository keeps. ``--from results/matrix.json`` regenerates the table from
that record instead of results/raw/.

A re-run of some environments (after a fix) is merged over a full run, never instead of it: keep the full run's
directory, re-run into results/raw, then
``python scripts/compat_table.py --raw <full run> --rerun results/raw --rerun-reason "..."``. The record keeps
the first run's verdict and failed tests beside the re-run's (``first_run``, ``first_run_not_passed``, ``reruns``).

Environments the full run did not have (new columns, say) are added from a later run of just those, never mixed
into the full run's own: ``python scripts/compat_table.py --from results/matrix.json --add <that run's results>``.
``--compile-run <dir>`` adds runs of ``tox -e <env> -- tests/test_compile.py`` as the torch.compile column.

The table shows each cell's current verdict only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "results" / "raw"
RECORD = ROOT / "results" / "matrix.json"
TARGET = ROOT / "docs" / "compatibility.md"
BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"
ENV_RE = re.compile(r"^(?:py(?P<py>3\.\d+)-)?torch(?P<torch>[\d.]+)-tm(?P<tm>[\d.]+)$")


def load_raw(raw: Path) -> dict[str, Any]:
    run = json.loads((raw / "run.json").read_text()) if (raw / "run.json").exists() else {}
    names = run.get("environments") or sorted(
        {p.name.split(".json")[0].removesuffix(".run") for p in raw.glob("*.json") if p.name != "run.json"}
    )
    completed = set(run.get("completed", names))  # files of environments this run did not reach are stale
    envs: dict[str, Any] = {}
    for name in names:
        if name not in completed:
            envs[name] = {"pytest": None, "tox": None}
            continue
        result, process = raw / f"{name}.json", raw / f"{name}.run.json"
        envs[name] = {
            "pytest": json.loads(result.read_text()) if result.exists() else None,
            "tox": json.loads(process.read_text()) if process.exists() else None,
        }
    return {"run": run, "environments": envs}


def merge_rerun(record: dict[str, Any], rerun: dict[str, Any], reason: str) -> dict[str, Any]:
    """Put the cells of a re-run of some environments over the full run's, keeping what the first run said.

    The record keeps the first run's verdict and failed tests in the cell and the re-run's command, date and
    ``reason`` in ``reruns``, so a re-run can never erase a failure; the table shows the current verdict.
    """
    done = set(rerun["run"].get("completed", rerun["environments"]))
    for name, entry in rerun["environments"].items():
        if name not in done:
            continue
        first = record["environments"].get(name)
        record["environments"][name] = {
            **entry,
            "first_run": verdict(name, first) if first else "not in the run",
            "first_run_not_passed": ((first or {}).get("pytest") or {}).get("not_passed", []),
        }
    info = {key: rerun["run"].get(key) for key in ("command", "started_at", "wall_min")}
    record.setdefault("reruns", []).append({**info, "environments": sorted(done), "reason": reason})
    return record


def merge_added(record: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """Add the environments of a later run that the record does not have yet (new columns of the table).

    An environment the record already has is refused: changing a cell's verdict is what ``--rerun`` is for,
    and it keeps the first verdict beside the new one.
    """
    done = set(added["run"].get("completed", added["environments"]))
    clash = sorted(done & set(record["environments"]))
    if clash:
        raise SystemExit(f"--add: already in the record (use --rerun to re-run a cell): {', '.join(clash)}")
    for name in sorted(done):
        record["environments"][name] = {**added["environments"][name], "added_by": len(record.get("additions", []))}
    info = {key: added["run"].get(key) for key in ("command", "started_at", "wall_min", "commit", "peak_disk_gb")}
    record.setdefault("additions", []).append({**info, "environments": sorted(done)})
    return record


def merge_compile(record: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Add a run of tests/test_compile.py alone (``tox -e <env> -- tests/test_compile.py``) as the compile column.

    Kept apart from the environments' full-suite cells (same environment names, another test selection); a later
    compile run of an environment replaces an earlier one's compile cell, and the record keeps every run's info.
    """
    done = set(run["run"].get("completed", run["environments"]))
    compile_cells = record.setdefault("compile", {})
    for name in sorted(done):
        compile_cells[name] = run["environments"][name]
    keys = ("command", "started_at", "wall_min", "commit", "profile", "peak_disk_gb")
    info = {key: run["run"].get(key) for key in keys if key != "profile" or "profile" in run["run"]}
    record.setdefault("compile_runs", []).append({**info, "environments": sorted(done)})
    return record


def compile_verdict(entry: dict[str, Any]) -> str | None:
    """The torch.compile cell for one environment's result (``None``: tests/test_compile.py did not run there)."""
    pytest, tox = entry.get("pytest"), entry.get("tox")
    if tox and tox.get("failed_stage") == "install":
        return "not installable"
    if tox and tox.get("failed_stage") == "timeout":
        return f"**FAILS** (hung: killed after {tox.get('wall_s')} s)"
    summary = (pytest or {}).get("compile")
    if summary is None:
        return None
    if summary["failed"] or summary["error"]:
        return f"**FAILS** ({summary['failed']} failed, {summary['error']} errors, {summary['passed']} passed)"
    if not summary["passed"]:
        reasons = "; ".join(summary["skip_reasons"]) or "no reason given"
        return f"skipped: {reasons}"
    skipped = f", {summary['skipped']} skipped" if summary["skipped"] else ""
    xfailed = summary.get("xfailed", 0)
    if xfailed:  # expected failures: not passes; the reason is torch's, and the cell says so
        reasons = "; ".join(summary.get("xfail_reasons", [])) or "no reason given"
        return f"works except {xfailed} expected failure(s) ({summary['passed']} passed{skipped}): {reasons}"
    return f"passes ({summary['passed']} passed{skipped})"


def verdict(name: str, entry: dict[str, Any]) -> str:
    """The cell text for one environment."""
    pytest, tox = entry.get("pytest"), entry.get("tox")
    if tox and tox.get("skipped"):
        return "skipped (no interpreter)"
    if tox and tox.get("failed_stage") == "timeout":
        return f"**FAILS** (hung: killed after {tox.get('wall_s')} s)"
    if tox and tox.get("failed_stage") == "install":
        return "not installable"
    if pytest is None:
        if tox and tox.get("tox_exit") == 0:
            return "passes" if not ENV_RE.match(name) else "skipped (no interpreter)"
        return "not run" if not tox else f"**FAILS** (tox exit {tox.get('tox_exit')})"
    counts = pytest["counts"]
    ok = pytest["exitstatus"] == 0 and (tox is None or tox.get("tox_exit") == 0)
    if not ok:
        return f"**FAILS** ({counts['failed']} failed, {counts['error']} errors, {counts['passed']} passed)"
    if Version(Version(pytest["torch"]).base_version) < Version("2.0"):
        return "refused as designed"
    return f"passes ({counts['passed']} passed, {counts['skipped']} skipped)"


def _row_key(name: str, entry: dict[str, Any]) -> tuple[Version, str, Version] | None:
    """(torch, Python, torchmetrics) of a matrix cell, or ``None`` for other environments (lint, type)."""
    match = ENV_RE.match(name)
    if not match:
        return None
    pytest = entry.get("pytest") or {}
    torch = Version(Version(pytest.get("torch") or _pinned(match["torch"])).base_version)  # 2.13.0+cpu: 2.13.0
    tm = Version(pytest.get("torchmetrics") or _pinned(match["tm"]))
    return torch, match["py"] or "3.11", tm


def _compile_cells(record: dict[str, Any]) -> dict[tuple[Version, str], str]:
    """The torch.compile column: per (torch, Python), from a compile run, else from a full run that included it.

    torchmetrics 1.5.2's cell is preferred (the compile runs use it); another torchmetrics' cell is named.
    """
    found: dict[tuple[Version, str], list[tuple[bool, str]]] = {}
    sources = [*record["environments"].items(), *record.get("compile", {}).items()]  # compile runs last: they win
    for name, entry in sources:
        key = _row_key(name, entry)
        cell = compile_verdict(entry)
        if key is None or cell is None:
            continue
        build = (entry.get("pytest") or {}).get("torch", "")
        if "+" in build:  # a local build (the CPU wheel, say) shares its release's row: name it
            cell = f"{cell}, torch {build}"
        torch, python, tm = key
        preferred = str(tm) == "1.5.2"
        found.setdefault((torch, python), []).append((preferred, cell if preferred else f"{cell}, torchmetrics {tm}"))
    return {key: max(cells, key=lambda c: c[0])[1] for key, cells in found.items()}


def table(record: dict[str, Any]) -> str:
    envs = record["environments"]
    rows: dict[tuple[Version, str], dict[str, str]] = {}
    columns: set[Version] = set()
    others = []
    for name, entry in envs.items():
        key = _row_key(name, entry)
        if key is None:
            others.append(f"`{name}`: {verdict(name, entry)}")
            continue
        torch, python, tm = key
        columns.add(tm)
        rows.setdefault((torch, python), {})[str(tm)] = verdict(name, entry)
    compiled = _compile_cells(record)
    for cell_key in compiled:
        rows.setdefault(cell_key, {})
    ordered = sorted(columns)
    lines = [
        f"Generated by `python scripts/compat_table.py` from a matrix run ({len(envs)} environments). "
        "Python 3.11 unless stated. torchmetrics 1.9.0 keeps the graph natively: local mode patches nothing there, "
        "global mode installs as everywhere. The torch.compile column is `tests/test_compile.py` with torchmetrics "
        "1.5.2: the quick profile compiles with the "
        "eager backend on 2 ranks (a compiled step against eager, both modes, sum and cat Metric losses and the "
        "direct gather); the ci one (`tox -e compile-torch2.15`) adds the aot_eager and inductor backends on 2 "
        "ranks and `check --compile`; the full one adds every backend on 3 ranks.",
        "",
        "| torch | " + " | ".join(f"torchmetrics {tm}" for tm in ordered) + " | torch.compile |",
        "|---|" + "---|" * (len(ordered) + 1),
    ]
    for torch, python in sorted(rows, key=lambda key: (key[1] != "3.11", key[0], key[1])):
        cells = rows[(torch, python)]
        label = str(torch) if python == "3.11" else f"{torch} (Python {python})"
        compile_cell = compiled.get((torch, python), "-")
        lines.append(f"| {label} | " + " | ".join(cells.get(str(tm), "-") for tm in ordered) + f" | {compile_cell} |")
    if others:
        lines += ["", "Other environments: " + "; ".join(others) + "."]
    compile_envs = record.get("compile", {})
    lines += _details({**envs, **{f"{name} (torch.compile run)": entry for name, entry in compile_envs.items()}})
    return "\n".join(lines)


def _details(envs: dict[str, Any]) -> list[str]:
    """What the counts hide: each currently failing test by name, and every skip reason (a skip is not a pass)."""
    failed: list[str] = []
    reasons: dict[str, tuple[set[str], set[str]]] = {}  # reason -> (tests, environments)
    for name, entry in envs.items():
        pytest = entry.get("pytest") or {}
        failed += [f"`{name}`: `{test}`" for test in pytest.get("not_passed", [])]
        for skip in pytest.get("skipped", []):
            # one line per reason, whatever the installed version it names
            reason = re.sub(r"\b(torch|torchmetrics) \d[\w.+]*", r"\1 <installed>", skip["reason"])
            tests, names = reasons.setdefault(reason, (set(), set()))
            tests.add(skip["test"].split("::")[-1].split("[")[0])
            names.add(name)
    lines = []
    if failed:
        lines += ["", "Failed tests: " + "; ".join(failed) + "."]
    if reasons:
        lines += ["", "Skipped tests, by pytest's reason:", ""]
        for reason, (tests, names) in sorted(reasons.items(), key=lambda item: -len(item[1][1])):
            shown = ", ".join(f"`{test}`" for test in sorted(tests)[:4]) + (", ..." if len(tests) > 4 else "")
            lines.append(f"- {reason}: {len(tests)} test(s) ({shown}) in {len(names)} environment(s)")
    return lines


def _pinned(factor: str) -> str:
    """The version a factor pins, for environments that left no pytest result (e.g. not installable)."""
    pins = {"1.13": "1.13.1", "0.11": "0.11.4", "1.0": "1.0.3", "1.5": "1.5.2", "1.9": "1.9.0"}
    tox_ini = (ROOT / "tox.ini").read_text()
    found = re.search(rf"torch{re.escape(factor)}: TMGP_TORCH = (\S+)", tox_ini)
    return found.group(1) if found else pins.get(factor, factor)


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"{TARGET.relative_to(ROOT)} needs exactly one {begin} ... {end} pair")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", type=Path, help="a results/matrix.json record instead of results/raw")
    parser.add_argument("--check", action="store_true", help="exit 1 if the docs' table differs; change nothing")
    parser.add_argument("--raw", type=Path, default=RAW, help="the run's results directory (default: results/raw)")
    parser.add_argument("--rerun", type=Path, help="results directory of a re-run of some environments, merged over")
    parser.add_argument("--rerun-reason", default="", help="why those environments were re-run (shown in the table)")
    parser.add_argument(
        "--add", type=Path, action="append", help="results of a later run of cells the record lacks (repeatable)"
    )
    parser.add_argument(
        "--compile-run",
        type=Path,
        action="append",
        help="results of `tox -e <env> -- tests/test_compile.py` runs: the torch.compile column (repeatable)",
    )
    args = parser.parse_args()
    record = json.loads(args.source.read_text()) if args.source else load_raw(args.raw)
    for added in args.add or []:  # new cells first, so that a re-run can then be merged over one of them
        record = merge_added(record, load_raw(added))
    if args.rerun:
        if not args.rerun_reason:
            parser.error("--rerun needs --rerun-reason: the table says why a cell was re-run")
        record = merge_rerun(record, load_raw(args.rerun), args.rerun_reason)
    for compile_run in args.compile_run or []:
        record = merge_compile(record, load_raw(compile_run))
    if not record["environments"]:
        print("no results: run scripts/run_matrix.py first", file=sys.stderr)
        return 2
    readme = TARGET.read_text()
    new = replace_between(readme, BEGIN, END, table(record))
    if args.check:
        return 0 if new == readme else 1
    if not args.source or args.rerun or args.add or args.compile_run:
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=2) + "\n")
    TARGET.write_text(new)
    print(table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
