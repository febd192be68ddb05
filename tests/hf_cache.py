"""A model folder written into a Hugging Face cache the way huggingface_hub lays one out.

``models--org--name/blobs/<hash>`` holds each file once, ``snapshots/<commit>/<file>``
is a relative link to its blob and ``refs/main`` names the commit (huggingface_hub's
``file_download``: ``repo_folder_name``, ``_create_symlink``). The tests check the
result with huggingface_hub's own readers (``scan_cache_dir``, ``snapshot_download``
with ``local_files_only``) and with mlx-lm loading it by id.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_file(cache: Path, repo_id: str, name: str, data: bytes, commit: str = COMMIT) -> Path:
    """Store one file of ``repo_id`` at ``commit`` (and point ``refs/main`` at it)."""
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(cache) / repo_folder_name(repo_id=repo_id, repo_type="model")
    blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = storage / "snapshots" / commit / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return link


def save(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT, skip=()) -> Path:
    """Store every file of ``folder`` (except ``skip``) as ``repo_id``; returns the
    snapshot folder."""
    for file in sorted(Path(folder).iterdir()):
        if file.is_file() and file.name not in skip:
            add_file(cache, repo_id, file.name, file.read_bytes(), commit)
    from huggingface_hub.file_download import repo_folder_name

    return Path(cache) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / commit
