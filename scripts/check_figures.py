#!/usr/bin/env python3
"""Check that every measured figure in README.md and docs/*.md comes from the committed artifact its text names.

Why: figures in prose drift. A number copied by hand from one run stays on the page after the next run changes
it, and a rounded or summed number ("about 9 %", "0.8-8 ms") cannot be found anywhere. This script holds every
figure against its artifact, so a page cannot say what no committed file shows.

The rules (docs/development.md#figures-in-the-docs has them for writers):

1. **What is a figure.** Outside inline code, links' targets and HTML comments, a figure is
   - a number followed by a unit: ns, µs, us, ms, s, sec, second(s), min, minute(s), h, hour(s), KiB, MiB, GiB,
     kB, KB, MB, GB, %, or x (or the multiplication sign) written against the number ("5x", "1.1-1.7x");
   - a measured ratio without a unit: a decimal with three or more decimal places (1.064), a range of two decimals
     (0.90-1.06) and every number inside square brackets next to one ([1.03-1.12]).
   A range ("0.8-8 ms", "10-20 minutes") is two figures. Not figures: dotted versions (1.6.0, 2.13.0+cpu),
   scientific notation (8.9e-16), a number right after a comparison (<= 1.05, >= 3,000), a range right after a
   package name (torch 2.0-2.4), a confidence level (95% CI, 95 % confidence interval), and numbers inside
   inline code. Fenced code blocks are checked like prose.
2. **Where its artifact is named.** A figure's block is its paragraph, list item, table (all rows) or fenced code
   block. A table, a code block or a list also belongs to the paragraph just before it (its lead-in), and every
   block of a generated region (between ``<!-- name:begin -->`` and ``<!-- name:end -->`` markers, which a script
   writes from one artifact) also belongs to the region's first block. The block must link to, or name in
   backticks, a file (or folder) under ``results/`` or ``benchmarks/results/`` that exists and is not git-ignored.
3. **The figure must be in it as written**: the same digits, after dropping thousands separators (1,417 ->
   1417) and signs. One of the named artifacts must contain it as a whole number token (1.06 is not found in
   1.064, 8 is not found in 8.087).
4. **Provenance.** Every artifact that a figure is found in must state its command, commit and machine load: its
   text has the word "command", the word "commit" followed by a hash, and the word "load".
5. **Not measured.** A number that looks like a figure but is not a measurement (a timeout, a target) is allowed
   by an HTML comment that quotes it: ``<!-- not-measured: 120 s; 5 % -->`` on the same line, or on a line of
   its own just before a block (for a code block, where comments do not render). Quote it as the failure
   message prints it.

Usage: ``python scripts/check_figures.py [--root DIR] [PAGE ...]``; exit status 0 if every figure passes, 1
otherwise, with one line per failure: ``page:line: 'figure': why``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARTIFACT_DIRS = ("results/", "benchmarks/results/")

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s")
_LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+")
_TABLE_ROW = re.compile(r"^\s*\|")
_COMMENT = re.compile(r"<!--(.*?)-->", re.S)
_ALLOW = re.compile(r"<!--\s*not-measured:(.*?)-->", re.S)
_COMMENT_ALONE = re.compile(r"^\s*<!--.*-->\s*$")
_ALLOW_ALONE = re.compile(r"^\s*<!--\s*not-measured:.*-->\s*$")
_REGION_BEGIN = re.compile(r"^\s*<!--\s*[\w./-]+:begin\s*-->\s*$")
_REGION_END = re.compile(r"^\s*<!--\s*[\w./-]+:end\s*-->\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_INLINE_CODE_ACROSS_LINES = re.compile(r"(`+)(.+?)\1", re.S)  # a block's text: code spans may wrap
_LINK_TARGET = re.compile(r"\]\(\s*<?([^)\s>]+)>?[^)]*\)")
_HREF = re.compile(r"""\bhref\s*=\s*["']([^"']+)["']""", re.I)

_NUM = r"\d{1,3}(?:[,\u202f\u2009]\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_UNITS = r"ns|µs|μs|us|ms|sec|seconds?|s|minutes?|min|hours?|h|KiB|MiB|GiB|kB|KB|MB|GB|%"  # spaced or not
_DASH = r"\s?[-\u2013]\s?"
_FIGURE_WITH_UNIT = re.compile(
    rf"(?<![\w.\-/])((?:{_NUM}){_DASH})?({_NUM})(?:(?:\s?(?:{_UNITS}))(?![\w])|[x\u00d7](?![\w]))"
)
_DECIMAL_RANGE = re.compile(rf"(?<![\w.\-/])(\d+\.\d+){_DASH}(\d+\.\d+)(?![\w.]*\d)")
_LONG_DECIMAL = re.compile(r"(?<![\w.\-/])(\d+\.\d{3,})(?![\w.]*\d)")
_BRACKETED = re.compile(rf"(?<![\w.])({_NUM})?\s*\[\s*({_NUM})\s*(?:[-\u2013,]|to)\s*({_NUM})\s*\]")
_VERSION_WORDS = re.compile(
    r"(?:torch|pytorch|torchmetrics|python|pytest|tox|tox-uv|wrapt|packaging|lightning|setuptools|numpy|cuda"
    r"|nccl|gloo|glibc|linux|ubuntu|version|versions|v)\s*$",
    re.I,
)
_BOUND = re.compile(r"(?:<=?|>=?|≤|≥|==|~=)\s*$")
_CONFIDENCE = re.compile(r"^\s*(?:CI\b|confidence)", re.I)
_THOUSANDS = re.compile(r"(?<=\d)[,\u202f\u2009](?=\d{3}(?!\d))")
_NUMBER_TOKEN = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?![\d])(?!\.\d)")
_COMMAND = re.compile(r"\bcommand|(?:^|`|\$ )(?:python3?|torchrun|tox|bash|pytest|\.ci/run) ", re.I | re.M)
_COMMIT = re.compile(r"commit\W{0,6}[0-9a-f]{7,40}\b", re.I)


@dataclass
class Block:
    """A paragraph, list item, table, fenced code block or heading: the unit whose text must name the artifact."""

    kind: str
    lines: list[tuple[int, str]] = field(default_factory=list)
    lead: Block | None = None
    allowed: set[str] = field(default_factory=set)
    region: Block | None = None  # the first block of the generated region this block stands in, if any

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


@dataclass(frozen=True)
class Figure:
    """One figure as written on the page, and the numbers in it that must be found in the artifact."""

    line: int
    text: str
    numbers: tuple[str, ...]


def blocks(text: str) -> list[Block]:
    """Split a Markdown page into blocks, each with the lead-in paragraph it belongs to (see rule 2)."""
    found: list[Block] = []
    current: Block | None = None
    previous: Block | None = None  # the last finished block, if only blank lines followed it
    list_lead: Block | None = None
    fence = ""
    pending_allow: set[str] = set()
    in_region = False
    region_first: Block | None = None

    def close() -> None:
        nonlocal current, previous
        if current is not None:
            found.append(current)
            previous = current
        current = None

    def start(kind: str, lead: Block | None) -> Block:
        nonlocal pending_allow, region_first
        close()
        block = Block(kind, lead=lead, allowed=pending_allow)
        pending_allow = set()
        if in_region:
            if region_first is None:
                region_first = block
            else:
                block.region = region_first
        return block

    def lead_in() -> Block | None:
        return previous if previous is not None and previous.kind in ("paragraph", "item") else None

    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if fence:
            assert current is not None
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = ""
                close()
            else:
                current.lines.append((number, line))
            continue
        if match:
            current = start("code", lead_in())
            fence = match.group(1)
            continue
        if not line.strip():
            close()
            continue
        if _ALLOW_ALONE.match(line):
            close()
            pending_allow |= allowed_figures(line)
            continue
        if _REGION_BEGIN.match(line) or _REGION_END.match(line):
            close()
            in_region, region_first = bool(_REGION_BEGIN.match(line)), None
            continue
        if _COMMENT_ALONE.match(line):  # any other comment alone on its line: neither a block nor a break
            continue
        if _HEADING.match(line):
            current = start("heading", None)
            list_lead = None
        elif _TABLE_ROW.match(line):
            if current is None or current.kind != "table":
                current = start("table", lead_in())
        elif _LIST_ITEM.match(line):
            continuing = (current is not None and current.kind == "item") or (
                current is None and previous is not None and previous.kind == "item"
            )
            if not continuing:
                list_lead = current if current is not None and current.kind == "paragraph" else lead_in()
            current = start("item", list_lead)
        elif current is None:
            current = start("paragraph", None)
            list_lead = None
        current.lines.append((number, line))
        current.allowed |= allowed_figures(line)
    close()
    return found


def allowed_figures(line: str) -> set[str]:
    """The figures a ``<!-- not-measured: a; b -->`` comment on this line quotes."""
    allowed: set[str] = set()
    for body in _ALLOW.findall(line):
        allowed.update(normal(part) for part in re.split(r";|,\s", body) if part.strip())
    return allowed


def normal(figure: str) -> str:
    return re.sub(r"\s+", " ", figure.strip())


def number_value(number: str) -> str:
    """A number as it is compared: no thousands separators."""
    return _THOUSANDS.sub("", number)


def prose(line: str) -> str:
    """The line without HTML comments, link targets and inline code (replaced by spaces, so columns stay)."""
    blank = lambda m: " " * len(m.group(0))  # noqa: E731
    line = line.replace("+-", "\u00b1 ")  # "+-5-15 %" reads as "± 5-15 %"
    line = _COMMENT.sub(blank, line)
    line = _LINK_TARGET.sub(lambda m: "](" + " " * (len(m.group(0)) - 3) + ")", line)
    return _INLINE_CODE.sub(blank, line)


def figures(number: int, line: str) -> list[Figure]:
    """The figures on one line (rule 1), left to right, each once."""
    text = prose(line)
    spans: list[tuple[int, int, tuple[str, ...]]] = []

    def taken(start: int, end: int) -> bool:
        return any(start < e and s < end for s, e, _ in spans)

    def after_bound(start: int) -> bool:  # <= 1.05, >= 3,000: a target or a bound, not a measurement
        return bool(_BOUND.search(text[:start]))

    def after_package(start: int) -> bool:  # torch 2.0-2.4: versions (only unitless figures can be versions)
        return bool(_VERSION_WORDS.search(text[:start]))

    for match in _BRACKETED.finditer(text):
        spans.append((match.start(), match.end(), tuple(n for n in match.groups() if n)))
    for match in _FIGURE_WITH_UNIT.finditer(text):
        start, end = match.span()
        if taken(start, end) or after_bound(start):
            continue
        if match.group(0).endswith("%") and _CONFIDENCE.match(text[end:]):  # 95% CI: a confidence level
            continue
        numbers = tuple(re.sub(_DASH + "$", "", n) for n in (match.group(1), match.group(2)) if n)
        spans.append((start, end, numbers))
    for pattern in (_DECIMAL_RANGE, _LONG_DECIMAL):
        for match in pattern.finditer(text):
            start, end = match.span()
            if not (taken(start, end) or after_bound(start) or after_package(start)):
                spans.append((start, end, tuple(match.groups())))
    out = []
    for start, end, numbers in sorted(spans):
        if re.match(r"[eE][-+]?\d", text[end : end + 3]):  # scientific notation: 8.9e-16
            continue
        out.append(Figure(number, normal(text[start:end]), tuple(number_value(n) for n in numbers)))
    return out


def named_artifacts(block: Block, page: Path, root: Path) -> list[str]:
    """Paths under results/ or benchmarks/results/ that the block (or its lead-in) links to or names in backticks,
    relative to the root: links resolved from the page, backticked names from the root (or the page)."""
    names: list[str] = []
    for part in (block, block.lead, block.lead.lead if block.lead else None, block.region):
        if part is None:
            continue
        text = part.text()
        candidates = [(target, True) for target in _LINK_TARGET.findall(text) + _HREF.findall(text)]
        candidates += [(code.strip(), False) for _, code in _INLINE_CODE_ACROSS_LINES.findall(text)]
        for target, is_link in candidates:
            target = target.split("#", 1)[0].split("?", 1)[0]
            if not target or "://" in target:
                continue
            bases = [page.parent] if is_link else [root, page.parent]
            for base in bases:
                try:
                    relative = (base / target).resolve().relative_to(root.resolve()).as_posix()
                except ValueError:
                    continue
                if relative.startswith(ARTIFACT_DIRS) and relative not in names:
                    names.append(relative)
                    break
    return names


def committed(path: str, root: Path) -> bool:
    """False if git ignores the path (so it cannot be committed); True outside a git work tree."""
    if not (root / ".git").exists():
        return True
    result = subprocess.run(
        ["git", "-C", str(root), "check-ignore", "-q", path], capture_output=True, check=False, timeout=30
    )
    return result.returncode != 0


def artifact_files(path: str, root: Path) -> list[Path]:
    """The files a name stands for: the file, every file in a folder, or every match of a ``*`` pattern."""
    targets = sorted(root.glob(path)) if "*" in path else [root / path]
    files = []
    for target in targets:
        files += sorted(p for p in target.rglob("*") if p.is_file()) if target.is_dir() else [target]
    return [file for file in files if file.is_file()]


def number_tokens(text: str) -> set[str]:
    return set(_NUMBER_TOKEN.findall(number_value(text)))


def provenance_gaps(text: str) -> list[str]:
    missing = []
    if not _COMMAND.search(text):
        missing.append("its command")
    if not _COMMIT.search(text):
        missing.append("its commit")
    if not re.search(r"load", text, re.I):  # load average, loadavg, load_average
        missing.append("the machine load")
    return missing


def check_page(page: Path, root: Path) -> list[str]:
    """Every failure on one page, as ``page:line: 'figure': why``."""
    problems: list[str] = []
    shown = page.resolve().relative_to(root.resolve()).as_posix()
    cache: dict[Path, tuple[set[str], list[str]]] = {}
    reported: set[Path] = set()
    for block in blocks(page.read_text(encoding="utf-8")):
        found = [f for n, line in block.lines for f in figures(n, line)]
        found = [f for f in found if f.text not in block.allowed]
        if not found:
            continue
        names = named_artifacts(block, page, root)
        usable: list[str] = []
        for name in names:
            if not artifact_files(name, root):
                problems.append(f"{shown}:{block.lines[0][0]}: names `{name}`, which does not exist")
            elif not committed(name, root):
                problems.append(f"{shown}:{block.lines[0][0]}: names `{name}`, which git ignores (not committed)")
            else:
                usable.append(name)
        for figure in found:
            where = f"{shown}:{figure.line}: '{figure.text}'"
            if not usable:
                problems.append(
                    f"{where}: its {block.kind} names no artifact (link or name in backticks a committed file "
                    f"under {' or '.join(ARTIFACT_DIRS)} that shows it; if it is not a measurement: "
                    f"<!-- not-measured: {figure.text} -->)"
                )
                continue
            files = [file for name in usable for file in artifact_files(name, root)]
            for file in files:
                if file not in cache:
                    text = file.read_text(encoding="utf-8", errors="replace")
                    cache[file] = (number_tokens(text), provenance_gaps(text))
            missing = [n for n in figure.numbers if not any(n in cache[file][0] for file in files)]
            if missing:
                problems.append(
                    f"{where}: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in "
                    f"{', '.join(usable)} "
                    "(write it with the artifact's digits, or name the artifact that shows it)"
                )
                continue
            holders = [file for file in files if all(n in cache[file][0] for n in figure.numbers)]
            if holders and all(cache[file][1] for file in holders) and holders[0] not in reported:
                reported.add(holders[0])
                gaps = ", ".join(cache[holders[0]][1])
                problems.append(
                    f"{where}: {holders[0].relative_to(root).as_posix()} does not state {gaps} "
                    "(said once per page, for the first figure found in it)"
                )
    return problems


def default_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def check(pages: Iterable[Path], root: Path) -> list[str]:
    return [problem for page in pages for problem in check_page(page, root)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("pages", nargs="*", type=Path, help="pages to check (default: README.md and docs/*.md)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    pages = [page.resolve() for page in args.pages] or default_pages(root)
    problems = check(pages, root)
    for problem in problems:
        print(problem)
    count = len(pages)
    print(f"{len(problems)} problem(s) in {count} page(s)" if problems else f"every figure in {count} page(s) found")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
