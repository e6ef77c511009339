"""Every doc the repository cites exists, and README.md stays a short front door.

A citation is a repository path ``docs/<folders>/<name>.md`` anywhere in a source, script,
config or doc file (docstrings, comments, messages, results tables), or a relative Markdown
link ``[text](path)`` in README.md or a page under ``docs/`` (generated reports in
``bench/results/`` are not held to it). Moving or renaming a note without updating its citations
fails here, naming the citing file and line.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
CITING_SUFFIXES = {".py", ".sh", ".sbatch", ".md", ".toml"}
SKIPPED_DIRS = {"__pycache__", "outputs", "node_modules", "build", "dist"}
# A repository path, not the tail of a URL or of another path (``pytorch.org/docs/...``).
DOC_PATH = re.compile(r"(?<![\w./-])docs/(?:[\w-]+/)*\w[\w.-]*?\.md\b")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _citing_files() -> list[Path]:
    """The project's text files: hidden folders (``.git``, a ``.venv``), virtual
    environments and run outputs are not walked; ``.ci`` is."""
    found, stack = [], [REPO]
    while stack:
        folder = stack.pop()
        for path in sorted(folder.iterdir()):
            if path.is_dir():
                hidden = path.name.startswith(".") and path.name != ".ci"
                if not (hidden or path.name in SKIPPED_DIRS or (path / "pyvenv.cfg").exists()):
                    stack.append(path)
            elif path.suffix in CITING_SUFFIXES or path.parent.name == ".ci":
                found.append(path)
    return found


def _lines(path: Path):
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return
    yield from enumerate(text.splitlines(), start=1)


def test_every_cited_docs_path_exists():
    files = _citing_files()
    assert any(p.name == "README.md" and p.parent == REPO for p in files), files[:5]
    dangling, cited = [], 0
    for path in files:
        for number, line in _lines(path):
            for target in DOC_PATH.findall(line):
                cited += 1
                if not (REPO / target).is_file():
                    dangling.append(f"{path.relative_to(REPO)}:{number}: {target}")
    assert cited, "no docs/...md citation found: the pattern or the walk is broken"
    assert not dangling, "cited docs that do not exist:\n" + "\n".join(dangling)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page``: lower case, punctuation but ``-`` and
    ``_`` dropped, spaces as ``-``."""
    anchors, in_code = set(), False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        if not in_code and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def test_relative_markdown_links_resolve():
    dangling, links = [], 0
    for path in _citing_files():
        in_docs = path == REPO / "README.md" or (REPO / "docs") in path.parents
        if path.suffix != ".md" or not in_docs:
            continue
        for number, line in _lines(path):
            for target in MD_LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:|#", target):  # a URL or an anchor in the page
                    continue
                links += 1
                file_part, _, anchor = target.partition("#")
                linked = path.parent / file_part
                if not linked.exists():
                    dangling.append(f"{path.relative_to(REPO)}:{number}: {target}")
                elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                    dangling.append(f"{path.relative_to(REPO)}:{number}: {target} (no heading)")
    assert links, "no relative Markdown link found: the pattern or the walk is broken"
    assert not dangling, "relative links to nothing (or to no heading):\n" + "\n".join(dangling)


def test_readme_is_at_most_300_lines():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to a "
        "page of docs/guide/ and link it"
    )


def test_the_guide_and_the_design_record_have_an_index():
    for index in ("docs/guide/README.md", "docs/design/README.md"):
        text = (REPO / index).read_text()
        folder = (REPO / index).parent
        pages = {p.name for p in folder.glob("*.md")} - {"README.md"}
        linked = set(MD_LINK.findall(text))
        assert pages <= linked, f"{index} does not link {sorted(pages - linked)}"


def test_docs_holds_the_guide_and_the_design_record_only():
    loose = sorted(p.name for p in (REPO / "docs").iterdir() if p.is_file())
    assert not loose, (
        f"files directly under docs/: {loose}; a dated note goes to docs/design/ (and a line "
        "in docs/design/README.md), a user page to docs/guide/ (and a row in its README.md)"
    )
