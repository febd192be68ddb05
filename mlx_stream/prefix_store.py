"""A prefix store on disk: the cache state after a prefix, shared by every process.

Contract: an entry (``save_cache``'s format) is read back only for an equal
:class:`PrefixKey` (weights digest, dtypes, cache policy, prefill call size, token
ids), written atomically, verified on read (:func:`state_digest`; a bad entry is a
miss and removed), and the folder is bounded in bytes (least recently used go first).
A store that cannot be written turns itself off with one log line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlx_stream import files

logger = logging.getLogger("mlx_stream")

VERSION = 1
MB = 1_000_000
SUFFIX = ".safetensors"
KEY_FIELD = "mlx_stream_prefix_key"  # the entry's key (JSON), checked on read
DIGEST_FIELD = "mlx_stream_prefix_sha256"  # state_digest of its caches
DEFAULT_MB = 4096  # default bound on the folder, in MB (10**6 bytes, as --recall-ram)
FOLDER = "prefixes"  # under the user cache (``$MLX_STREAM_HOME`` or the platform's)
#: Shortest prefix worth a file: a few dozen tokens prefill faster than a file is written.
MIN_TOKENS = 64
#: A built model's content digest, kept on it once computed (:func:`weights_digest`).
WEIGHTS_ATTR = "mlx_stream_weights_digest"
MODE = 0o600  # a system prompt may be private: entries are the user's own
_STALE = re.compile(r"\.partial-(\d+)-")


def source_digest(folder: str | os.PathLike) -> str:
    """A cheap, stable digest of a model folder: every file's name, size and mtime (a
    file changed or replaced gives another digest; nothing is read)."""
    h = hashlib.sha256(b"mlx-stream weights v1\0")
    folder = Path(folder)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = path.stat()
        h.update(f"{path.relative_to(folder)}|{st.st_size}|{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def weights_digest(model: Any) -> str:
    """A sha256 of ``model``'s class, parameter names, shapes and bytes, for a model no
    folder names (built in memory; computed once, then kept on the model). A loaded
    model's store is keyed by its folder instead (:meth:`PrefixStore.bind`)."""
    known = getattr(model, WEIGHTS_ATTR, None)
    if isinstance(known, str):
        return known
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_stream.checkpoint import array_bytes

    h = hashlib.sha256(f"{type(model).__module__}.{type(model).__name__}\0".encode())
    for name, value in tree_flatten(model.parameters()):
        mx.eval(value)
        h.update(f"{name}:{value.dtype}:{value.shape}\0".encode())
        h.update(memoryview(array_bytes(value)))
    digest = "content:" + h.hexdigest()
    with contextlib.suppress(AttributeError, TypeError):
        setattr(model, WEIGHTS_ATTR, digest)
    return digest


def weights_dtype(model: Any) -> str:
    """The dtypes ``model``'s parameters hold now (``"float32"``; a quantized model's
    ``"float16,uint32"``)."""
    from mlx.utils import tree_flatten

    kinds = {str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())}
    return ",".join(sorted(kinds))


@dataclass(frozen=True)
class PrefixKey:
    """What an entry belongs to. Two keys are equal only for the same weights, dtype,
    cache policy, prefill call size and token ids.

    Attributes:
        weights (str): :func:`weights_digest` of the model.
        dtype (str): :func:`weights_dtype` of the model.
        cache (str): The cache policy, ``CacheSpec.to_json`` as sorted JSON.
        step (int): Tokens per prefill call (the KV of another chunking may differ
            in the last bits).
        tokens (str): sha256 of the prefix's token ids (8 bytes each, little end).
        n_tokens (int): How many.
        version (int): The store's format.
    """

    weights: str
    dtype: str
    cache: str
    step: int
    tokens: str
    n_tokens: int
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def name(self) -> str:
        """The entry's file name (a sha256 of the whole key)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest() + SUFFIX


def make_key(
    model: Any, tokens: list[int], spec: Any, step: int, weights: str | None = None
) -> PrefixKey:
    """The key of the cache state after ``tokens`` went into ``model`` under the cache
    policy ``spec`` (a ``CacheSpec``) in calls of at most ``step`` tokens; ``weights``:
    the model's digest (:func:`source_digest` of its folder; default: its content's,
    :func:`weights_digest`)."""
    from mlx_stream.checkpoint import TextDigest

    text = TextDigest()
    text.update(list(tokens))
    cache = json.dumps(spec.to_json(), sort_keys=True)
    weights = weights if weights is not None else weights_digest(model)
    return PrefixKey(weights, weights_dtype(model), cache, int(step),
                     text.hexdigest(), len(tokens))  # fmt: skip


def state_digest(caches: list, key: PrefixKey) -> str:
    """sha256 over ``key`` and every cache: its class, settings and counters
    (``meta_state``), scalars, and the arrays ``save_cache`` writes (a SinkCache's
    written slots), each with its name, dtype and shape."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_stream.checkpoint import array_bytes

    h = hashlib.sha256(key.to_json().encode())
    for i, c in enumerate(caches):
        meta = getattr(c, "meta_state", None)
        h.update(f"{i}:{type(c).__name__}:{json.dumps(meta, sort_keys=True, default=str)}".encode())
        state = getattr(c, "used_state", None)
        state = list(c.state) if state is None else state
        flat = tree_flatten(state)
        mx.eval([v for _, v in flat if isinstance(v, mx.array)])
        for name, value in flat:
            if isinstance(value, mx.array):
                h.update(f"{i}.{name}:{value.dtype}:{value.shape}".encode())
                h.update(memoryview(array_bytes(value)))
            else:
                h.update(f"{i}.{name}={value!r}".encode())
    return h.hexdigest()


def default_dir() -> Path:
    """``prefixes/`` under the user cache (``$MLX_STREAM_HOME`` or the platform's)."""
    return files.home_dir() / FOLDER


class PrefixStore:
    """A folder of prefix entries, bounded in bytes (see the module's contract).

    Args:
        root: The folder (made if missing). Default: :func:`default_dir`.
        max_bytes (int): Most bytes of entries kept. Default: ``DEFAULT_MB`` MB.

    Attributes:
        weights (str | None): The digest its keys give the model (:meth:`bind`);
            ``None``: each model's content digest (:func:`weights_digest`).
        enabled (bool): False once the folder could not be made or written.
        hits, misses, writes, rejected (int): Counters (``rejected``: entries found
            corrupt, truncated or foreign, and removed).
    """

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int | None = None):
        self.root = Path(root).expanduser() if root is not None else default_dir()
        self.max_bytes = DEFAULT_MB * MB if max_bytes is None else int(max_bytes)
        self.weights: str | None = None
        self.enabled = True
        self.hits = self.misses = self.writes = self.rejected = 0
        self._lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._off(e)

    def __repr__(self) -> str:
        return f"PrefixStore({str(self.root)!r}, max_bytes={self.max_bytes})"

    def path(self, key: PrefixKey) -> Path:
        return self.root / key.name

    def bind(self, folder: str | os.PathLike) -> PrefixStore:
        """Key entries by the model loaded from ``folder`` (:func:`source_digest`: a
        changed or replaced file is another model); returns the store."""
        self.weights = source_digest(folder)
        return self

    # ----- reading ------------------------------------------------------------------

    def lookup(self, key: PrefixKey, model: Any = None) -> list | None:
        """The caches stored for ``key`` (fresh objects, the caller's own), or ``None``.

        A file that does not load, whose header asks for caches other than ``key``'s
        policy gives ``model`` (checked before any is built), whose stored key is not
        ``key`` or whose contents do not match their digest is removed (if no writer
        replaced it meanwhile) with one log line, and ``None`` is returned: the caller
        computes the prefix again.

        Args:
            key: The entry's key.
            model: The model the caches belong to (SinkCaches need its rope modules).
        """
        if not self.enabled:
            return None
        path = self.path(key)
        try:
            before = os.stat(path)
        except OSError:
            self.misses += 1
            return None
        try:
            caches = self.read(path, key, model)
        except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss, never an error
            caches = None
            logger.warning("prefix store: removed %s (%s)", path.name, " ".join(str(e).split()))
        if caches is None:
            self.misses += 1
            self.rejected += 1
            self._remove_if_unchanged(path, before)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used
        self.hits += 1
        return caches

    def read(self, path: Path, key: PrefixKey, model: Any) -> list:
        """The caches of the entry at ``path``; an exception saying why where it is
        not a valid entry for ``key`` (unreadable, a header that is not a cache of
        ``model`` under ``key``'s policy, another key, a digest mismatch)."""
        from mlx_stream.cache.sink import load_cache

        cache = json.loads(key.cache)
        caches, meta = load_cache(path, model, None, expect=cache)
        if meta.get(KEY_FIELD) != key.to_json():
            raise ValueError("another key")
        if meta.get(DIGEST_FIELD) != state_digest(caches, key):
            raise ValueError("its arrays do not match their digest")
        for c in caches:
            spec = getattr(c, "spec", None)
            if spec is not None and spec.to_json() != cache:
                raise ValueError("another cache policy")
        return caches

    def _remove_if_unchanged(self, path: Path, before: os.stat_result) -> None:
        """Remove the rejected file unless it was replaced since it was read."""
        try:
            now = os.stat(path)
            same = (now.st_ino, now.st_size, now.st_mtime_ns) == (
                before.st_ino, before.st_size, before.st_mtime_ns)  # fmt: skip
            if same:
                path.unlink()
        except OSError:
            pass

    # ----- writing ------------------------------------------------------------------

    def put(self, key: PrefixKey, caches: list) -> bool:
        """Store ``caches`` (the state right after ``key``'s prefix) for ``key``.

        Atomic (temporary + fsync + rename); then entries are evicted, least recently
        used first, until the folder fits ``max_bytes``. A state larger than the whole
        bound is not stored. An ``OSError`` (a full disk, a read-only folder) turns the
        store off with one log line.

        Returns:
            Whether the entry is now in the store.
        """
        if not self.enabled:
            return False
        from mlx_stream.cache.sink import save_cache

        path = self.path(key)
        tmp = None
        try:
            files.remove_stale(path)
            meta = {KEY_FIELD: key.to_json(), DIGEST_FIELD: state_digest(caches, key)}
            tmp = path.with_name(f"{files.temp_prefix(path)}{os.urandom(4).hex()}{SUFFIX}")
            save_cache(tmp, caches, meta)
            if tmp.stat().st_size > self.max_bytes:
                return False
            os.chmod(tmp, MODE)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            self._sync_folder()
        except OSError as e:
            self._off(e)
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        self.writes += 1
        self.evict(keep=path)
        return True

    def _sync_folder(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:  # some filesystems cannot sync a folder: the rename stands
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                raise
        finally:
            os.close(fd)

    def entries(self) -> list[tuple[Path, os.stat_result]]:
        """Every entry with its ``stat``, least recently used first."""
        found = []
        for path in self.root.glob(f"*{SUFFIX}"):
            if path.name.startswith("."):
                continue
            with contextlib.suppress(OSError):
                found.append((path, path.stat()))
        return sorted(found, key=lambda e: e[1].st_mtime_ns)

    def size(self) -> int:
        """Bytes the entries take."""
        return sum(st.st_size for _, st in self.entries())

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Remove least recently used entries until the folder fits ``max_bytes`` (and
        the temporaries of writers that were killed). ``keep``: an entry to leave."""
        removed: list[Path] = []
        with self._lock:
            for tmp in self.root.glob(".*.partial-*"):
                m = _STALE.search(tmp.name)
                if m and int(m.group(1)) != os.getpid() and not files.alive(int(m.group(1))):
                    with contextlib.suppress(OSError):
                        tmp.unlink()
            found = self.entries()
            total = sum(st.st_size for _, st in found)
            for path, st in found:
                if total <= self.max_bytes:
                    break
                if path == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
                total -= st.st_size
        return removed

    def _off(self, error: OSError) -> None:
        """Turn the store off for this process, with one log line."""
        if not self.enabled:
            return
        self.enabled = False
        why = error.strerror or str(error)
        logger.warning("prefix store %s: cannot write (%s); running without it", self.root, why)


def open_store(
    folder: str | os.PathLike | None = None, mb: int | None = None, off: bool = False
) -> PrefixStore | None:
    """The store the CLI's ``--prefix-store DIR``, ``--prefix-store-mb N`` and
    ``--no-prefix-store`` ask for (``None`` when off)."""
    if off:
        return None
    return PrefixStore(folder, None if mb is None else int(mb) * MB)
