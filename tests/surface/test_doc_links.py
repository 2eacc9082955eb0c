"""What the repository's documents point at exists: relative links resolve inside the repository,
anchors name a heading, and the BENCHMARKS.md sections, tests and `stragglers` commands and
options they cite are there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# [text](target) with a target that is not a URL or an in-page anchor.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# BENCHMARKS.md, "Section title" / BENCHMARKS.md ("Section title"): a section cited by its title.
CITED = re.compile(r"BENCHMARKS\.md,? \(?\"([^\"]+)\"")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


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


def headings(text: str) -> list[str]:
    """The Markdown headings of a page's text, outside code blocks, as written."""
    return re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", text), re.M)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered -1, -2, ... (as benchmarks/render_benchmarks.py writes)."""
    seen: dict[str, int] = {}
    out = set()
    for title in headings(text):
        base = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_anchors_follow_githubs_rule() -> None:
    """The anchor rule itself: punctuation and backticks go, repeats are numbered, code is no
    heading."""
    text = "# A `b`: c (issue 4, 13)\n```sh\n# not a heading\n```\n## A `b`: c (issue 4, 13)\n"
    assert anchors(text) == {"a-b-c-issue-4-13", "a-b-c-issue-4-13-1"}


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
    code = [p for folder in ("src", "benchmarks", "examples", "docs")
            for p in sorted((REPO / folder).rglob("*.py"))]
    hits = [str(p.relative_to(REPO)) for p in documents() + code if "shared/specs" in p.read_text()]
    assert not hits, f"references to ../shared/specs in {hits}"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_anchors_name_a_heading(doc: Path) -> None:
    """`page.md#section` and `#section` lead to a heading that exists (a renamed heading or
    benchmark title breaks them silently on GitHub)."""
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or "#" not in target:
            continue
        name, anchor = target.split("#", 1)
        page = (doc.parent / name).resolve() if name else doc
        if page.suffix == ".md" and page.is_file() and anchor not in anchors(page.read_text()):
            bad.append(target)
    assert not bad, f"{doc.relative_to(REPO)}: anchors with no heading {bad}"


@pytest.mark.parametrize("doc", [d for d in documents() if d.name != "CHANGELOG.md"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_cited_benchmark_sections_exist(doc: Path) -> None:
    """A document that sends a reader to BENCHMARKS.md by a section's title names one that is
    there (or the start of one); the changelog keeps the titles of its day."""
    titles = [" ".join(t.split()) for t in headings((REPO / "BENCHMARKS.md").read_text())]
    cited = [" ".join(t.split()) for t in CITED.findall(doc.read_text())]
    missing = [c for c in cited if not any(t.startswith(c) for t in titles)]
    assert not missing, f"{doc.relative_to(REPO)}: BENCHMARKS.md has no section {missing}"


def test_cited_tests_exist() -> None:
    """A test a document names as evidence (`test_...`) is one the suite has: a renamed or
    deleted test leaves a claim without its check."""
    defined = {name for path in (REPO / "tests").rglob("*.py")
               for name in re.findall(r"def (test_\w+)", path.read_text())}
    missing = []
    for doc in documents():
        if doc.name == "CHANGELOG.md":   # the changelog keeps the names of its day
            continue
        # a name not part of a file name (test_x.py) or a path
        for name in re.findall(r"(?<![\w/])(test_\w+)(?![\w.]*\.py)", doc.read_text()):
            if name not in defined:
                missing.append(f"{doc.relative_to(REPO)}: {name}")
    assert not missing, f"documents name tests that do not exist: {sorted(set(missing))}"


# `stragglers sub [sub] ARGS --option ...` in a document (code block or inline code), up to a
# backtick, a pipe, `;`, `&` or `)`; backslash-continued lines are joined first.
COMMAND = re.compile(r"(?<![\w./-])stragglers((?: +[^\s`|;&)]+)+)")


def _options(command) -> set[str]:
    """Every spelling of every option of a click command, --help included."""
    out = {"--help", "-h"}
    for param in command.params:
        out.update(getattr(param, "opts", []))
        out.update(getattr(param, "secondary_opts", []))
    return out


@pytest.mark.slow   # builds the whole click command tree (0.7 s)
def test_documented_commands_and_options_exist() -> None:
    """Each `stragglers ...` a document shows names commands and options the CLI has (a renamed
    option would leave a reader with an error): sub-commands are followed from the root,
    options checked against the command reached; what follows `--` is another program's."""
    import typer.main

    from stragglers.cli import app

    root = typer.main.get_command(app)
    bad, checked = [], 0
    for doc in documents():
        if doc.name == "CHANGELOG.md":
            continue
        for line in re.sub(r"\\\n\s*", " ", doc.read_text()).splitlines():
            for match in COMMAND.finditer(line):
                tokens = match.group(1).split()
                command, path = root, []
                for token in tokens:
                    subs = getattr(command, "commands", None) or {}
                    if token not in subs:
                        break
                    command = subs[token]
                    path.append(token)
                if not path:   # prose ("stragglers in a job"), not a command
                    continue
                rest = tokens[len(path):]
                rest = rest[:rest.index("--")] if "--" in rest else rest
                named = [re.match(r"--?[a-zA-Z][\w-]*", t.lstrip("[")) for t in rest]
                unknown = [m.group() for m in named if m and m.group() not in _options(command)]
                checked += 1
                if unknown:
                    bad.append(f"{doc.relative_to(REPO)}: stragglers {' '.join(path)} {unknown}")
    assert checked > 20, f"only {checked} commands found in the documents: is the pattern right?"
    assert not bad, f"documented options the CLI does not have: {bad}"


def test_section_numbers_name_a_section() -> None:
    """`docs/x.md §N` (in a document or a docstring) names a numbered section `## N.` of that page:
    renumbering a design page must not leave the code pointing at the wrong contract."""
    numbered = {page.name: set(re.findall(r"^## (\d+)\.", page.read_text(), re.M))
                for page in (REPO / "docs").glob("*.md")}
    sources = documents() + [p for folder in ("src", "benchmarks", "examples", "tests")
                             for p in sorted((REPO / folder).rglob("*.py"))]
    bad, checked = [], 0
    for source in sources:
        if source.name == "CHANGELOG.md":
            continue
        for name, first, last in re.findall(r"([\w-]+\.md)\)?\s*§\s*(\d+)(?:[–-](\d+))?",
                                            source.read_text()):
            if name not in numbered:
                continue
            checked += 1
            bad += [f"{source.relative_to(REPO)}: {name} §{n}" for n in (first, last)
                    if n and n not in numbered[name]]
    assert checked > 20, f"only {checked} section references found: is the pattern right?"
    assert not bad, f"references to sections that do not exist: {bad}"
