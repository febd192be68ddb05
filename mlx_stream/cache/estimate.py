"""Will it fit? Exact memory of the rolling cache (and the weights) before allocating.

A SinkCache layer holds one key and one value buffer of ``sinks + window + slack``
slots (``(1, kv_heads, slots, head_dim)``, ``Ring.slots_total``; spare sink slots too
where calls write in place: per-channel 4-bit keys), plus a full-precision copy of the sink keys
when positions are moved; quantized buffers hold packed ``uint32`` words and a scale and
a bias per group. That arithmetic gives the cache's bytes exactly (the tests compare it
with ``nbytes`` of built caches), so an impossible ``--window`` is refused with the bytes
required against the memory available, instead of growing until the system kills it.

The layout comes from a model (a lazy one-token forward pass through plain KVCaches:
shapes and dtypes are known without computing or allocating anything) or, before a
model is loaded, from its ``config.json``.
"""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_stream.defaults import DEFAULT_KV_GROUP_SIZE, DEFAULT_SLACK, DEFAULT_STRIDE
from mlx_stream.errors import UserError

RECALL_SEGMENT = 32  # blocks per recall store segment (one allocation or file per layer)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "F32": 4, "F16": 2, "BF16": 2,
               "U32": 4, "I32": 4, "U8": 1, "I8": 1, "F64": 8, "I64": 8, "U16": 2, "I16": 2}  # fmt: skip


@dataclass(frozen=True)
class KVLayout:
    """What one token costs in each SinkCache layer.

    Attributes:
        layers: Layers that get a SinkCache (a model's unbounded KVCache layers).
        kv_heads: Key/value heads per layer.
        key_dim: Head dimension of the keys.
        value_dim: Head dimension of the values.
        dtype_bytes: Bytes per element of keys and values (the model's dtype).
    """

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype_bytes: int


def _buffer_bytes(layout: KVLayout, slots: int, dim: int, bits: int | None, group: int) -> int:
    rows = layout.kv_heads * slots
    if bits is None:
        return rows * dim * layout.dtype_bytes
    # mx.quantize: dim * bits / 32 uint32 words, one scale and one bias per group.
    return rows * (dim * bits // 32 * 4 + 2 * (dim // group) * layout.dtype_bytes)


def cache_bytes(
    layout: KVLayout,
    sinks: int,
    window: int,
    slack: int = DEFAULT_SLACK,
    positions: str = "cache",
    kv_bits: int | None = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    key_bits: int | None = None,
    stride: int = DEFAULT_STRIDE,
) -> int:
    """Bytes of a full SinkCache for ``layout`` (what ``sum(c.nbytes)`` reaches).

    Args:
        layout (KVLayout): From :func:`model_layout` or :func:`config_layout`.
        sinks, window, slack (int): The cache's sizes.
        positions (str): ``"cache"`` keeps a float copy of the sink keys.
        kv_bits, kv_group_size, key_bits: The cache's quantization.
        stride (int): The cache's stride (spare sink slots depend on it).

    Returns:
        int: Bytes.
    """
    from mlx_stream.cache import kvquant
    from mlx_stream.cache.ring import spare_sets

    key_bits = kv_bits if key_bits is None else key_bits
    slack = kvquant.ring_slack(window, slack, key_bits)
    # Ring.slots_total, without building a Ring (it allocates a table per slot): the
    # ring, plus spare sets of sink slots when sinks move.
    in_place = kvquant.per_channel(key_bits)
    spare = spare_sets(sinks, slack, stride, positions, in_place) if in_place else 0
    slots = sinks + window + slack + spare * sinks
    if kvquant.per_channel(key_bits):
        # kvquant.ChannelKeys: float sink slots, per-channel groups of GROUP tokens over
        # the ring (one scale and bias per channel and group), a float residual.
        ring, d = window + slack, layout.dtype_bytes
        recent = 2 if d == 4 else d  # kvquant.residual_dtype: float16 for float32 keys
        floats = (slots - ring) * layout.key_dim * d + kvquant.RECENT * layout.key_dim * recent
        quantized = layout.key_dim * (ring * key_bits // 8 + 2 * (ring // kvquant.GROUP) * d)
        per_layer = layout.kv_heads * (floats + quantized)
    else:
        per_layer = _buffer_bytes(layout, slots, layout.key_dim, key_bits, kv_group_size)
    per_layer += _buffer_bytes(layout, slots, layout.value_dim, kv_bits, kv_group_size)
    if sinks > 0 and positions == "cache":
        per_layer += layout.kv_heads * sinks * layout.key_dim * layout.dtype_bytes
    return layout.layers * per_layer


def model_layout(model: Any) -> KVLayout | None:
    """The KV layout of a loaded model, read from a lazy one-token forward pass (no
    array is computed or allocated). ``None`` when it has no unbounded KVCache layer."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache

    caches = mlx_cache.make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)  # lazy: only shapes and dtypes are worked out
    plain = [c for c in caches if type(c) is mlx_cache.KVCache and c.keys is not None]
    if not plain:
        return None
    keys, values = plain[0].keys, plain[0].values
    return KVLayout(len(plain), keys.shape[1], keys.shape[-1], values.shape[-1],
                    keys.dtype.size)  # fmt: skip


def config_layout(config: dict, dtype_bytes: int) -> KVLayout:
    """The KV layout from a ``config.json`` (standard multi-head/grouped attention;
    every layer counted, so models with sliding-window layers get an upper bound)."""
    config = {**config, **(config.get("text_config") or {})}
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return KVLayout(config["num_hidden_layers"], kv_heads, head_dim, head_dim, dtype_bytes)


def weights_bytes(folder: str | os.PathLike, dtype: str) -> int:
    """Bytes of a model folder's weights once loaded under the dtype policy ``dtype``
    (``"quantized"`` keeps them as stored; a float dtype dequantizes), read from the
    safetensors headers."""
    folder = Path(folder)
    tensors: dict[str, tuple[str, list[int]]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(_safetensors_header(file))
    config = json.loads((folder / "config.json").read_text())
    return tensors_bytes(tensors, config.get("quantization") or {}, dtype)


def tensors_bytes(tensors: dict[str, tuple[str, list[int]]], quant: dict, dtype: str) -> int:
    """Bytes of ``{name: (safetensors dtype, shape)}`` loaded under the dtype policy
    ``dtype``; ``quant`` is the config's ``quantization`` (group sizes). Also used for a
    repo's headers read from the Hub before anything is downloaded."""
    total = 0
    for name, (kind, shape) in tensors.items():
        count = _prod(shape)
        if dtype == "quantized":
            total += count * DTYPE_BYTES[kind]
            continue
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{base}.weight" in tensors:
            continue  # folded into the dequantized weight
        scales = tensors.get(f"{base}.scales")
        if name.endswith(".weight") and kind == "U32" and scales is not None:
            groups = _prod(scales[1])  # one scale per group of the dequantized weight
            group = _group_size(quant, base)
            count = groups * group
        total += count * DTYPE_BYTES[dtype]
    return total


def _group_size(quant: dict, module: str) -> int:
    own = quant.get(module)
    return (own if isinstance(own, dict) else quant).get("group_size", 64)


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}


def available_memory() -> int | None:
    """Bytes the system can still give this process: ``MemAvailable`` on Linux, the
    GPU's recommended working set (else physical memory) on macOS; ``None`` unknown."""
    try:
        if platform.system() == "Linux":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        elif platform.system() == "Darwin":
            import mlx.core as mx

            if mx.metal.is_available():
                info = mx.metal.device_info()
                return int(info.get("max_recommended_working_set_size") or info["memory_size"])
            out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True)
            return int(out.stdout.strip())
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    return None


def human(n: int) -> str:
    """Bytes for people: ``48.2 MB``, ``3.10 GB``, ``46.1 TB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e6:.1f} MB"


# ----- one vocabulary for bytes ---------------------------------------------------------
#
# Every figure the CLI prints about memory says what it is and where it lives:
# *reserved*: room allocated ahead (a KV cache's buffers at its full window, the recall
# region, the recall store's segments), which does not grow with use; *used*: the part
# holding tokens (what ``/save`` writes of a cache, the blocks stored); and *device*
# (MLX's memory), *RAM* (host memory of this process) or *disk*.


def used_of(used: int, reserved: int, where: str) -> str:
    """``3.9 MB used of 47.5 MB reserved (device)``; ``23.8 MB reserved (device)``
    when ``used`` is ``None`` (room whose use has no meaning, e.g. the recall region)."""
    if used is None:
        return f"{human(reserved)} reserved ({where})"
    return f"{human(used)} used of {human(reserved)} reserved ({where})"


def cache_usage(caches: list) -> tuple[int, int]:
    """``(used, reserved)`` device bytes of a prompt cache: reserved, every buffer as
    allocated; used, a SinkCache's written slots (what ``/save`` writes) and every
    other cache's arrays."""
    from mlx.utils import tree_flatten

    used = reserved = 0
    for c in caches:
        size = int(getattr(c, "nbytes", 0) or 0)
        reserved += size
        state = getattr(c, "used_state", None)
        used += size if state is None else sum(a.nbytes for _, a in tree_flatten(list(state)))
    return used, reserved


def check_fits(required: int, what: str, available: int | None = None) -> None:
    """A :class:`UserError` when ``required`` bytes exceed the memory available."""
    available = available_memory() if available is None else available
    if available is not None and required > available:
        raise UserError(
            f"{what} needs {human(required)} but only {human(available)} of memory is "
            "available: lower --window (or use --kv-bits 4)"
        )


def check_spec(model: Any, spec: Any) -> None:
    """A :class:`UserError` when a cache of ``spec`` (a ``CacheSpec``) cannot be
    allocated for ``model``: a group size that does not divide its head dimension, or
    more bytes than the memory available (both figures)."""
    layout = model_layout(model)
    if layout is None:
        return
    dims = {layout.key_dim, layout.value_dim}
    if spec.kv_bits is not None and any(d % spec.kv_group_size for d in dims):
        raise UserError(
            f"--kv-group-size {spec.kv_group_size} does not divide the model's head "
            f"dimension {min(dims)}; use one that does"
        )
    need = spec.bytes_for(layout)
    check_fits(need, f"the KV cache (sinks {spec.sinks} + window {spec.window})")


def activation_bytes(folder: str | os.PathLike, dtype: str) -> int:
    """Bytes per element of keys and values for a folder loaded under ``dtype``: the
    float dtype, or for ``"quantized"`` the dtype of its float tensors (scales)."""
    if dtype != "quantized":
        return DTYPE_BYTES[dtype]
    for file in sorted(Path(folder).glob("*.safetensors")):
        for kind, _ in _safetensors_header(file).values():
            if kind in ("F32", "F16", "BF16"):
                return DTYPE_BYTES[kind]
    return 2


def folder_estimate(folder: str | os.PathLike, dtype: str, sinks: int, window: int,
                    slack: int = DEFAULT_SLACK) -> dict:  # fmt: skip
    """The memory a model folder will take, before loading it: weights under the dtype
    policy ``dtype`` and the full KV cache at ``sinks + window + slack`` slots."""
    config = json.loads((Path(folder) / "config.json").read_text())
    layout = config_layout(config, activation_bytes(folder, dtype))
    return summary(weights_bytes(folder, dtype), cache_bytes(layout, sinks, window, slack))


def summary(weights: int, cache: int) -> dict:
    """Weights, KV cache, their total and the memory available, in bytes."""
    return {"weights_bytes": weights, "kv_cache_bytes": cache, "total_bytes": weights + cache,
            "available_bytes": available_memory()}  # fmt: skip


def describe(estimate: dict) -> str:
    """One line: ``weights 540.0 MB + KV cache 50.4 MB reserved = 590.4 MB (fits in
    20.1 GB available)``: the cache's buffers are allocated at its full window."""
    total, available = estimate["total_bytes"], estimate["available_bytes"]
    line = (f"weights {human(estimate['weights_bytes'])} + KV cache "
            f"{human(estimate['kv_cache_bytes'])} reserved = {human(total)}")  # fmt: skip
    if available is None:
        return line
    verdict = "fits in" if total <= available else "does NOT fit in"
    return f"{line} ({verdict} {human(available)} available)"


def bytes_per_token(
    layers: int, kv_heads: int, key_dim: int, value_dim: int, dtype_bytes: int,
    bits: int | None = None, group: int = 64,
) -> int:  # fmt: skip
    """Store bytes one token costs over all layers (keys and values; summaries apart)."""

    def one(dim: int) -> int:
        if bits is None:
            return dim * dtype_bytes
        return dim * bits // 8 + 2 * (dim // group) * dtype_bytes

    return layers * kv_heads * (one(key_dim) + one(value_dim))


def recall_bytes(layout: KVLayout, sinks: int, blocks: int, block: int = DEFAULT_STRIDE,
                 bits: int | None = None, group: int = 64, sink_copy: bool = True) -> dict:  # fmt: skip
    """What the recall tier adds: its fixed device region (``blocks * block`` slots per
    layer, plus a moved copy of the sinks with ``sink_copy``: the ``stream`` placement), the
    bytes the store uses per 1,000 evicted tokens (host memory, then disk; block
    summaries included: the default selector's minimum and maximum of the keys,
    ``2 * kv_heads * key_dim`` numbers of the keys' dtype per block and layer)
    and the room it reserves at a time (``store_segment_bytes``: a segment of every
    layer)."""
    slots = (sinks if sink_copy else 0) + blocks * block
    region = layout.layers * layout.kv_heads * slots * (layout.key_dim + layout.value_dim)
    per_token = bytes_per_token(layout.layers, layout.kv_heads, layout.key_dim,
                                layout.value_dim, layout.dtype_bytes, bits, group)  # fmt: skip
    summaries = layout.layers * 2 * layout.kv_heads * layout.key_dim * layout.dtype_bytes / block
    return {"region_bytes": region * layout.dtype_bytes,
            "store_bytes_per_1k_tokens": int(1000 * (per_token + summaries)),
            "store_segment_bytes": int(RECALL_SEGMENT * block * per_token)}  # fmt: skip
