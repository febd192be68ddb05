"""Checks of options and input/output paths, each a one-line error naming the flag,
made before any model loads."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from mlx_stream.defaults import DEFAULT_KV_GROUP_SIZE

from .failures import fail

SNIFF_BYTES = 1 << 16


def check_positive(value: int | None, flag: str, minimum: int = 1) -> None:
    """One-line error unless ``value`` (when given) is at least ``minimum``."""
    if value is not None and value < minimum:
        fail(f"{flag} must be at least {minimum} (got {value})")


def check_choice(value: str, flag: str, choices: tuple[str, ...]) -> None:
    """One-line error unless ``value`` is one of ``choices``."""
    if value not in choices:
        fail(f"{flag} must be one of {', '.join(choices)} (got {value!r})")


def check_cache(
    sinks: int | None = None,
    window: int | None = None,
    positions: str = "cache",
    kv_bits: int | None = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    key_bits: int | None = None,
) -> None:
    """One-line error naming the flag for cache options a SinkCache cannot have,
    before any model loads (the engine's ``CacheSpec`` checks, nothing repeated here)."""
    from mlx_stream.cache.spec import CacheSpec

    CacheSpec.for_model(None, sinks, window, positions, kv_bits, kv_group_size, key_bits)


def check_kv_bits(kv_bits: int | None, kv_group_size: int, key_bits: int | None = None) -> None:
    """One-line error for a cache quantization the SinkCache cannot store."""
    check_cache(kv_bits=kv_bits, kv_group_size=kv_group_size, key_bits=key_bits)


def check_sampling(
    temp: float | None, top_p: float | None, top_k: int | None = None,
    repetition_penalty: float | None = None,
) -> None:  # fmt: skip
    """One-line error for a negative temperature, a top-p outside (0, 1], a negative
    top-k or a repetition penalty that is not positive (``None``: not given)."""
    if temp is not None and temp < 0:
        fail(f"--temp must be at least 0 (got {temp})")
    if top_p is not None and not 0 < top_p <= 1:
        fail(f"--top-p must be in (0, 1] (got {top_p})")
    if top_k is not None and top_k < 0:
        fail(f"--top-k must be at least 0 (got {top_k})")
    if repetition_penalty is not None and repetition_penalty <= 0:
        fail(f"--repetition-penalty must be above 0 (got {repetition_penalty})")


def sampling(
    model_path: Any, temp: float | None = None, top_p: float | None = None,
    top_k: int | None = None, repetition_penalty: float | None = None,
):  # fmt: skip
    """The run's ``Sampling``: the model's defaults (its ``generation_config.json``,
    else mlx-stream's) with the options given over them."""
    from mlx_stream.generate.model_config import sampling_defaults

    base = sampling_defaults(model_path)
    given = {"temp": temp, "top_p": top_p, "top_k": top_k,
             "repetition_penalty": repetition_penalty}  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return base
    if given.get("repetition_penalty") == 1.0:
        given["repetition_penalty"] = None
    return base.replace(**given, source=f"{base.source}, options over it")


def check_text_file(path: str | Path) -> Path:
    """Return ``path`` if it names a non-empty UTF-8 text file, else a one-line error.

    Only the first 64 KiB are sniffed here (for NUL bytes and UTF-8); a bad byte
    further on surfaces as a ``UnicodeDecodeError``, which ``handle_errors`` also
    reports as bad input.
    """
    path = Path(path)
    if not path.exists():
        fail(f"{path}: no such file")
    if path.is_dir():
        fail(f"{path}: is a directory, expected a text file")
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as exc:
        fail(f"{path}: cannot read ({exc.strerror or exc})")
    if not head:
        fail(f"{path}: file is empty")
    if b"\x00" in head:
        fail(f"{path}: looks like a binary file, expected UTF-8 text")
    try:
        # A multi-byte character cut at the sniff boundary is fine; at the end of the
        # file it is not.
        import codecs

        whole = len(head) < SNIFF_BYTES
        codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as exc:
        fail(f"{path}: not UTF-8 text (bad byte at offset {exc.start})")
    if not head.strip():
        fail(f"{path}: file has only whitespace")
    return path


def check_output_path(path: str | Path) -> Path:
    """Return ``path`` if a file can be written there, else a one-line error.

    Checked before any long run so a typo costs nothing.
    """
    path = Path(path)
    if path.is_dir():
        fail(f"{path}: is a directory, expected a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        fail(f"{path}: directory {parent} does not exist")
    if not parent.is_dir():
        fail(f"{path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"{path}: directory {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        fail(f"{path}: file is not writable")
    return path


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (an existing file by inode, else by path)."""
    a, b = Path(a), Path(b)
    with contextlib.suppress(OSError):
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def check_distinct(outputs: dict[str, Any], inputs: dict[str, Any]) -> None:
    """One-line error when an output path (``{flag: path}``, None skipped) names an
    input or another output: writing it would destroy what it is computed from."""
    outs = [(flag, path) for flag, path in outputs.items() if path is not None]
    ins = [(flag, path) for flag, path in inputs.items() if path not in (None, "-")]
    for i, (flag, path) in enumerate(outs):
        for other, where in ins + outs[:i]:
            if same_file(path, where):
                fail(f"{flag} {path} is the same file as {other} {where}: choose another path")
