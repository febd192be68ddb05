"""The sink + window cache's public API: :class:`SinkCache` (one layer,
``cache.layer``), :func:`make_sink_cache` (``cache.build``), :func:`save_cache` and
:func:`load_cache` (``cache.saving``). A list of SinkCaches is a valid mlx-lm
``prompt_cache``. Design: docs/cache.md.
"""

from __future__ import annotations

import mlx.nn as nn

from mlx_stream.cache.build import KEPT, build_sink_cache  # noqa: F401
from mlx_stream.cache.layer import SinkCache  # noqa: F401
from mlx_stream.cache.relayout import UNKNOWN_STRIDE  # noqa: F401
from mlx_stream.cache.saving import load_cache, save_cache  # noqa: F401
from mlx_stream.cache.settings import validate_sizes  # noqa: F401
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.defaults import (  # noqa: F401
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_SINKS,
    DEFAULT_SLACK,
    DEFAULT_STRIDE,
    DEFAULT_WINDOW,
    POSITIONS,
)


def make_sink_cache(
    model: nn.Module,
    sinks: int = DEFAULT_SINKS,
    window: int = DEFAULT_WINDOW,
    slack: int | None = None,
    stride: int = DEFAULT_STRIDE,
    positions: str = "cache",
    kv_bits: int | None = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    key_bits: int | None = None,
    recall=None,
) -> list:
    """The model's prompt cache with every unbounded ``KVCache`` layer made a SinkCache.

    Bounded layers a model makes itself (``RotatingKVCache`` sliding windows,
    ``ArraysCache`` SSM state, ``ChunkedKVCache``) are kept as they are. Where each
    layer's cached tensors carry positions is found and verified on the model itself
    (``mlx_stream.cache.positions.check_model``, once per model); a model the cache cannot
    serve exactly is refused here, before the first token, with one line. The public
    shorthand for ``CacheSpec(sinks, window, ...).build(model, check_memory=False)``.

    Args:
        model (nn.Module): An mlx-lm model.
        sinks (int): Attention sinks kept forever. Default: ``4``.
        window (int): Recent tokens each query sees. Default: ``1024``.
        slack (int, optional): Extra ring slots for rollback (``trim(n)`` exact for
            ``n <= slack + 1``). Default: ``0``.
        stride (int): Token stride of sink moves and rebases. Default: ``64``.
        positions (str): ``"cache"`` or ``"absolute"``. Default: ``"cache"``.
        kv_bits (int, optional): Quantize the cache to 4 or 8 bits. Default: ``None``.
        kv_group_size (int): Quantization group size. Default: ``64``.
        key_bits (int, optional): Key bits when they differ from ``kv_bits``.
            Default: ``kv_bits``.
        recall (RecallSpec, optional): Keep evicted blocks and bring the ones the
            queries need back into attention (``mlx_stream.recall``); it may raise the
            slack. Default: ``None`` (off).

    Returns:
        list: One cache per layer, usable as mlx-lm's ``prompt_cache``.

    Raises:
        Unsupported: Impossible sizes, or a model this cache would serve inexactly.
    """
    spec = CacheSpec(sinks, window, slack, stride, positions, kv_bits, kv_group_size, key_bits,
                     recall)  # fmt: skip
    return build_sink_cache(model, spec)


def max_call_tokens(caches: list) -> int | None:
    """The most tokens the next call may feed to every SinkCache in ``caches``
    (``None`` when the list holds none)."""
    limits = [c.max_call_tokens() for c in caches if isinstance(c, SinkCache)]
    return min(limits) if limits else None
