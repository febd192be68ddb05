"""Per-request sampling for ``serve``, with OpenAI's meanings.

Contract: each function returns mlx-lm style pieces the decode loop and the batch rows
take: a sampler ``logprobs -> token`` and logits processors ``(tokens, logits) ->
logits``, made for ONE reply and keeping state (each call's ``tokens[-1]`` is the
token the call before sampled). ``logit_bias`` is mlx-lm's processor; presence and
frequency penalties count over the whole reply; :func:`resolve` gives a request that
names a temperature exactly what it names, one that names none the server's defaults
under what it names; a ``seed`` gives a sampler its own key, split as a batch row
splits it, so batched and alone agree. In full: ``docs/serve.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors

from mlx_stream.errors import UserError


class ReplyPenalties:
    """OpenAI's presence and frequency penalties over the tokens of one reply:
    ``logits - presence * [count > 0] - frequency * count``."""

    def __init__(self, presence: float = 0.0, frequency: float = 0.0):
        self.presence, self.frequency = presence, frequency
        self.counts: mx.array | None = None
        self.calls = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.calls:
            # Lazy: the count follows the sampled token without reading it (no sync).
            hit = (mx.arange(logits.shape[-1]) == tokens.reshape(-1)[-1]).astype(mx.float32)
            self.counts = hit if self.counts is None else self.counts + hit
        self.calls += 1
        if self.counts is None:
            return logits
        penalty = self.presence * (self.counts > 0) + self.frequency * self.counts
        return (logits - penalty).astype(logits.dtype)


def keyed_sampler(temp: float, top_p: float, seed: int) -> Callable[[mx.array], mx.array]:
    """A sampler drawing with its own key from ``seed`` (greedy at ``temp == 0``)."""
    # By hand: mlx-lm's make_sampler draws from the process's global random state.
    if temp == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    state = [mx.random.key(seed)]

    def sampler(logprobs: mx.array) -> mx.array:
        state[0], key = mx.random.split(state[0])
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1.0 / temp), key=key)

    return sampler


def check_logit_bias(logit_bias: dict | None, vocab: int) -> dict[int, float] | None:
    """``logit_bias`` with integer token ids, or a :class:`UserError` naming it."""
    if not logit_bias:
        return None
    out = {}
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise UserError(f"logit_bias: {key!r} is not a token id") from None
        if not 0 <= token < vocab:
            raise UserError(
                f"logit_bias: token id {token} is not in the vocabulary (0-{vocab - 1})"
            )
        out[token] = float(value)
    return out


def processors(
    logit_bias: dict | None, presence: float | None, frequency: float | None, vocab: int,
    top_k: int | None = None,
) -> list[Callable[[mx.array, mx.array], mx.array]]:  # fmt: skip
    """The logits processors of one reply (empty when nothing is asked); ``top_k``
    keeps the k most likely tokens (mlx-lm's ``apply_top_k``, before the sampler)."""
    out: list[Any] = make_logits_processors(logit_bias=check_logit_bias(logit_bias, vocab))
    if presence or frequency:
        out.append(ReplyPenalties(presence or 0.0, frequency or 0.0))
    if top_k and top_k < vocab:
        out.append(lambda _, logits: apply_top_k(logits, top_k))
    return out


def resolve(request: Any, defaults: Any, draft: bool = False) -> float | None:
    """Fill in, on ``request``, the sampling it leaves out (``temp``, ``top_p``,
    ``top_k``) and return the repetition penalty to apply (``None``: none).

    A request that names a temperature gets exactly what it names; one that names none
    gets ``defaults`` (a :class:`~mlx_stream.generate.model_config.Sampling`) under
    what it does name. With a draft model the defaults' top-k and repetition penalty
    are left out (speculative decoding takes no logits processors); a request's own
    are refused by :func:`overrides`."""
    if request.temp is not None:
        request.top_p = 1.0 if request.top_p is None else request.top_p
        return None
    request.temp = defaults.temp
    request.top_p = defaults.top_p if request.top_p is None else request.top_p
    if draft:
        return None
    if request.top_k is None and defaults.top_k:
        request.top_k = defaults.top_k
    penalty = defaults.repetition_penalty
    return penalty if penalty not in (None, 1.0) else None


def overrides(
    request: Any, temp: float, top_p: float, vocab: int, constraint: Any = None,
    draft: bool = False, repetition_penalty: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``stream_generate`` arguments for one engine request: its logits processors
    (``constraint``, then ``logit_bias``, penalties, ``top_k``, then mlx-lm's
    ``repetition_penalty`` over the last 20 tokens) and, with a ``seed``, a sampler with
    its own key, so the process's random state is never touched."""
    procs = processors(
        request.logit_bias, request.presence_penalty, request.frequency_penalty, vocab,
        request.top_k,
    )  # fmt: skip
    if constraint is not None:  # first: the processors after it only move allowed tokens
        procs.insert(0, constraint)
    if procs and draft:
        raise UserError(
            "logit_bias, penalties, response_format and forced tool calls are not "
            "supported with a draft model (speculative decoding)"
        )
    procs += make_logits_processors(repetition_penalty=repetition_penalty)
    out: dict[str, Any] = {}
    if procs:
        out["logits_processors"] = procs
    if request.seed is not None:  # a batch row keys itself the same way and ignores it
        out["sampler"] = keyed_sampler(temp, top_p, request.seed)
    return out
