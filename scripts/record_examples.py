#!/usr/bin/env python3
"""Run the README's commands (``check`` and the two examples) and record each output in ``results/examples/``.

Why: the README and docs/examples.md quote these outputs, and a quoted figure must come from a committed
artifact that says how it was made. Each artifact starts with the command, the commit it ran at, the versions
and the machine's load average at start and end, then the command's stdout, stderr and exit status.

    python scripts/record_examples.py                 # run all three, write results/examples/*.txt
    python scripts/record_examples.py --update-docs   # the same, and put the outputs into the pages
    python scripts/record_examples.py --docs-only     # run nothing: put the recorded outputs into the pages

``--update-docs`` replaces the text between ``<!-- examples/NAME:begin -->`` and ``<!-- examples/NAME:end -->``
in README.md and docs/examples.md with the recorded output, so the pages cannot drift from the artifacts.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "examples"
PAGES = [ROOT / "README.md", ROOT / "docs" / "examples.md"]

# name -> (command as the README writes it, the first stdout line the pages quote: they quote from there on)
RUNS: dict[str, tuple[list[str], str]] = {
    "check": (["python", "-m", "torchmetrics_gradpatch", "check"], r"^  check "),
    "ddp_metric_loss": (["torchrun", "--standalone", "--nproc-per-node", "2", "examples/ddp_metric_loss.py"], ""),
    "contrastive_uneven": (
        ["torchrun", "--standalone", "--nproc-per-node", "3", "examples/contrastive_uneven.py"],
        "",
    ),
}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _executable(command: list[str]) -> list[str]:
    """Run ``python`` and ``torchrun`` from this interpreter's environment, as a user's activated venv would."""
    bindir = Path(sys.executable).parent
    if command[0] == "python":
        return [sys.executable, *command[1:]]
    if (bindir / command[0]).exists():
        return [str(bindir / command[0]), *command[1:]]
    return command


def record(name: str) -> str:
    """Run one command and return the artifact's text (header, stdout, stderr, exit status)."""
    command, _ = RUNS[name]
    # uncommitted changes to code (pages and artifacts excluded: recording rewrites them)
    artifacts = (":!*.md", ":!results", ":!benchmarks/results")
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *artifacts)
    dirty = " (with uncommitted changes to code)" if changed else ""
    header = [
        f"# command: {' '.join(command)}   (run from the repository root by scripts/record_examples.py)",
        f"# commit: {_git('rev-parse', '--short', 'HEAD')}{dirty}",
        f"# python {platform.python_version()}, torch {version('torch')}, torchmetrics {version('torchmetrics')},"
        f" {os.cpu_count()} CPUs",
        f"# load average (1, 5, 15 min) at start: {_load()}",
    ]
    # this checkout's src/ first: the run is of the commit the header names, whatever else is installed
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        _executable(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    header.append(f"# load average (1, 5, 15 min) at end: {_load()}")
    return "\n".join(
        [*header, "--- stdout", proc.stdout.rstrip(), "--- stderr", proc.stderr.rstrip(), f"exit {proc.returncode}", ""]
    )


def quoted(name: str, artifact: str) -> str:
    """The stdout lines a page quotes from an artifact, as a fenced text block."""
    stdout = artifact.split("--- stdout\n", 1)[1].split("\n--- stderr", 1)[0]
    lines = stdout.splitlines()
    first = next((i for i, line in enumerate(lines) if re.search(RUNS[name][1], line)), 0)
    return "```text\n" + "\n".join(lines[first:]) + "\n```"


def update_pages(outputs: dict[str, str]) -> None:
    for page in PAGES:
        text = page.read_text()
        for name, artifact in outputs.items():
            begin, end = f"<!-- examples/{name}:begin -->", f"<!-- examples/{name}:end -->"
            if begin in text:
                head, rest = text.split(begin, 1)
                _, tail = rest.split(end, 1)
                text = f"{head}{begin}\n{quoted(name, artifact)}\n{end}{tail}"
        page.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--update-docs", action="store_true", help="also put the outputs into README.md and docs/")
    parser.add_argument("--docs-only", action="store_true", help="run nothing: update the pages from the artifacts")
    parser.add_argument("names", nargs="*", help=f"which to run: {', '.join(RUNS)} (default: all)")
    args = parser.parse_args(argv)
    if unknown := set(args.names) - set(RUNS):
        parser.error(f"unknown name(s) {sorted(unknown)}: choose from {', '.join(RUNS)}")
    outputs = {}
    for name in args.names or RUNS:
        if args.docs_only:
            outputs[name] = (OUT / f"{name}.txt").read_text()
            continue
        outputs[name] = record(name)
        (OUT / f"{name}.txt").write_text(outputs[name])
        print(f"{OUT.relative_to(ROOT)}/{name}.txt: {outputs[name].splitlines()[-1]}")
    if args.update_docs or args.docs_only:
        update_pages(outputs)
    return 0 if all(text.rstrip().endswith("exit 0") for text in outputs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
