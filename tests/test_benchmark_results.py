"""The benchmarks' results are one folder per benchmark (benchmarks/results/<benchmark>/),
every results file the READMEs, docs/ and docs/notes/ cite is there (or, cited as
`COMMIT:benchmarks/results/...`, in git), benchmarks/README.md cites every file there (a
run it does not cite is superseded: git keeps it), and the pages' relative links (and
their #anchors into other Markdown pages) resolve."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

RESULTS = REPO / "benchmarks" / "results"
BENCH_README = REPO / "benchmarks" / "README.md"
NOTES = REPO / "docs" / "notes"
PAGES = [
    REPO / "README.md",
    BENCH_README,
    *sorted((REPO / "docs").glob("*.md")),
    *sorted(NOTES.rglob("*.md")),
]
# A results path as the pages write it: results/NAME/FILE, benchmarks/results/NAME/FILE
# or NAME/FILE; not one that is part of a longer path or a `COMMIT:path` git citation.
CITED = re.compile(
    r"(?<![\w/.:-])(benchmarks/results/|results/)?([a-z0-9_]+)/([\w-]+\.(?:jsonl|png))\b"
)
# A run removed from the tree, cited where git keeps it: `git show COMMIT:benchmarks/results/...`.
IN_GIT = re.compile(r"\b([0-9a-f]{7,40}):benchmarks/results/([\w/.-]+?\.(?:jsonl|png))\b")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def cited_results(text: str) -> set[str]:
    """NAME/FILE for every results file the text names (NAME a benchmark's folder, or the
    path spelled out from results/)."""
    folders = {d.name for d in RESULTS.iterdir() if d.is_dir()}
    return {
        f"{name}/{file}" for prefix, name, file in CITED.findall(text) if prefix or name in folders
    }


def test_results_are_one_folder_per_benchmark():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file()]
    assert loose == [], f"results files outside a benchmark's folder: {loose}"
    assert all(any(d.iterdir()) for d in RESULTS.iterdir())


def test_cited_results_files_exist():
    for page in PAGES:
        cited = cited_results(page.read_text())
        missing = sorted(c for c in cited if not (RESULTS / c).is_file())
        assert missing == [], f"{page.relative_to(REPO)} cites absent results: {missing}"


def test_every_results_file_is_cited_by_the_benchmarks_readme():
    cited = cited_results(BENCH_README.read_text())
    files = {f"{p.parent.name}/{p.name}" for p in RESULTS.rglob("*") if p.is_file()}
    uncited = sorted(files - cited)
    assert uncited == [], (
        f"results files benchmarks/README.md does not cite (superseded runs are removed: "
        f"git keeps them): {uncited}"
    )


def test_results_cited_from_git_history_are_there():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    cited = sorted(
        {
            f"{commit}:benchmarks/results/{path}"
            for p in PAGES
            for commit, path in IN_GIT.findall(p.read_text())
        }
    )
    git = ["git", "-C", str(REPO), "cat-file", "-e"]
    missing = [ref for ref in cited if subprocess.run([*git, ref], capture_output=True).returncode]
    assert missing == [], f"cited from git history, absent there: {missing}"


def test_every_note_is_linked_from_a_page():
    links = "\n".join(p.read_text() for p in PAGES if p.parent != NOTES)
    orphans = [n.name for n in sorted(NOTES.glob("*.md")) if f"notes/{n.name}" not in links]
    assert orphans == [], f"docs/notes/ pages that no page links to: {orphans}"


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
