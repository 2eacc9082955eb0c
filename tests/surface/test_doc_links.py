"""Every relative link in the repository's documents points at a file inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# [text](target) with a target that is not a URL or an in-page anchor.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    """The Markdown files a reader of the repository meets."""
    top = [REPO / n for n in ("README.md", "BENCHMARKS.md", "CHANGELOG.md")]
    return [p for p in top if p.exists()] + sorted((REPO / "docs").glob("*.md")) + sorted(
        p for p in (REPO / "src").rglob("README.md")) + [REPO / "tests" / "README.md"]


def relative_links(path: Path) -> list[str]:
    """Link targets in `path` that name a file (no scheme, no bare anchor)."""
    out = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve_inside_the_repository(doc: Path) -> None:
    """A link that leaves the repository or names a missing file is a broken document."""
    bad = []
    for target in relative_links(doc):
        resolved = (doc.parent / target).resolve()
        if not resolved.is_relative_to(REPO):
            bad.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            bad.append(f"{target} (missing)")
    assert not bad, f"{doc.relative_to(REPO)}: broken links {bad}"


def test_no_document_points_at_the_shared_specs() -> None:
    """The design lives in docs/: nothing may send a reader to ../shared/specs."""
    hits = [str(p.relative_to(REPO)) for p in documents() + sorted((REPO / "src").rglob("*.py"))
            if "shared/specs" in p.read_text()]
    assert not hits, f"references to ../shared/specs in {hits}"
