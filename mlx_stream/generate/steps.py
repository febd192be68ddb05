"""Decode primitives shared by the plain, speculative and batched loops.

Contract: token arrays, per-call sizes the caches admit, rewinding, sampling one row
of logits, the bounded history logits processors read, and :class:`DecodeState`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlx_stream.cache.sink import max_call_tokens
from mlx_stream.errors import UserError

# Logits processors (repetition penalty...) look back a few dozen tokens; mlx-lm keeps
# the whole history, which grows forever in a stream: keep the most recent ones only.
HISTORY_TOKENS = 1024


@dataclass
class DecodeState:
    """Progress of one :func:`generate_step` call, updated as it runs.

    Attributes:
        prompt_tokens: Tokens in the prompt.
        prompt_processed: Prompt tokens fed so far.
        generated: Tokens yielded so far.
        drafted: Draft tokens proposed (speculative decoding).
        accepted: Draft tokens accepted.
        cache_tokens: Tokens of this call (prompt + generated) the target cache holds;
            ``prompt_tokens + generated`` once the generator has stopped.
        last_token: The last token yielded.
        consistent: False only if an exception inside the generator interrupted a
            model call; the caches must then be rebuilt.
        prompt_time: Seconds until the first token was ready.
        on_prompt_fed: Called once all of the prompt but its last token is in the
            caches, before the last goes in (a server takes its turn marks there).
    """

    prompt_tokens: int = 0
    prompt_processed: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    cache_tokens: int = 0
    last_token: int | None = None
    consistent: bool = True
    prompt_time: float = 0.0
    on_prompt_fed: Callable[[], None] | None = None


def as_tokens(prompt: mx.array | list[int]) -> mx.array:
    """``prompt`` as a flat uint32 array."""
    tokens = prompt if isinstance(prompt, mx.array) else mx.array(list(prompt))
    return tokens.reshape(-1).astype(mx.uint32)


def call_size(cache: list, limit: int, n: int) -> int:
    """Tokens the next call may feed: ``n`` capped by ``limit`` and the cache."""
    bound = max_call_tokens(cache)
    size = min(n, limit) if bound is None else min(n, limit, bound)
    assert size >= 1, f"the cache admits no token (max_call_tokens={bound})"
    return size


def rewind(cache: list, n: int) -> None:
    """Trim ``n`` tokens from every layer, or raise if a layer cannot."""
    if n <= 0:
        return
    for c in cache:
        if not c.is_trimmable():
            raise UserError(
                f"cannot rewind a {type(c).__name__} by {n} tokens (mlx-lm's "
                "RotatingKVCache stops being trimmable once it wraps); use SinkCache"
            )
        trimmed = c.trim(n)
        assert trimmed == n, f"{type(c).__name__} trimmed {trimmed} of {n} tokens"


def sample(logits, history, sampler, processors):
    """Process and sample one row of logits (1, V); returns (token (1,), logprobs (1, V))."""
    for processor in processors:
        logits = processor(history, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs


def extend_history(history, tokens):
    """``history`` (or none) and ``tokens``: the last ``HISTORY_TOKENS`` a logits processor reads."""
    if history is None:
        return tokens[-HISTORY_TOKENS:]
    return mx.concatenate([history, tokens])[-HISTORY_TOKENS:]
