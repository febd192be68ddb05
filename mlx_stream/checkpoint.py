"""Stream-run checkpoints: what they belong to, and proof their arrays are intact.

Contract: a checkpoint is a ``save_cache`` file whose metadata adds the evaluation
state, an identity (model, dtype, cache and recall settings, segment size, a digest
of the tokens consumed) and a checksum over every array (and a recall store's
manifest). Resuming refuses any identity, checksum or token-digest mismatch with a
:class:`~mlx_stream.errors.UserError` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_stream.errors import UserError

SUFFIX = ".safetensors"
STATE_KEY = "mlx_stream_eval"  # the evaluation state (JSON)
IDENTITY_KEY = "mlx_stream_run"  # what the checkpoint belongs to (JSON)
CHECKSUM_KEY = "mlx_stream_checksum"  # sha256 of the cache arrays
TEXT_FIELD = "text_sha256"
MAX_HEADER = 1 << 28


class TextDigest:
    """A running sha256 over the token ids of a stream (each as 8 bytes, little end)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, tokens: list[int]) -> None:
        self._h.update(np.asarray(tokens, dtype="<i8").tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def checksum(caches: list, used: bool = True) -> str:
    """sha256 over every array of a prompt cache as ``save_cache`` writes it (a
    SinkCache's written slots; ``used=False``: its whole buffers, how checkpoints from
    before saved them): layer, name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for i, c in enumerate(caches):
        state = c.used_state if used and hasattr(c, "used_state") else c.state
        arrays = [(k, v) for k, v in tree_flatten(list(state)) if isinstance(v, mx.array)]
        mx.eval([v for _, v in arrays])
        for key, value in arrays:
            h.update(f"{i}.{key}:{value.dtype}:{value.shape}".encode())
            h.update(memoryview(array_bytes(value)))
    return h.hexdigest()


def array_bytes(a: mx.array) -> np.ndarray:
    """The bytes of ``a`` as a numpy array (bfloat16 has no numpy dtype: viewed as bytes)."""
    flat = a.reshape(-1)
    if flat.dtype == mx.bool_:
        flat = flat.astype(mx.uint8)
    return np.array(flat.view(mx.uint8), copy=False)


def save(path: str | os.PathLike, caches: list, state: dict, identity: dict) -> None:
    """Write a checkpoint atomically (a temporary beside ``path``, then a rename).

    Args:
        path: The ``.safetensors`` file.
        caches (list): The prompt cache.
        state (dict): The evaluation state (JSON-able).
        identity (dict): What it belongs to, ``text_sha256`` included (JSON-able).
    """
    from mlx_stream.cache.sink import save_cache

    metadata = {
        STATE_KEY: json.dumps(state),
        IDENTITY_KEY: json.dumps(identity, sort_keys=True),
        CHECKSUM_KEY: checksum(caches),
    }
    # Atomic, the recall store's sidecar with it; a killed save's temporaries go next time.
    save_cache(Path(path), caches, metadata)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's state, identity and checksum, read from the header alone.

    Returns:
        ``{"state": dict, "identity": dict, "checksum": str}``.

    Raises:
        UserError: Missing, a folder, not a safetensors file, or not a checkpoint
            written by this version.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint")
    if path.is_dir():
        raise UserError(f"{path}: is a directory, expected a checkpoint file")
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
        meta = header["__metadata__"]
        out = {
            "state": json.loads(meta[STATE_KEY]),
            "identity": json.loads(meta[IDENTITY_KEY]),
            "checksum": meta[CHECKSUM_KEY],
        }
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise UserError(
            f"{path}: not a stream-run checkpoint of this version ({type(e).__name__})"
        ) from None
    if not isinstance(out["state"], dict) or not isinstance(out["identity"], dict):
        raise UserError(f"{path}: not a stream-run checkpoint of this version")
    out["identity"] = _upgrade(out["identity"], meta.get("mlx_stream"), path)
    return out


OLD_CACHE_KEYS = ("kv-bits", "kv-key-bits", "kv-group-size")


def _upgrade(identity: dict, layers: str | None, path: Path) -> dict:
    """An identity written before ``CacheSpec`` (its cache settings as ``sinks``,
    ``window``, ``positions``, ``kv-bits``, ``kv-key-bits``, ``kv-group-size``) in
    today's form: every setting of ``CacheSpec.to_json``, read from the cache file's
    own SinkCache meta (which has always held all of them)."""
    if not any(key in identity for key in OLD_CACHE_KEYS):
        return identity
    from mlx_stream.cache.spec import CacheSpec

    try:
        metas = [m["meta"] for m in json.loads(layers or "{}")["layers"] if m.get("meta")]
        spec = CacheSpec.from_json(metas[0])
    except (ValueError, KeyError, TypeError, IndexError):
        raise UserError(f"{path}: not a stream-run checkpoint of this version") from None
    rest = {k: v for k, v in identity.items() if k not in OLD_CACHE_KEYS}
    return {**rest, **spec.to_json()}


#: The recall settings a checkpoint is bound to, by the name its refusal shows.
RECALL_FIELDS = {
    "recall-blocks": "blocks", "recall-block": "block", "recall-selector": "selector",
    "recall-placement": "placement", "recall-prompt-placement": "prompt_placement",
    "recall-bits": "bits",
    "recall-group-size": "group_size", "recall-refeed": "refeed",
}  # fmt: skip


def recall_identity(spec: Any) -> dict:
    """The identity fields of a run's recall policy (a ``RecallSpec``; none without
    one, so identities from before recall stay as they were): ``recall`` and what
    changes what attention sees; where the store lives and its RAM budget are left out
    (a resumed run may put it on another disk). A run without recall resuming a
    checkpoint with a store is refused when the cache loads."""
    if spec is None:
        return {}
    settings = spec.settings()
    return {"recall": True, **{name: settings[f] for name, f in RECALL_FIELDS.items()}}


def check_identity(path: str | os.PathLike, saved: dict, current: dict) -> None:
    """A :class:`UserError` naming the first field (in ``current``'s order; a cache
    setting by its flag, ``kv-bits``) where ``current`` differs from what the
    checkpoint was made with (the text digest is checked separately)."""
    from mlx_stream.cache.spec import FLAGS

    for field in current:
        if field == TEXT_FIELD:
            continue
        if saved.get(field) != current[field]:
            if field == "recall":
                raise UserError(f"{path}: made without --recall, this run has it")
            name = FLAGS.get(field, field).lstrip("-")
            raise UserError(
                f"{path}: made with {name} {_show(saved.get(field))}, "
                f"this run has {name} {_show(current[field])}"
            )


def _show(value: Any) -> str:
    return "none" if value is None else str(value)


def load(
    path: str | os.PathLike, model: Any, identity: dict | None = None, recall: Any = "saved"
) -> tuple[list, dict, dict]:
    """Load a checkpoint and verify it (its recall store too: every file against
    the sha256 its manifest records).

    Args:
        path: The checkpoint.
        model: The model it belongs to (SinkCaches need its rope modules).
        identity (dict, optional): The new run's identity to check against.
        recall: The run's ``RecallSpec`` (``None``: no recall; ``"saved"``: the
            checkpoint's), as ``load_cache`` takes it.

    Returns:
        ``(caches, state, identity)``: the identity as saved (``text_sha256``
        included, to check against the new stream).

    Raises:
        UserError: Another model, setting or segment size, or arrays that do not match
            their checksum.
    """
    import mlx_stream.recall  # noqa: F401 - registers the recall tier a checkpoint may hold
    from mlx_stream.cache.sink import load_cache

    meta = read_metadata(path)
    if identity is not None:
        check_identity(path, meta["identity"], identity)
    try:
        caches, _ = load_cache(path, model, recall)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: cannot load its cache ({' '.join(str(e).split())})") from None
    saved = meta["checksum"]
    if saved != checksum(caches) and saved != checksum(caches, used=False):
        raise UserError(f"{path}: checksum mismatch, the cache arrays are corrupted")
    return caches, meta["state"], meta["identity"]
