"""Save and load a prompt cache (SinkCache and mlx-lm caches) as safetensors; each
registered extension (``cache.extension``) saves and restores its own state beside it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache import extension
from mlx_stream.cache.header import check_layers
from mlx_stream.cache.layer import SinkCache
from mlx_stream.cache.positions import check_model
from mlx_stream.errors import Unsupported


def save_cache(
    path: str | os.PathLike, caches: list, metadata: dict | None = None, mode: int | None = None
) -> None:
    """Save a prompt cache (SinkCache and mlx-lm caches) to ``path`` (safetensors),
    atomically: a failed save leaves any earlier file untouched. A recall tier goes to
    the sidecar folder ``X.recall`` beside ``X.safetensors``, bound to the file by its
    manifest's sha256 (``mlx_stream.recall.persist``).

    Args:
        path: Destination file.
        caches (list): The prompt cache.
        metadata (dict, optional): Strings saved along (e.g. a transcript).
        mode (int, optional): The file's permissions (a recall store's files get them
            too). Default: what the umask gives.

    Raises:
        OSError: The file or its sidecar cannot be written (the earlier save stays).
    """
    from mlx_stream import files

    arrays, layers = {}, []
    for i, c in enumerate(caches):
        state = c.used_state if isinstance(c, SinkCache) else c.state
        flat = tree_flatten(state)
        scalars = {}
        for key, value in flat:
            if isinstance(value, mx.array):
                arrays[f"{i}.{key}"] = value
            else:
                scalars[key] = value
        meta = c.meta_state if isinstance(c, SinkCache) else None
        layers.append(
            {
                "class": type(c).__name__,
                "keys": [k for k, _ in flat],
                "scalars": scalars,
                "meta": meta,
            }
        )
    header = {"mlx_stream": json.dumps({"layers": layers}), **(metadata or {})}
    path = Path(path)
    files.remove_stale(path)  # a save killed midway leaves its temporary
    staged = []
    for ext in extension.registered():
        state = ext.of(caches)
        if state is not None:
            staged.append((ext, ext.stage(path, state, mode)))
            header[ext.key] = staged[-1][1].binding
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=files.temp_prefix(path), suffix=".safetensors"
    )
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, header)
        os.chmod(tmp, files.file_mode() if mode is None else mode)
        for _, st in staged:
            st.commit()
        os.replace(tmp, path)
    except BaseException:
        for _, st in staged:
            st.discard()
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    done = {ext.name for ext, _ in staged}
    for _, st in staged:
        st.finish()
    for ext in extension.registered():  # an earlier save's state: no file names it now
        if ext.name not in done:
            ext.drop(path)


def load_cache(path: str | os.PathLike, model: nn.Module | None = None,
               recall: Any = "saved", expect: dict | None = None) -> tuple[list, dict]:  # fmt: skip
    """Load a prompt cache saved by ``save_cache`` (its recall tier too). Its header is
    checked before any cache is built (``mlx_stream.cache.header``): a file asking for
    caches the model would not have, or more memory than there is, is refused.

    Args:
        path: The file.
        model (nn.Module, optional): The model it belongs to; SinkCaches need to know
            where its layers' positions live to keep moving sinks (and a recall tier
            needs it for its attention hook).
        recall: The run's ``RecallSpec``, checked against a saved tier's settings;
            ``None``: the run has no recall (a file with a tier is refused);
            ``"saved"``: whatever the file holds (a tier's store then lives in a
            temporary folder). Default: ``"saved"``.
        expect (dict, optional): Cache settings (``CacheSpec.to_json``'s form) every
            SinkCache of the file must have.

    Returns:
        tuple: ``(caches, metadata)``.

    Raises:
        UserError: The recall tier is missing, changed or made with other settings
            than ``recall``.
        Unsupported: The header is not one of a cache of ``model`` (or ``expect``).
    """
    try:
        arrays, header = mx.load(str(path), format="safetensors", return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise Unsupported(f"{path} is not a readable cache file ({e})") from e
    if "mlx_stream" not in header:
        raise Unsupported(f"{path} is not an mlx-stream cache file")
    try:
        layers = json.loads(header.pop("mlx_stream"))["layers"]
    except (ValueError, KeyError, TypeError) as e:
        raise Unsupported(f"{path} has no readable layer list ({e})") from e
    raw = mlx_cache.make_prompt_cache(model) if model is not None else None
    try:
        check_layers(layers, arrays, model, None if raw is None else len(raw), expect)
    except Unsupported as e:
        raise Unsupported(f"{path}: {e}") from None
    settings = {"recall": recall}
    bindings = {ext: header.pop(ext.key, None) for ext in extension.registered()}
    missing = [n for n, key in extension.SHIPPED_KEYS.items() if key in header]
    if missing:  # an extension's state this process cannot restore: never drop it silently
        raise Unsupported(
            f"{path} holds a {missing[0]} state: import mlx_stream.{missing[0]} before loading it"
        )
    for ext, binding in bindings.items():
        ext.admit(path, binding, settings.get(ext.name, "saved"), model)
    verdict = check_model(model, raw) if model is not None else None
    moving = any(
        layer["class"] == "SinkCache" and (layer["meta"] or {}).get("positions") == "cache"
        for layer in layers
    )
    if verdict is not None and verdict.refusal and moving:
        raise Unsupported(verdict.refusal)
    caches = []
    for i, layer in enumerate(layers):
        flat = [
            (k, arrays[f"{i}.{k}"] if f"{i}.{k}" in arrays else layer["scalars"][k])
            for k in layer["keys"]
        ]
        state = tree_unflatten(flat) if flat else []
        if layer["class"] == "SinkCache":
            move = verdict.moves.get(i) if verdict is not None else None
            additive = verdict.additive_mask if verdict is not None else False
            c = SinkCache(move=move, additive_mask=additive)
            c.meta_state = layer["meta"]
            if state:
                c.state = state
        else:
            cls = getattr(mlx_cache, layer["class"])
            c = cls.from_state(tuple(state) if isinstance(state, list) else state)
        caches.append(c)
    for ext, binding in bindings.items():
        if binding is not None:
            ext.restore(path, binding, model, raw, verdict, caches, settings.get(ext.name, "saved"))
    return caches, header
