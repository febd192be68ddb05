"""Build a model's prompt cache: every unbounded ``KVCache`` layer made a SinkCache,
after the model's positions are verified; the extensions the spec asks for
(``cache.extension``) check and attach their state."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache import extension, qattend
from mlx_stream.cache.layer import SinkCache
from mlx_stream.cache.positions import check_model, model_type, position_limit
from mlx_stream.errors import Unsupported

#: Bounded caches a model makes itself, kept as they are (PASS-THROUGH).
KEPT = (mlx_cache.RotatingKVCache, mlx_cache.ArraysCache, mlx_cache.ChunkedKVCache)


def _refuse_layer(model, i: int, c) -> None:
    kind = type(c).__name__
    inner = ", ".join(type(x).__name__ for x in getattr(c, "caches", ()))
    why = {
        "CacheList": f"a CacheList ({inner}) couples caches mlx-stream cannot bound together",
    }.get(kind, f"a {kind}, which mlx-stream cannot bound")
    raise Unsupported(
        f"{model_type(model)}: layer {i} uses {why}; supported: KVCache (made a SinkCache), "
        "RotatingKVCache, ArraysCache, ChunkedKVCache"
    )


def _sink_cache(s: Any, verdict, i: int, token_keys: bool) -> SinkCache:
    """Layer ``i``'s SinkCache under spec ``s`` (``verdict``: the model's check)."""
    return SinkCache(s, verdict.moves.get(i), additive_mask=verdict.additive_mask,
                     token_keys=token_keys)  # fmt: skip


def _check_positions(model, ring) -> None:
    """Refuse a cache whose positions reach past what the model's rope is exact for."""
    limit = position_limit(model)
    highest = ring.max_offset + ring.room(ring.max_offset) - 1
    if limit is not None and highest >= limit[0]:
        raise Unsupported(
            f"{model_type(model)}: its {limit[1]} reads cache.offset and is exact only "
            f"while positions stay below {limit[0]}; this cache reaches {highest} "
            "(use a smaller window)"
        )


def build_sink_cache(model: nn.Module, spec: Any) -> list:
    """The prompt cache of ``make_sink_cache`` for a :class:`CacheSpec` (what
    ``CacheSpec.build`` returns, without its memory check)."""
    s = spec
    caches = mlx_cache.make_prompt_cache(model)
    for i, c in enumerate(caches):
        if type(c) is not mlx_cache.KVCache and not isinstance(c, KEPT):
            _refuse_layer(model, i, c)
    verdict = check_model(model, caches)
    extensions = extension.requested(s)
    for ext in extensions:  # refuses what it cannot serve; proves the attention seam
        s = ext.check(model, caches, verdict, s)
    # An extension (the recall tier) reads keys kept per token
    out = [_sink_cache(s, verdict, i, bool(extensions)) if type(c) is mlx_cache.KVCache else c
           for i, c in enumerate(caches)]  # fmt: skip
    first = next((c for c in out if isinstance(c, SinkCache)), None)
    if s.positions == "cache" and first is not None:
        if verdict.refusal:
            raise Unsupported(
                verdict.refusal + "; stream-run and eval can run it with --positions absolute"
                " (chat and serve need cache positions)"
            )
        _check_positions(model, first.ring)
    for ext in extensions:
        ext.attach(s, out)
    if not extensions and any(isinstance(c, SinkCache) and c.channel_keys for c in out):
        qattend.install(model, out)  # attention on the packed keys, where proven
    return out
