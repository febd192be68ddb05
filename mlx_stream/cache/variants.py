"""Which storage class a SinkCache layer holds, chosen from its settings by one map
(as mlx-lm keeps ``KVCache`` and ``QuantizedKVCache`` apart): float, quantized per
token (same bits: mlx-lm's quantized attention; other bits: dequantized), or keys
quantized per channel (``cache.channel``). All speak ``storage.SlotStorage``'s protocol.
"""

from __future__ import annotations

from mlx_stream.cache import kvquant
from mlx_stream.cache.channel import ChannelStorage
from mlx_stream.cache.storage import FloatStorage, MixedStorage, SlotStorage, TokenStorage

VARIANTS: dict[str, type[SlotStorage]] = {
    "float": FloatStorage,
    "token": TokenStorage,
    "mixed": MixedStorage,
    "channel": ChannelStorage,
}


def kind(key_bits: int | None, value_bits: int | None, token_keys: bool = False) -> str:
    """The variant of a cache with ``key_bits`` keys and ``value_bits`` values
    (``token_keys``: 8-bit keys kept per token, for the recall tier)."""
    if kvquant.per_channel(key_bits, token_keys):
        return "channel"
    if value_bits is None:
        return "float"
    return "token" if key_bits == value_bits else "mixed"


def storage_for(key_bits: int | None, value_bits: int | None, kv_group_size: int, sinks: int,
                token_keys: bool = False) -> SlotStorage:  # fmt: skip
    """An empty storage of the variant these settings choose."""
    cls = VARIANTS[kind(key_bits, value_bits, token_keys)]
    return cls(key_bits, value_bits, kv_group_size, sinks)
