"""The benchmarks' results are one folder per benchmark (benchmarks/results/<benchmark>/),
every results file the READMEs cite is there, and the READMEs' relative links (and their
#anchors into other Markdown pages) resolve."""

import re
from pathlib import Path

from tests.support.paths import REPO

RESULTS = REPO / "benchmarks" / "results"
DOCS = ("cli.md", "agents.md", "distributed.md", "how-it-works.md", "development.md")
PAGES = [
    REPO / "README.md",
    REPO / "benchmarks" / "README.md",
    *(REPO / "docs" / name for name in DOCS),
    *sorted((REPO / "docs" / "notes").rglob("*.md")),
]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_results_are_one_folder_per_benchmark():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file()]
    assert loose == [], f"results files outside a benchmark's folder: {loose}"
    assert all(any(d.iterdir()) for d in RESULTS.iterdir())


def test_cited_results_files_exist():
    for page in PAGES:
        text = page.read_text()
        cited = re.findall(
            r"(?<![\w/.-])(?:benchmarks/)?(?:results/)?([a-z0-9_]+/[a-z0-9_]+\.(?:jsonl|png))\b",
            text,
        )
        missing = sorted({c for c in cited if not (RESULTS / c).exists()})
        assert missing == [], f"{page.relative_to(REPO)} cites absent results: {missing}"


def test_relative_links_resolve():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (page.parent / target) if target else page
            assert path.exists(), f"{page.relative_to(REPO)}: broken link {target}"
            if anchor and path.suffix == ".md":
                assert anchor[1:] in anchors(path), f"{page.relative_to(REPO)}: no {target}{anchor}"
