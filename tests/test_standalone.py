"""The repository stands on its own: it carries the texts it evaluates on, and no
tracked file points at files outside it."""

import hashlib
import json
import re
import subprocess

from tests.support.paths import DATA, REPO

# Built from parts so this file does not match itself.
OUTSIDE = re.compile(r"\.\./" + "shared" + r"|" + "DESIGN" + r"(\.md| section)")


def tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return out.split()


def test_no_tracked_file_points_outside_the_repository():
    files = tracked_files()
    assert "README.md" in files  # the listing really is the repository's
    offenders = []
    for name in files:
        data = (REPO / name).read_bytes()
        if b"\0" in data:
            continue  # binary (plots, tensors)
        for i, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{name}:{i}: {line.strip()[:80]}")
    assert not offenders, "\n".join(offenders)


def test_the_carried_texts_match_their_manifest():
    manifest = json.loads((DATA / "MANIFEST.json").read_text())
    assert {entry["file"] for entry in manifest} >= {"moby_dick.txt", "alice_in_wonderland.txt"}
    for entry in manifest:
        data = (DATA / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"], entry["file"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
        assert entry["license"] and entry["source"]
