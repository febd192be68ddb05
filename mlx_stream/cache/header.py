"""The header of a saved cache file, checked before any cache is built from it.

Contract: :func:`check_layers` refuses (``Unsupported``, one line) a file whose layer
list would build something other than a cache of the model it is loaded for: a
SinkCache setting out of range or not the one ``expect`` asks for, counters that do
not fit its ring, arrays of a dtype no cache holds, a layer count other than the
model's, or arrays that, padded to the ring, would take more than the model's cache
of those settings (more heads, a wider head) or more memory than the machine has
(a header claiming a window of 10^8 asks MLX for gigabytes it cannot give: a crash,
not an exception). Nothing is allocated here: sizes come from the header, the arrays'
shapes and :mod:`mlx_stream.cache.estimate`'s arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx_stream.cache.settings import FIELDS, read_json, validate_sizes
from mlx_stream.errors import Unsupported

DTYPES = ("float16", "bfloat16", "float32", "uint32")  # what a cache's arrays hold
MAX_COUNT = 1 << 62  # tokens a stream may have seen
TOLERANCE = 1.25  # padded arrays over the model's cache of the same settings (8-bit keys
# per token against per channel differ by little; another head count by far more)
LAYOUT_ATTR = "mlx_stream_kv_layout"  # a model's KVLayout, kept on it once worked out


def check_layers(
    layers: Any, arrays: dict, model: Any = None, n_caches: int | None = None,
    expect: dict | None = None,
) -> None:  # fmt: skip
    """Raise ``Unsupported`` unless ``layers`` (``save_cache``'s list) and ``arrays``
    build caches fit for ``model`` (see the module's contract).

    Args:
        layers: The header's layer list.
        arrays: The file's arrays, ``"{layer}.{key}"`` -> array.
        model: The model the caches are for (its KV layout bounds the arrays).
        n_caches: How many caches the model takes (``make_prompt_cache``'s count).
        expect (dict, optional): Cache settings (``CacheSpec.to_json``'s form) every
            SinkCache must have.
    """
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise Unsupported("its layer list is not a list of layers")
    if n_caches is not None and len(layers) != n_caches:
        raise Unsupported(f"it has {len(layers)} cache layers, the model takes {n_caches}")
    for name, value in arrays.items():
        if str(value.dtype).removeprefix("mlx.core.") not in DTYPES:
            raise Unsupported(f"array {name} is {value.dtype}, which no cache holds")
    layout = kv_layout(model) if model is not None else None
    need = 0
    for i, layer in enumerate(layers):
        if layer.get("class") != "SinkCache":
            _check_class(layer.get("class"), i)
            continue
        settings, slots = _settings(layer.get("meta"), i, expect)
        padded = _padded_bytes(arrays, i, slots)
        if layout is not None:
            from mlx_stream.cache.estimate import cache_bytes

            own = cache_bytes(dataclasses.replace(layout, layers=1), **settings)
            if padded > own * TOLERANCE:
                raise Unsupported(
                    f"layer {i}'s arrays take {padded:,} bytes once laid out, a cache of "
                    f"this model with its settings {own:,} (other heads or head size)"
                )
            padded = max(padded, own)
        need += padded
    _check_memory(need)


def _settings(meta: Any, i: int, expect: dict | None) -> tuple[dict, int]:
    """The layer's settings (checked) and the slots its buffers are padded to."""
    from mlx_stream.cache import kvquant
    from mlx_stream.cache.ring import spare_sets

    s = read_json(meta)
    validate_sizes(**s)
    for k in FIELDS:
        if expect is not None and k in expect and s.get(k) != expect[k]:
            raise Unsupported(f"layer {i} has {k} {s.get(k)!r}, not {expect[k]!r}")
    sinks, window = s["sinks"], s["window"]
    key_bits = s.get("kv_bits") if s.get("key_bits") is None else s["key_bits"]
    token_keys = bool(meta.get("token_keys", key_bits == 8))
    slack = kvquant.ring_slack(window, s.get("slack") or 0, key_bits, token_keys)
    capacity = sinks + window + slack
    in_place = kvquant.per_channel(key_bits, token_keys)
    spare = spare_sets(sinks, slack, s.get("stride", 64), s.get("positions", "cache"), in_place)
    seen, filled, slots = meta.get("tokens_seen"), meta.get("filled"), meta.get("slots")
    if not (_count(seen) and _count(filled) and filled <= capacity):
        raise Unsupported(f"layer {i}'s counters do not fit its ring of {capacity:,} slots")
    if not isinstance(slots, list) or len(slots) != capacity:
        raise Unsupported(f"layer {i}'s slot table is not its ring's {capacity:,} slots")
    if not all(type(t) is int and -1 <= t < MAX_COUNT for t in slots):
        raise Unsupported(f"layer {i}'s slot table holds something other than token indices")
    applied = meta.get("layout_applied")
    if not (isinstance(applied, list) and len(applied) == 2 and all(map(_count, applied))):
        raise Unsupported(f"layer {i}'s layout is not two token indices")
    settings = {k: v for k, v in s.items() if k != "slack"}
    return {**settings, "slack": s.get("slack") or 0}, capacity + (spare * sinks if in_place else 0)


def _check_class(name: Any, i: int) -> None:
    """Unless ``name`` is one of mlx-lm's cache classes: ``Unsupported``."""
    from mlx_lm.models import cache as mlx_cache

    from mlx_stream.mlxlm import BaseCache

    found = getattr(mlx_cache, name, None) if isinstance(name, str) else None
    if not (isinstance(found, type) and issubclass(found, BaseCache)):
        raise Unsupported(f"layer {i} is a {str(name)[:40]!r}, not a cache class")


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < MAX_COUNT


def _padded_bytes(arrays: dict, i: int, slots: int) -> int:
    """Bytes layer ``i``'s arrays take once its key and value buffers are padded to
    ``slots`` (``storage.fit``: state parts ``0`` and ``1``, a quantized buffer's
    triple too; per-channel keys, ``0.edge`` and the like, are kept as saved)."""
    total, prefix = 0, f"{i}."
    for name, value in arrays.items():
        if not name.startswith(prefix):
            continue
        path = name[len(prefix) :].split(".")
        buffer = path[0] in ("0", "1") and (len(path) == 1 or path[1].isdigit())
        if buffer and value.ndim == 4 and value.shape[2] < slots:
            total += value.nbytes // max(1, value.shape[2]) * slots
        else:
            total += value.nbytes
    return total


def _check_memory(need: int) -> None:
    from mlx_stream.cache.estimate import available_memory, human

    free = available_memory()
    if free is not None and need > free:
        raise Unsupported(f"its caches would take {human(need)}, more than the {human(free)} free")


def kv_layout(model: Any) -> Any:
    """``estimate.model_layout(model)``, worked out once per model."""
    known = getattr(model, LAYOUT_ATTR, None)
    if known is not None:
        return known or None
    from mlx_stream.cache.estimate import model_layout

    layout = model_layout(model)
    try:
        object.__setattr__(model, LAYOUT_ATTR, layout or False)
    except (AttributeError, TypeError):
        pass
    return layout
