"""Feeding a model through a cache as the decode loop does, and the token stream the
cache tests feed (ten windows and more)."""

import mlx.core as mx

from mlx_stream.cache.sink import max_call_tokens
from tests import tiny

S, W = 4, 32  # sinks and window of the stream
TOKENS = tiny.random_tokens(10 * W + 40, seed=7)


def feed(model, cache, tokens, chunk):
    """Logits of every token, fed in calls of at most ``chunk`` (and never more than
    the cache allows, as the decode loop does)."""
    out, i = [], 0
    while i < len(tokens):
        limit = max_call_tokens(cache) or chunk
        n = min(chunk, limit, len(tokens) - i)
        out.append(model(mx.array([tokens[i : i + n]]), cache=cache)[0])
        i += n
    return mx.concatenate(out)
