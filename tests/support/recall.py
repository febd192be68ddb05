"""A small recall cache for tests: its sizes, its spec and a feeder."""

from __future__ import annotations

import mlx.core as mx

from mlx_stream.cache import make_sink_cache, max_call_tokens
from mlx_stream.recall import RecallSpec

SINKS, WINDOW, BLOCK = 2, 16, 8


def spec(**kw) -> RecallSpec:
    return RecallSpec(**{"blocks": 4, "block": BLOCK, **kw})


def recall_cache(model, **kw):
    return make_sink_cache(model, SINKS, WINDOW, stride=BLOCK, recall=spec(**kw))


def feed(model, cache, tokens, chunk: int = 8) -> mx.array:
    """Logits of every token, fed in calls of at most ``chunk`` tokens."""
    out, i = [], 0
    while i < len(tokens):
        n = min(chunk, max_call_tokens(cache), len(tokens) - i)
        logits = model(mx.array([tokens[i : i + n]]), cache=cache)[0]
        mx.eval(logits)
        out.append(logits)
        i += n
    return mx.concatenate(out, axis=0)
