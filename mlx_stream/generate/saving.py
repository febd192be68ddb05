"""A saved chat's files: ``PATH.safetensors`` (caches + state) and ``PATH.json``.

Contract: the state's fields and their checks (:data:`STATE_FIELDS`), private atomic
writes, and the paths ``/save`` uses.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_stream.errors import UserError

STATE_KEY = "mlx_stream_chat"


# What a saved state must hold, and a check per field (``None`` allowed for ``system``).
STATE_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "system": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "messages": (
        "a list of {role, content} strings",
        lambda v: (
            isinstance(v, list)
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in v
            )
        ),
    ),
    "fed_text": ("a string", lambda v: isinstance(v, str)),
    "pending": (
        "a list of token ids",
        lambda v: isinstance(v, list) and all(type(t) is int and t >= 0 for t in v),
    ),
    "sinks": ("an integer >= 0", lambda v: type(v) is int and v >= 0),
    "window": ("an integer >= 1", lambda v: type(v) is int and v >= 1),
}


def check_state(state: Any, path: Path) -> dict[str, Any]:
    """``state`` if it has every field a session needs, with the right types; else a
    one-line :class:`UserError` naming the first field at fault."""
    if not isinstance(state, dict):
        raise UserError(f"{path}: the saved chat state is not an object")
    for name, (kind, ok) in STATE_FIELDS.items():
        if name not in state:
            raise UserError(f"{path}: the saved chat has no {name!r} field")
        if not ok(state[name]):
            raise UserError(f"{path}: the saved chat's {name!r} must be {kind}")
    return state


#: The permissions of every file ``/save`` writes (the transcript's ``mkstemp`` gives them too).
PRIVATE = 0o600


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and ``os.replace``
    (mode ``PRIVATE``, as ``mkstemp`` makes it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def draft_cache_path(cache_path: Path) -> Path:
    """Where ``/save`` puts the draft model's cache: ``PATH.draft.safetensors``."""
    return cache_path.with_name(cache_path.name.removesuffix(".safetensors") + ".draft.safetensors")


def checkpoint_paths(path: str | Path) -> tuple[Path, Path]:
    """``PATH`` -> (``PATH.safetensors``, ``PATH.json``); a given suffix of either is dropped."""
    path = Path(path).expanduser()
    if path.suffix in (".safetensors", ".json"):
        path = path.with_suffix("")
    return path.with_name(path.name + ".safetensors"), path.with_name(path.name + ".json")
