"""The rolling KV buffer: attention sinks + a window of recent tokens (StreamingLLM).

Contract: every query token attends to the first ``sinks`` tokens of the stream and to
the most recent ``window`` tokens up to and including itself, nothing else, for
single-token decode and for multi-token calls alike (each row of a chunk gets its own
window through an array mask). Memory is one buffer per layer of ``sinks + window +
slack`` slots, allocated at the first update and written in place forever after.

Positions follow StreamingLLM's "positions within the cache": mlx-lm models rotate keys
with ``rope(x, offset=cache.offset)`` before storing them, so the cache chooses
``offset`` and keeps it bounded (``max_offset``), moves the sink keys to sit right before
the oldest window token, and rebases the window keys now and then. Both moves are the
layer's own rope applied to stored keys, i.e. pure rotations, and happen only at token
indices that are multiples of ``stride``: a call that never crosses one
(``max_call_tokens``) sees exactly what token-by-token decoding would see.

``SinkCache`` speaks mlx-lm's prompt-cache protocol (``update_and_fetch``, ``offset``,
``make_mask``, ``state``, ``trim``...), so a list of them is a valid ``prompt_cache`` for
``mlx_lm.generate.stream_generate``, ``generate_step`` and ``speculative_generate_step``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

POSITIONS = ("cache", "absolute")
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 1024
DEFAULT_STRIDE = 64


class SinkCache(mlx_cache._BaseCache):
    """A fixed-size KV cache keeping ``sinks`` first tokens and a ``window`` of recent ones.

    Args:
        sinks (int): Number of first tokens kept forever. Default: ``4``.
        window (int): Number of most recent tokens each query sees. Default: ``1024``.
        slack (int): Extra slots: the largest multi-token call (prefill chunk,
            speculative verify block) and the deepest rollback are ``slack + 1``
            tokens. Default: ``64``.
        stride (int): Sinks move and the buffer rebases only at multiples of this
            token index. Default: ``64``.
        rope (nn.Module, optional): The layer's rope module, used to move stored keys.
            Required for ``positions="cache"`` once the window starts sliding.
        positions (str): ``"cache"`` (bounded StreamingLLM positions) or
            ``"absolute"`` (mlx-lm's behaviour: positions grow with the stream).
            Default: ``"cache"``.
        kv_bits (int, optional): Store keys and values quantized to 4 or 8 bits with
            ``mx.quantize`` (attention then runs mlx-lm's quantized path). Sink keys are
            re-derived from a full-precision copy whenever they move. Default: ``None``.
        kv_group_size (int): Quantization group size (32, 64 or 128; divides the
            head dimension). Default: ``64``.
        key_bits (int, optional): Bits for the keys when they differ from ``kv_bits``
            (keys carry most of the quantization error: 8-bit keys with 4-bit values
            cost little perplexity). Attention then runs on dequantized float keys and
            values. Default: ``kv_bits``.
    """

    def __init__(
        self,
        sinks: int = DEFAULT_SINKS,
        window: int = DEFAULT_WINDOW,
        slack: int = DEFAULT_STRIDE,
        stride: int = DEFAULT_STRIDE,
        rope: nn.Module | None = None,
        positions: str = "cache",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        key_bits: int | None = None,
    ):
        key_bits = kv_bits if key_bits is None else key_bits
        validate_sizes(sinks, window, slack, stride, positions, kv_bits, kv_group_size, key_bits)
        self.sinks, self.window, self.slack, self.stride = sinks, window, slack, stride
        self.positions = positions
        self.rope = rope
        self.capacity = sinks + window + slack
        # Rebase often enough to bound positions, rarely enough to cost < 1 token/token.
        self.rebase_every = stride * math.ceil(self.capacity / stride)
        self.keys = None
        self.values = None
        self.sink_keys = None  # sink keys as first written (their natural positions)
        self.tokens_seen = 0
        self._slots = np.full(self.capacity, -1, dtype=np.int64)  # token index per slot
        self._filled = 0  # slots ever written (high-water mark)
        self._layout_applied = (0, 0)  # (base, sink_start) the stored keys are in
        self._layout_stride = -1  # stride index (token // stride) the layout was set for
        self._mscale = None
        self.kv_group_size = kv_group_size
        self.key_bits, self.value_bits = key_bits, kv_bits
        if kv_bits is not None and key_bits == kv_bits:
            # Only a cache that returns quantized tuples has ``bits``: mlx-lm routes
            # attention to its quantized kernel on hasattr(cache, "bits").
            self.bits, self.group_size = kv_bits, kv_group_size

    # ----- positions ---------------------------------------------------------------

    def _layout(self, n: int) -> tuple[int, int]:
        """(base, sink_start) for a call whose first token has index ``n``.

        Stored keys sit at RoPE position ``token_index - base``; the sinks sit at
        ``sink_start + i - base``, right before the oldest window token of the first
        token of ``n``'s stride.
        """
        if self.positions == "absolute":
            return 0, 0
        sink_start = max(0, (n // self.stride) * self.stride - self.window + 1 - self.sinks)
        rebased_at = (n // self.rebase_every) * self.rebase_every
        base = max(0, rebased_at - self.window + 1 - self.sinks)
        return base, sink_start

    @property
    def offset(self) -> int:
        """RoPE position of the next token (``< max_offset`` for ``positions="cache"``)."""
        return self.tokens_seen - self._layout(self.tokens_seen)[0]

    @property
    def max_offset(self) -> int:
        """Upper bound of ``offset`` (exclusive) when ``positions="cache"``."""
        return self.sinks + self.window + self.rebase_every

    def _shift(self, x: mx.array, d: int) -> mx.array:
        """Move post-RoPE keys ``x`` (B, H, L, D) by ``d`` positions (a pure rotation)."""
        if d == 0:
            return x
        if self.rope is None:
            raise ValueError(
                "SinkCache needs the layer's rope module to move keys "
                "(build it with make_sink_cache, or use positions='absolute')"
            )
        B, H, L, D = x.shape
        moved = self.rope(x.reshape(B, H, L, 1, D), offset=d).reshape(B, H, L, D)
        scale = self._rope_scale(D)
        return moved if scale == 1.0 else (moved / scale).astype(x.dtype)

    def _rope_scale(self, head_dim: int) -> float:
        """The magnitude factor of the rope (YaRN's mscale); 1.0 for a pure rotation."""
        if self._mscale is None:
            probe = mx.random.normal((1, 1, 4, 1, head_dim), key=mx.random.key(0))
            out = self.rope(probe, offset=0)
            scale = (mx.linalg.norm(out) / mx.linalg.norm(probe)).item()
            self._mscale = 1.0 if abs(scale - 1.0) < 1e-4 else scale
        return self._mscale

    def _apply_layout(self, n: int) -> None:
        """Bring stored keys into the layout of a call starting at token ``n``."""
        if n // self.stride == self._layout_stride:  # it only changes at stride multiples
            return
        base, sink_start = self._layout(n)
        self._layout_stride = n // self.stride
        old_base, old_sink_start = self._layout_applied
        if (base, sink_start) == (old_base, old_sink_start):
            return
        S, C = self.sinks, self.capacity
        if base != old_base:
            self._set(self.keys, S, C, self._moved(self.keys, S, C, old_base - base))
        if S > 0 and sink_start - base != old_sink_start - old_base:
            # Re-derived from the full-precision first-written copy: moves never
            # accumulate rounding or quantization error.
            moved = self._shift(self.sink_keys, sink_start - base)
            self._set(self.keys, 0, S, self._pack(moved, self.key_bits))
        self._layout_applied = (base, sink_start)

    # ----- storage (float arrays, or (packed, scales, biases) tuples) ---------------

    @property
    def quantized(self) -> bool:
        """Whether keys or values are stored quantized."""
        return self.value_bits is not None

    def _pack(self, x: mx.array, bits: int | None):
        if bits is None:
            return x
        return tuple(mx.quantize(x, group_size=self.kv_group_size, bits=bits))

    def _unpack(self, x, bits: int | None):
        if bits is None:
            return x
        return mx.dequantize(*x, group_size=self.kv_group_size, bits=bits)

    def _zeros(self, B: int, H: int, D: int, dtype, bits: int | None):
        return self._pack(mx.zeros((B, H, self.capacity, D), dtype), bits)

    @staticmethod
    def _get(buf, start: int, stop: int):
        if start == 0 and stop == (buf[0] if isinstance(buf, tuple) else buf).shape[-2]:
            return buf  # the whole buffer: no slice op in the decode graph
        if isinstance(buf, tuple):
            return tuple(b[..., start:stop, :] for b in buf)
        return buf[..., start:stop, :]

    @staticmethod
    def _set(buf, start: int, stop: int, src, src_start: int = 0) -> None:
        n = stop - start
        pairs = zip(buf, src) if isinstance(buf, tuple) else ((buf, src),)
        for b, x in pairs:
            whole = src_start == 0 and x.shape[-2] == n  # no slice op on the decode path
            b[..., start:stop, :] = x if whole else x[..., src_start : src_start + n, :]

    def _moved(self, buf, start: int, stop: int, d: int):
        """Keys of slots ``start:stop`` moved by ``d`` positions, in storage form."""
        bits = self.key_bits
        return self._pack(self._shift(self._unpack(self._get(buf, start, stop), bits), d), bits)

    # ----- slots -------------------------------------------------------------------

    def _slot(self, t: int) -> int:
        S = self.sinks
        return t if t < S else S + (t - S) % (self.capacity - S)

    def _runs(self, n: int, N: int):
        """Contiguous (slot, source, length) runs where tokens ``n..n+N-1`` go."""
        if N == 1:
            return ((self._slot(n), 0, 1),)
        runs, i = [], 0
        while i < N:
            slot = self._slot(n + i)
            end = self.sinks if n + i < self.sinks else self.capacity
            length = min(N - i, end - slot)
            runs.append((slot, i, length))
            i += length
        return runs

    def _room(self, n: int) -> int:
        """Most tokens a call at ``n`` may write without overwriting one a row needs."""
        ring = self.capacity - self.sinks
        return ring + max(self.sinks, n - self.window + 1) - n

    def max_call_tokens(self) -> int:
        """Most tokens the next model call may feed: no overwritten token a row still
        needs, and no stride boundary where the sink/rebase layout changes."""
        n = self.tokens_seen
        room = self._room(n)
        if self.positions == "absolute":
            return room
        layout = self._layout(n)
        m = (n // self.stride + 1) * self.stride
        while m - n < room and self._layout(m) == layout:
            m += self.stride
        return min(room, m - n)

    def _slots_after(self, N: int) -> np.ndarray:
        slots = self._slots.copy()
        n = self.tokens_seen
        for slot, i, length in self._runs(n, N):
            slots[slot : slot + length] = np.arange(n + i, n + i + length)
        return slots

    def _in_order(self, N: int) -> bool:
        """True while nothing was evicted: the buffer then is exactly a KVCache."""
        return self.tokens_seen + N <= self.sinks + self.window

    # ----- mlx-lm cache protocol ---------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, n_kv_heads, N, head_dim = keys.shape
        n = self.tokens_seen
        if N > self._room(n):
            raise ValueError(
                f"a call of {N} tokens at token {n} would overwrite tokens still in the "
                f"window (at most {self._room(n)} here); raise slack (now {self.slack}) "
                "or feed smaller chunks"
            )
        if self.keys is None:
            if self.quantized and (
                head_dim % self.kv_group_size or values.shape[-1] % self.kv_group_size
            ):
                raise ValueError(
                    f"kv_group_size {self.kv_group_size} does not divide the head dimension "
                    f"{head_dim}; use a group size that does"
                )
            self.keys = self._zeros(B, n_kv_heads, head_dim, keys.dtype, self.key_bits)
            self.values = self._zeros(
                B, n_kv_heads, values.shape[-1], values.dtype, self.value_bits
            )
            if self.sinks > 0 and self.positions == "cache":
                self.sink_keys = mx.zeros((B, n_kv_heads, self.sinks, head_dim), keys.dtype)
        self._apply_layout(n)
        packed_keys = self._pack(keys, self.key_bits)
        packed_values = self._pack(values, self.value_bits)
        for slot, i, length in self._runs(n, N):
            self._set(self.keys, slot, slot + length, packed_keys, i)
            self._set(self.values, slot, slot + length, packed_values, i)
            if slot < self.sinks and self.sink_keys is not None:
                self._set(self.sink_keys, slot, slot + length, keys, i)
            self._slots[slot : slot + length] = range(n + i, n + i + length)
        in_order = self._in_order(N)
        self.tokens_seen += N
        self._filled = max(self._filled, min(self.capacity, self.tokens_seen))
        L = self.tokens_seen if in_order else self._filled
        keys, values = self._get(self.keys, 0, L), self._get(self.values, 0, L)
        if self.quantized and not hasattr(self, "bits"):
            # Mixed key/value bits: attention runs on dequantized floats.
            return self._unpack(keys, self.key_bits), self._unpack(values, self.value_bits)
        return keys, values

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """The mask for the next ``N`` tokens, describing the buffer after they are
        written. Before the first eviction it is mlx-lm's own causal mask; after it, a
        boolean array when ``return_array`` (models that combine masks ask for one),
        else the same mask in additive form (0 or -inf, the cache's dtype)."""
        n = self.tokens_seen
        if self._in_order(N):
            return mlx_cache.create_attention_mask(
                N, offset=n, return_array=return_array, window_size=window_size
            )
        slots = self._slots_after(N)
        L = max(self._filled, min(self.capacity, n + N))
        t = slots[None, :L]
        q = np.arange(n, n + N)[:, None]
        visible = (t >= 0) & (t <= q) & ((t < self.sinks) | (t > q - self.window))
        if window_size is not None:
            visible &= t > q - window_size
        if return_array or self.values is None:
            return mx.array(visible)  # the model combines masks (&): boolean form
        # Additive form for a model that only hands the mask to attention: MLX's CPU
        # attention adds it in one pass where a boolean mask costs a select; same
        # scores (+0 or -inf); decode attention 1.15x -> 1.13x mlx-lm's rotating cache
        # at window 1024 here (benchmarks/attention.py).
        dtype = self.values[1].dtype if isinstance(self.values, tuple) else self.values.dtype
        return mx.array(np.where(visible, 0.0, -np.inf), dtype=dtype)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens, restoring exactly the state before they were
        added. Exact for ``n <= slack + 1`` at any point of the stream."""
        n = min(n, self.tokens_seen)
        keep = self.tokens_seen - n
        lost_newest = self.tokens_seen - 1 - (self.capacity - self.sinks)
        if n and lost_newest >= max(self.sinks, keep - self.window + 1):
            raise ValueError(
                f"cannot trim {n} tokens: they overwrote tokens that would be back in the "
                f"window (trim at most slack + 1 = {self.slack + 1})"
            )
        for t in range(keep, self.tokens_seen):
            self._slots[self._slot(t)] = -1
        self.tokens_seen = keep
        return n

    def size(self) -> int:
        """Tokens the next query sees (at most ``sinks + window``)."""
        return min(self.tokens_seen, self.sinks + self.window)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in tree_flatten(self.state))

    @property
    def state(self):
        if self.keys is None:
            return []
        arrays = [self.keys, self.values]
        return arrays + ([self.sink_keys] if self.sink_keys is not None else [])

    @state.setter
    def state(self, v):
        v = list(v)
        self.keys = tuple(v[0]) if self.key_bits else v[0]
        self.values = tuple(v[1]) if self.value_bits else v[1]
        self.sink_keys = v[2] if len(v) > 2 else None

    @property
    def meta_state(self) -> dict:
        return {
            "sinks": self.sinks,
            "window": self.window,
            "slack": self.slack,
            "stride": self.stride,
            "positions": self.positions,
            "tokens_seen": self.tokens_seen,
            "filled": self._filled,
            "layout_applied": list(self._layout_applied),
            "slots": self._slots.tolist(),
            "kv_bits": self.value_bits,
            "kv_group_size": self.kv_group_size,
            "key_bits": self.key_bits,
        }

    @meta_state.setter
    def meta_state(self, meta: dict) -> None:
        self.__init__(
            meta["sinks"],
            meta["window"],
            meta["slack"],
            meta["stride"],
            self.rope,
            meta["positions"],
            meta.get("kv_bits"),
            meta.get("kv_group_size", 64),
            meta.get("key_bits"),
        )
        self.tokens_seen = meta["tokens_seen"]
        self._filled = meta["filled"]
        self._layout_applied = tuple(meta["layout_applied"])
        self._slots = np.array(meta["slots"], dtype=np.int64)

    def __deepcopy__(self, memo):
        # The rope module is shared (it belongs to the model); everything else is copied.
        clone = copy.copy(self)
        clone._slots = self._slots.copy()
        for name in ("keys", "values", "sink_keys"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = tuple(mx.array(x) for x in value)
            elif value is not None:
                value = mx.array(value)
            setattr(clone, name, value)
        return clone


def validate_sizes(
    sinks: int,
    window: int,
    slack: int = DEFAULT_STRIDE,
    stride: int = DEFAULT_STRIDE,
    positions: str = "cache",
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    key_bits: int | None = None,
) -> None:
    """Raise ValueError, saying what to change, for sizes a SinkCache cannot have."""
    if window < 1:
        raise ValueError(f"window must be at least 1 (got {window})")
    if sinks < 0:
        raise ValueError(f"sinks must be 0 or more (got {sinks})")
    if slack < 1:
        raise ValueError(f"slack must be at least 1 (got {slack})")
    if stride < 1:
        raise ValueError(f"stride must be at least 1 (got {stride})")
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(POSITIONS)} (got {positions!r})")
    if kv_bits not in (None, 4, 8):
        raise ValueError(f"kv_bits must be 4 or 8 (got {kv_bits})")
    if key_bits not in (None, 4, 8) or (key_bits is not None and kv_bits is None):
        raise ValueError(f"key_bits must be 4 or 8, with kv_bits set (got {key_bits})")
    if kv_bits is not None and kv_group_size not in (32, 64, 128):
        raise ValueError(f"kv_group_size must be 32, 64 or 128 (got {kv_group_size})")


def _layers(model: nn.Module) -> list:
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the layers of {type(model).__name__}")
    return layers


def find_rope(layer: nn.Module) -> nn.Module | None:
    """The rope module of a transformer layer (``self_attn.rope`` and the like)."""
    for name, module in layer.named_modules():
        if name.split(".")[-1] in ("rope", "rotary_emb") and callable(module):
            return module
    return None


def make_sink_cache(
    model: nn.Module,
    sinks: int = DEFAULT_SINKS,
    window: int = DEFAULT_WINDOW,
    slack: int | None = None,
    stride: int = DEFAULT_STRIDE,
    positions: str = "cache",
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    key_bits: int | None = None,
) -> list:
    """The model's prompt cache with every unbounded ``KVCache`` layer made a SinkCache.

    Bounded layers a model makes itself (``RotatingKVCache`` sliding windows,
    ``ArraysCache`` SSM state) are kept as they are.

    Args:
        model (nn.Module): An mlx-lm model.
        sinks (int): Attention sinks kept forever. Default: ``4``.
        window (int): Recent tokens each query sees. Default: ``1024``.
        slack (int, optional): Extra slots for multi-token calls and rollback.
            Default: ``stride``.
        stride (int): Token stride of sink moves and rebases. Default: ``64``.
        positions (str): ``"cache"`` or ``"absolute"``. Default: ``"cache"``.
        kv_bits (int, optional): Quantize the cache to 4 or 8 bits. Default: ``None``.
        kv_group_size (int): Quantization group size. Default: ``64``.
        key_bits (int, optional): Key bits when they differ from ``kv_bits``.
            Default: ``kv_bits``.

    Returns:
        list: One cache per layer, usable as mlx-lm's ``prompt_cache``.
    """
    slack = stride if slack is None else slack
    validate_sizes(sinks, window, slack, stride, positions, kv_bits, kv_group_size, key_bits)
    caches = mlx_cache.make_prompt_cache(model)
    layers = _layers(model)
    out = []
    for i, c in enumerate(caches):
        if type(c) is mlx_cache.KVCache:
            rope = find_rope(layers[i]) if i < len(layers) else None
            if rope is None and positions == "cache":
                raise ValueError(
                    f"layer {i} of {type(model).__name__} has no rope module to move keys "
                    "with; use positions='absolute'"
                )
            out.append(
                SinkCache(
                    sinks,
                    window,
                    slack,
                    stride,
                    rope,
                    positions,
                    kv_bits,
                    kv_group_size,
                    key_bits,
                )  # fmt: skip
            )
        elif isinstance(c, (mlx_cache.RotatingKVCache, mlx_cache.ArraysCache)):
            out.append(c)
        else:
            raise ValueError(
                f"layer {i} uses a {type(c).__name__}, which mlx-stream cannot bound; "
                "supported: KVCache (made a SinkCache), RotatingKVCache, ArraysCache"
            )
    return out


def max_call_tokens(caches: list) -> int | None:
    """The most tokens the next call may feed to every SinkCache in ``caches``
    (``None`` when the list holds none)."""
    limits = [c.max_call_tokens() for c in caches if isinstance(c, SinkCache)]
    return min(limits) if limits else None


def save_cache(path: str | os.PathLike, caches: list, metadata: dict | None = None) -> None:
    """Save a prompt cache (SinkCache and mlx-lm caches) to ``path`` (safetensors),
    atomically: a failed save leaves any earlier file untouched.

    Args:
        path: Destination file.
        caches (list): The prompt cache.
        metadata (dict, optional): Strings saved along (e.g. a transcript).
    """
    arrays, layers = {}, []
    for i, c in enumerate(caches):
        state = list(c.state) if isinstance(c, SinkCache) else c.state
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".safetensors")
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, header)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_cache(path: str | os.PathLike, model: nn.Module | None = None) -> tuple[list, dict]:
    """Load a prompt cache saved by ``save_cache``.

    Args:
        path: The file.
        model (nn.Module, optional): The model it belongs to; SinkCaches need its rope
            modules to keep moving sinks.

    Returns:
        tuple: ``(caches, metadata)``.
    """
    try:
        arrays, header = mx.load(str(path), format="safetensors", return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path} is not a readable cache file ({e})") from e
    if "mlx_stream" not in header:
        raise ValueError(f"{path} is not an mlx-stream cache file")
    layers = json.loads(header.pop("mlx_stream"))["layers"]
    model_layers = _layers(model) if model is not None else []
    caches = []
    for i, layer in enumerate(layers):
        flat = [
            (k, arrays[f"{i}.{k}"] if f"{i}.{k}" in arrays else layer["scalars"][k])
            for k in layer["keys"]
        ]
        state = tree_unflatten(flat) if flat else []
        if layer["class"] == "SinkCache":
            rope = find_rope(model_layers[i]) if i < len(model_layers) else None
            c = SinkCache(rope=rope)
            c.meta_state = layer["meta"]
            if state:
                c.state = state
        else:
            cls = getattr(mlx_cache, layer["class"])
            c = cls.from_state(tuple(state) if isinstance(state, list) else state)
        caches.append(c)
    return caches, header
