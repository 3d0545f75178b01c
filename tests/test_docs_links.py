"""Every relative link in README.md, CHANGELOG.md and docs/ resolves: the file exists, and a ``#fragment`` names a
heading (or an explicit ``<a id>``) of the target page, as GitHub renders it. The pages name no run records
(``results/`` is git-ignored) and no commit hashes.

Links are read from Markdown (``[text](target)``, ``![alt](target)``, ``[id]: target``) and from HTML ``href`` /
``src`` attributes, outside fenced code blocks and inline code. Absolute URLs are not fetched.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests._subprocess import ROOT

pytestmark = pytest.mark.once

PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+).+?\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HTML_ATTR = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_HTML_ID = re.compile(r"""<a\s+[^>]*\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
#: a word of 7 to 40 hex digits with both a digit and a letter: what a commit hash looks like
_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def prose_lines(text: str, *, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code removed unless ``keep_code``."""
    lines, fence = [], ""
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match and (not fence or (match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence))):
            fence = "" if fence else match.group(1)
            continue
        if not fence:
            lines.append((number, line if keep_code else _INLINE_CODE.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(page.read_text(), keep_code=True):
        found.update(_HTML_ID.findall(line))
        if match := _HEADING.match(line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(page.read_text()):
        for pattern in (_INLINE_LINK, _REFERENCE, _HTML_ATTR):
            found += [(number, target) for target in pattern.findall(line)]
    return found


def broken(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in links(page):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # absolute URL (https:, mailto:, ...)
        path_part, _, fragment = target.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        destination = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not destination.is_relative_to(root):
            problems.append(f"{where}: points outside the repository")
        elif not destination.exists():
            problems.append(f"{where}: {destination.relative_to(root)} does not exist")
        elif fragment and destination.suffix == ".md" and unquote(fragment) not in anchors(destination):
            problems.append(f"{where}: no heading #{fragment} in {destination.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert not broken(page), "\n".join(broken(page))


def records_and_hashes(page: Path) -> list[str]:
    """Lines of ``page`` (code included) that name a run record or a commit hash."""
    return [
        f"{page.name}:{number}: {line.strip()}"
        for number, line in prose_lines(page.read_text(), keep_code=True)
        if _HASH.search(line) or re.search(r"(?<![\w/])(benchmarks/)?results/(?!raw/)", line)
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_name_no_run_records_and_no_commits(page: Path) -> None:
    assert not records_and_hashes(page), "\n".join(records_and_hashes(page))


def test_the_record_check_finds_a_record_and_a_hash(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    fake_hash = "ab12" * 2  # built here, so this file cites no hash itself
    page.write_text(f"See `results/ci/run.json`.\nFixed in {fake_hash}.\nWritten to results/raw/<env>.json.\n")
    assert [line.split(":")[1] for line in records_and_hashes(page)] == ["1", "2"]


def test_the_pages_are_found() -> None:
    assert ROOT / "README.md" in PAGES and any(page.parent.name == "docs" for page in PAGES), PAGES


def test_the_checker_finds_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    """The check can fail: in a tree of its own, a missing file and a missing heading are reported; links in code,
    absolute URLs, GitHub's heading slugs (punctuation dropped, duplicates numbered) and links upward pass."""
    (tmp_path / "README.md").write_text("# Read me\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Title: with `code`, punctuation & more\n\n## Same\n\n## Same\n\n"
        "[ok](#title-with-code-punctuation--more) [ok](#same-1) [ok](../README.md#read-me) [web](https://x.org/y)\n"
        "[gone](no-such-page.md) [bad anchor](../README.md#nowhere) `[in code](missing.md)`\n"
        "[outside](../../elsewhere.md)\n\n"
        "```\n[in a fence](missing-too.md)\n```\n"
    )
    problems = broken(page, root=tmp_path)
    assert len(problems) == 3, problems
    assert "docs/no-such-page.md does not exist" in problems[0]
    assert "no heading #nowhere in README.md" in problems[1]
    assert "points outside the repository" in problems[2]
