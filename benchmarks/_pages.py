"""Write a benchmark's figures into a page between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers.

A page region carries figures and the artifact they come from, nothing else: targets and verdicts stay in the
artifact (``benchmarks/results/``) and its README, the run's command, commit and load in the artifact's first line.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def artifact_name(path: Path) -> str:
    """How a page names an artifact: relative to the repository root (absolute if it lies outside it)."""
    resolved = path.resolve()
    return resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(resolved)


def replace_region(page: Path, name: str, body: str) -> bool:
    """Put ``body`` between the ``name`` markers of ``page``; ``False`` (page untouched) if it has no such pair."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = page.read_text()
    if text.count(begin) != 1 or text.count(end) != 1:
        return False
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    page.write_text(f"{head}{begin}\n{body.strip()}\n{end}{tail}")
    return True
