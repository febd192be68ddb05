"""Feeding a prompt to models through their caches, a model call at a time.

Contract: every call feeds at most ``step`` tokens and at most what every cache admits
(``cache.max_call_tokens``), the caches are evaluated after each call, and the tokens
fed so far are reported after each; nothing is sampled, no prompt end is marked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from mlx_stream.generate.steps import call_size

#: Largest prefill call of a chat session (and of the prefix store's keys).
PREFILL_STEP = 512


def feed_steps(
    groups: Sequence[tuple[Any, list]],
    tokens: mx.array | list[int],
    step: int = PREFILL_STEP,
    stream: Any = None,
) -> Iterator[int]:
    """Feed ``tokens`` to every ``(model, caches)`` of ``groups``, all in the same
    chunks; yields the tokens fed so far after each chunk. ``stream``: the MLX
    stream each chunk runs on (entered per chunk, never across a yield)."""
    tokens = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens))
    done = 0
    while done < tokens.size:
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            n = min(call_size(c, step, tokens.size - done) for _, c in groups)
            chunk = tokens[None, done : done + n]
            for model, caches in groups:
                model(chunk, cache=caches)
            mx.eval([[layer.state for layer in c] for _, c in groups])
        done += n
        yield done


def feed_prompt(
    model: Any,
    caches: list,
    tokens: mx.array | list[int],
    step: int = PREFILL_STEP,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Feed ``tokens`` to ``model`` through ``caches`` (:func:`feed_steps`), calling
    ``progress(fed, total)`` after each call."""
    total = len(tokens) if not isinstance(tokens, mx.array) else tokens.size
    for done in feed_steps([(model, caches)], tokens, step):
        if progress is not None:
            progress(done, total)
