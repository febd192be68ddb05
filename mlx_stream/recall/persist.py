"""The recall tier on disk: a sidecar folder saved and restored with a prompt cache.

Contract: a cache file ``X.safetensors`` whose caches carry a recall tier has a sidecar
folder ``X.recall/`` beside it (``manifest.json`` with the sha256 and size of every
other file, and one ``.npy`` file per stored segment part, index segment and recent
query block), bound to the cache file by the manifest's sha256 in its metadata
(``KEY``). :func:`stage` writes a new sidecar beside the target and
:meth:`Staged.commit` swaps it in, so a failed or killed save leaves the earlier one
usable. :func:`restore` checks every file, and the saved recall settings against the
run's (one ``UserError`` line each), installs the attention hook and gives the caches a
tier holding the saved store; where the store lives and its RAM budget are the run's
own. Neither passes a large store through memory whole. In full: docs/recall.md ("The
sidecar on disk").
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from mlx_stream import files
from mlx_stream.errors import UserError
from mlx_stream.recall.names import KEY  # noqa: F401  (persist.KEY: the metadata key)

MANIFEST = "manifest.json"
VERSION = 2  # 2: the block summaries in segments (an index), spilled past the RAM budget
#: Versions read: 1 (whole float32 summary tables) is upgraded as it is restored.
READS = (1, 2)
CHUNK = 1 << 20  # bytes per read or write when streaming a file
#: Settings a saved store must share with the run that restores it, as the user knows them
#: (not the prompt's end selector: nothing stored depends on it; the run's chooses).
CHECKED = {
    "blocks": "--recall-blocks",
    "block": "recall block",
    "selector": "recall selector",
    "placement": "recall placement",
    "prompt_placement": "recall prompt placement",
    "bits": "--recall-bits",
    "group_size": "recall group size",
    "refeed": "recall refeed",
}


def sidecar(path: str | os.PathLike) -> Path:
    """The sidecar folder of cache file ``path``: ``X.safetensors`` -> ``X.recall``."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".safetensors") + ".recall")


# ----- files with their checksums ---------------------------------------------------


class _Hashing:
    """A binary file object that hashes what is written through it."""

    def __init__(self, f: Any):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)


class Writer:
    """Files written into one folder, each recorded with its sha256 and size."""

    def __init__(self, folder: Path):
        self.folder, self.files = folder, {}

    def array(self, name: str, array: np.ndarray) -> str:
        """Write ``array`` as ``name`` (``.npy``; numpy writes it in chunks)."""
        with open(self.folder / name, "wb") as f:
            out = _Hashing(f)
            np.lib.format.write_array(out, np.ascontiguousarray(array), allow_pickle=False)
        self.files[name] = {"sha256": out.sha.hexdigest(), "bytes": out.size}
        return name

    def copy(self, name: str, source: Path) -> str:
        """Copy file ``source`` as ``name``, a chunk at a time."""
        with open(source, "rb") as src, open(self.folder / name, "wb") as dst:
            out = _Hashing(dst)
            for chunk in iter(lambda: src.read(CHUNK), b""):
                out.write(chunk)
        self.files[name] = {"sha256": out.sha.hexdigest(), "bytes": out.size}
        return name


class Reader:
    """The files of a saved sidecar, each checked against its manifest entry."""

    def __init__(self, folder: Path, entries: dict):
        self.folder, self.entries = folder, entries

    def _bad(self, name: str, why: str) -> UserError:
        return UserError(f"{self.folder / name}: {why}; the saved recall store is not intact")

    def _entry(self, name: str) -> dict:
        entry = self.entries.get(name) if isinstance(name, str) else None
        if not isinstance(entry, dict) or "/" in name or name.startswith("."):
            raise self._bad(str(name), "not listed in its manifest")
        return entry

    def _stream(self, name: str, out: Any = None) -> None:
        """Read ``name`` (writing it to ``out``) and check its size and sha256."""
        entry, sha, size = self._entry(name), hashlib.sha256(), 0
        try:
            with open(self.folder / name, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    sha.update(chunk)
                    size += len(chunk)
                    if out is not None:
                        out.write(chunk)
        except FileNotFoundError:
            raise self._bad(name, "missing") from None
        except IsADirectoryError:
            raise self._bad(name, "not a file") from None
        if size != entry.get("bytes") or sha.hexdigest() != entry.get("sha256"):
            raise self._bad(name, "checksum mismatch")

    def array(self, name: str, dtype: Any = None, shape: tuple | None = None) -> np.ndarray:
        """The array in ``name``, checked (and its dtype and shape, when given)."""
        self._stream(name)
        try:
            array = np.load(self.folder / name, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise self._bad(name, f"unreadable ({type(e).__name__})") from None
        self._check(name, array, dtype, shape)
        return array

    def copy(self, name: str, target: Path, dtype: Any, shape: tuple) -> Any:
        """Copy ``name`` to ``target`` (checked on the way); a ``store.FileArray`` of it."""
        from mlx_stream.recall.store import FileArray

        with open(target, "wb") as f:
            self._stream(name, f)
        try:
            array = FileArray(target)
        except (OSError, ValueError) as e:
            raise self._bad(name, f"unreadable ({type(e).__name__})") from None
        self._check(name, array, dtype, shape)
        return array

    def _check(self, name: str, array: np.ndarray, dtype: Any, shape: tuple | None) -> None:
        if (dtype is not None and array.dtype != np.dtype(dtype)) or (
            shape is not None and tuple(array.shape) != tuple(shape)
        ):
            raise self._bad(name, f"holds {array.dtype} {array.shape}, not {dtype} {shape}")


# ----- saving -------------------------------------------------------------------------


class Staged:
    """A sidecar written to a temporary folder, not yet in place.

    Attributes:
        binding (str): What the cache file's metadata holds under :data:`KEY`.
    """

    def __init__(self, target: Path, tmp: Path, binding: str):
        self.target, self.tmp, self.binding = target, tmp, binding
        self.old: Path | None = None

    def commit(self) -> None:
        """Put the new sidecar in place (the earlier one moved aside)."""
        if self.target.exists():
            self.old = _aside(self.target)
            os.rename(self.target, self.old)
        os.rename(self.tmp, self.target)

    def finish(self) -> None:
        """Remove the earlier sidecar (after the cache file was replaced), and what a
        save killed between its renames left (only now: until this save is in place,
        that may be the store the cache file names)."""
        if self.old is not None:
            shutil.rmtree(self.old, ignore_errors=True)
        files.remove_stale(self.target, ("old",))

    def discard(self) -> None:
        """Undo: remove the new sidecar's temporary, put an earlier one back."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.old is not None and self.old.exists():
            if self.target.exists():
                shutil.rmtree(self.target, ignore_errors=True)
            os.rename(self.old, self.target)


def _aside(target: Path) -> Path:
    """A new name beside ``target`` for its earlier version (``.X.recall.old-<pid>-*``)."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=files.temp_prefix(target, "old"))
    os.close(fd)
    os.unlink(name)
    return Path(name)


def stage(path: str | os.PathLike, tier: Any, mode: int | None = None) -> Staged:
    """Write the sidecar of cache file ``path`` for ``tier`` into a temporary folder
    (its files with ``mode``, default what the umask gives; the folder with x where r).

    Raises:
        OSError: The folder cannot be written (nothing is left behind).
    """
    target = sidecar(path)
    files.remove_stale(target, ("partial",))  # what a save killed midway left
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=files.temp_prefix(target)))
    try:
        writer = Writer(tmp)
        state = tier.export(writer)
        manifest = {"version": VERSION, "spec": tier.spec.settings(), "tier": state,
                    "files": writer.files}  # fmt: skip
        text = json.dumps(manifest, sort_keys=True).encode()
        with open(tmp / MANIFEST, "wb") as f:
            f.write(text)
        mode = files.file_mode() if mode is None else mode
        for file in tmp.iterdir():
            os.chmod(file, mode)
        os.chmod(tmp, mode | (mode & 0o444) >> 2)  # as the umask gives a folder (x where r)
        binding = {"folder": target.name, "manifest_sha256": hashlib.sha256(text).hexdigest()}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Staged(target, tmp, json.dumps(binding))


def drop(path: str | os.PathLike) -> None:
    """Remove the sidecar of ``path`` (a cache file saved since without recall)."""
    target = sidecar(path)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)


# ----- restoring ----------------------------------------------------------------------


def _manifest(path: Path, binding: str) -> tuple[Path, dict]:
    """The sidecar folder of ``path`` whose manifest the binding names, and the manifest."""
    try:
        bound = json.loads(binding)
        name, sha = bound["folder"], bound["manifest_sha256"]
        if not isinstance(name, str) or "/" in name or not isinstance(sha, str):
            raise ValueError(name)
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path}: its recall store entry is not readable") from None
    folder = path.parent / name
    # The earlier sidecar of a save killed between its renames is still beside it.
    others = sorted(path.parent.glob(files.glob_escape(f".{name}.old-") + "*"))
    for candidate in [folder, *others]:
        with contextlib.suppress(OSError):
            text = (candidate / MANIFEST).read_bytes()
            if hashlib.sha256(text).hexdigest() == sha:
                try:
                    return candidate, json.loads(text)
                except ValueError:
                    break
    if not (folder / MANIFEST).is_file():
        raise UserError(f"{folder}: missing; {path.name} was saved with its recall store")
    raise UserError(f"{folder}: its manifest does not belong to {path.name} (changed since)")


def check_spec(path: Path, saved: Any, current: Any) -> None:
    """A ``UserError`` naming the first recall setting where the saved store and the
    run differ."""
    if not isinstance(saved, dict):
        raise UserError(f"{path}: its recall store has no readable settings")
    now = current.settings()
    for field, name in CHECKED.items():
        if saved.get(field) != now[field]:
            show = ["none" if v is None else str(v) for v in (saved.get(field), now[field])]
            raise UserError(f"{path}: made with {name} {show[0]}, this run has {name} {show[1]}")


def saved_spec(data: dict, path: Path) -> Any:
    """The ``RecallSpec`` a manifest was written with (its store folder left out: a
    temporary one)."""
    from mlx_stream.recall.spec import RecallSpec

    try:
        fields = {f.name for f in dataclasses.fields(RecallSpec)}
        return RecallSpec(**{k: v for k, v in data.items() if k in fields and k != "folder"})
    except (AttributeError, TypeError, ValueError):
        raise UserError(f"{path}: its recall store has no readable settings") from None


def restore(path: str | os.PathLike, binding: str, model: Any, raw: list, verdict: Any,
            caches: list, recall: Any = "saved") -> Any:  # fmt: skip
    """Give ``caches`` (loaded from ``path``) the recall tier saved beside it.

    Args:
        path: The cache file.
        binding (str): Its metadata under :data:`KEY`.
        model: The model (the attention hook is installed on it).
        raw (list): The model's own prompt cache (``make_prompt_cache``), for the checks.
        verdict: ``positions.check_model``'s verdict for the model.
        caches (list): The loaded caches.
        recall: The run's ``RecallSpec`` (the saved settings are checked against it),
            or ``"saved"``: the saved settings, the store in a temporary folder.

    Returns:
        Recall: The tier.

    Raises:
        UserError: A missing, changed or foreign file, or other settings.
    """
    from mlx_stream.cache.sink import SinkCache
    from mlx_stream.recall.checks import check
    from mlx_stream.recall.tier import Recall

    path = Path(path)
    folder, manifest = _manifest(path, binding)
    if not isinstance(manifest, dict) or manifest.get("version") not in READS:
        version = manifest.get("version") if isinstance(manifest, dict) else None
        raise UserError(f"{folder}: a recall store of version {version}; this version reads "
                        f"{' and '.join(map(str, READS))}")  # fmt: skip
    spec = saved_spec(manifest.get("spec"), path)
    recall = spec if recall == "saved" else recall
    check_spec(path, manifest.get("spec"), recall)  # saved: made with what this version has
    layers = [c for c in caches if isinstance(c, SinkCache)]
    if not layers:
        raise UserError(f"{path}: has a recall store but no SinkCache layer")
    s = layers[0]
    check(model, raw, verdict, recall, s.window, s.stride, s.positions, s.slack)
    tier = Recall(recall, caches)
    try:
        tier.restore(Reader(folder, manifest.get("files") or {}), manifest.get("tier"))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        tier.close()
        raise UserError(f"{folder}: its manifest is not readable ({type(e).__name__})") from None
    except BaseException:
        tier.close()
        raise
    return tier
