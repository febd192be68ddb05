"""The decode engine: :func:`generate_step` (prompt, then token by token or
speculative) and :func:`stream_generate` (text, stop strings, sampling) on top.

Contract: every model call feeds at most ``max_call_tokens(prompt_cache)`` tokens, so
chunked prefill, decode steps and verify blocks give the same greedy tokens. However a
generator stops, the caches hold exactly the prompt plus every yielded token, unless an
exception inside a model call left ``DecodeState.consistent`` False (rebuild them; use
:class:`StopOnInterrupt` so Ctrl-C lands between tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_stream.cache.hooks import prompt_end
from mlx_stream.cache.reclaim import ReclaimSchedule, set_wired_limit
from mlx_stream.cache.sink import SinkCache
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.defaults import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS
from mlx_stream.errors import UserError
from mlx_stream.generate.interrupt import StopOnInterrupt  # noqa: F401 - re-exported
from mlx_stream.generate.loops import LoopGuard
from mlx_stream.generate.model_config import Sampling
from mlx_stream.generate.prefill import feed_steps
from mlx_stream.generate.sampler import make_sampling
from mlx_stream.generate.speculative import speculative
from mlx_stream.generate.steps import (
    HISTORY_TOKENS,  # noqa: F401 - re-exported
    DecodeState,
    as_tokens,
    extend_history,
    sample,
)
from mlx_stream.mlxlm import TextStateMachine, generation_stream


def generate_step(
    prompt: mx.array | list[int],
    model: nn.Module,
    prompt_cache: list,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Callable] | None = None,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    draft_model: nn.Module | None = None,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    prefill_step_size: int = 512,
    reclaim: ReclaimSchedule | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    state: DecodeState | None = None,
    stream: Any = generation_stream,
    poll: bool = False,
) -> Generator[tuple[int, mx.array, bool] | None, None, None]:
    """Generate tokens from ``prompt``, updating ``prompt_cache`` in place.

    Args:
        prompt (mx.array | list[int]): The new tokens to feed (at least one).
        model (nn.Module): The target model.
        prompt_cache (list): The target's cache, followed by the draft's cache when
            ``draft_model`` is given (mlx-lm's convention).
        sampler (Callable, optional): Logprobs -> token. Default: greedy.
        logits_processors (list[Callable], optional): ``(history, logits) -> logits``.
        max_tokens (int): Tokens to generate; ``-1`` for no limit. Default: ``256``.
        draft_model (nn.Module, optional): Draft model for speculative decoding.
        num_draft_tokens (int): Draft tokens per round, fewer where the caches admit
            fewer. Default: ``3``.
        prefill_step_size (int): Largest prefill chunk. Default: ``512``.
        reclaim (ReclaimSchedule, optional): When to clear MLX's buffer pool; its
            count is the tokens fed by this call. Default: crossing every 256.
        prompt_progress_callback (Callable[[int, int], None], optional): Called with
            (prompt tokens processed, prompt tokens).
        state (DecodeState, optional): Filled in as the generator runs.
        stream: The MLX stream to run on. Default: mlx-lm's generation stream.
        poll (bool): Yield ``None`` after each prefill chunk, so a consumer serving
            several requests can do other work (or stop) while a long prompt goes in.

    Yields:
        tuple[int, mx.array, bool]: The token, its logprobs (V,), and whether it was a
        draft token the target accepted (``None`` between prefill chunks with ``poll``).
    """
    prompt = as_tokens(prompt)
    if prompt.size == 0:
        raise UserError("the prompt must hold at least one token")
    if max_tokens == 0:
        raise UserError("max_tokens must be non-zero (use -1 for no limit)")
    state = state if state is not None else DecodeState()
    state.prompt_tokens = prompt.size
    reclaim = reclaim if reclaim is not None else ReclaimSchedule()
    sampler = sampler or make_sampler()
    processors = list(logits_processors or [])
    progress = prompt_progress_callback or (lambda *_: None)
    split = len(model.layers) if draft_model is not None else len(prompt_cache)
    target_cache, draft_cache = prompt_cache[:split], prompt_cache[split:]
    models = [(model, target_cache)]
    if draft_model is not None:
        if not draft_cache:
            raise UserError("speculative decoding needs the draft's cache after the target's")
        models.append((draft_model, draft_cache))
    history = extend_history(None, prompt) if processors else None

    tic = time.perf_counter()
    # Prefill all but the last prompt token, every model in the same chunks.
    total, before = prompt.size, 0
    progress(0, total)
    for done in feed_steps(models, prompt[:-1], prefill_step_size, stream):
        state.prompt_processed = state.cache_tokens = done
        progress(done, total)
        reclaim.step(before, done)
        before = done
        if poll:  # feed_steps enters the stream per chunk: a poll yields outside of it
            yield None
    if state.on_prompt_fed is not None:
        state.on_prompt_fed()
    with mx.stream(stream):
        for m, c in models:  # a client of the cache (recall) may act on the whole prompt
            prompt_end(m, c, prompt[:-1])

    run = speculative if draft_model is not None else _plain
    yield from run(
        prompt[-1:], models, sampler, processors, history, max_tokens, num_draft_tokens,
        prefill_step_size, reclaim, state, stream, lambda: progress(total, total), tic,
    )  # fmt: skip


def _plain(y, models, sampler, processors, history, max_tokens, _, step_size, reclaim,
           state, stream, prompt_done, tic):  # fmt: skip
    """Decode token by token, dispatching step n+1 before yielding token n."""
    (model, cache), = models  # fmt: skip
    safe = False  # True while suspended at a yield: the caches match the bookkeeping

    def _step(y, history):
        with mx.stream(stream):
            logits = model(y[None], cache=cache)[:, -1, :]
            return sample(logits, history, sampler, processors)

    try:
        y, logprobs = _step(y, history)
        mx.async_eval(y, logprobs)
        count = state.cache_tokens = state.cache_tokens + 1
        while True:
            # Feed y before yielding it (pipelining): the cache then holds every
            # yielded token, whichever way the consumer stops.
            if processors:
                history = extend_history(history, y)
            next_y, next_logprobs = _step(y, history)
            mx.async_eval(next_y, next_logprobs)
            token = y.item()
            if state.generated == 0:
                state.prompt_time = time.perf_counter() - tic
                prompt_done()
            state.generated += 1
            state.cache_tokens += 1
            state.last_token = token
            safe = True
            yield token, logprobs.squeeze(0), False
            safe = False
            reclaim.step(count, count + 1)
            count += 1
            if state.generated == max_tokens:
                break
            y, logprobs = next_y, next_logprobs
        safe = True
    finally:
        state.consistent = safe


@dataclass
class GenerationResponse:
    """One step of :func:`stream_generate` (a superset of mlx-lm's).

    Attributes:
        text: The next segment of decoded text (may be empty).
        token: The token.
        logprobs: Its log probabilities (V,).
        from_draft: Whether it was a draft token the target accepted.
        prompt_tokens: Tokens in the prompt.
        prompt_tps: Prompt tokens per second.
        generation_tokens: Tokens generated so far.
        generation_tps: Generated tokens per second.
        active_memory: MLX active memory in GB (1e9 bytes, like mlx-lm's peak_memory).
        cache_memory: MLX's pool of freed buffers in GB.
        peak_memory: Peak MLX memory in GB.
        cache_fill: Tokens the target's next query sees / (sinks + window), from the
            first SinkCache of the target; None without one.
        reclaims: Pool reclaims so far (``ReclaimSchedule.reclaims``).
        finish_reason: ``"stop"`` (eos or stop string), ``"length"``, ``"loop"``
            (``stop_loops``: the reply was repeating itself), or None.
        stop_string: The stop string that ended the text, on the last response.
    """

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    active_memory: float
    cache_memory: float
    peak_memory: float
    cache_fill: float | None
    reclaims: int
    finish_reason: str | None = None
    stop_string: str | None = None


def _cache_fill(cache: list) -> float | None:
    for c in cache:
        if isinstance(c, SinkCache):
            return c.size() / (c.sinks + c.window)
    return None


def stream_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper | Any,
    prompt: str | mx.array | list[int],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    draft_model: nn.Module | None = None,
    prompt_cache: list | CacheSpec | None = None,
    *,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Callable] | None = None,
    stop: Iterable[str] | None = None,
    prefill_step_size: int = 512,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    reclaim: ReclaimSchedule | None = None,
) -> Generator[GenerationResponse, None, None]:
    """Generate text from ``prompt`` on a sink+window cache, like mlx-lm's
    ``stream_generate``.

    Args:
        model (nn.Module): The model.
        tokenizer (TokenizerWrapper): Its tokenizer (a Hugging Face one is wrapped).
        prompt (str | mx.array | list[int]): Text or token ids: the whole prompt, or
            only the new turn when ``prompt_cache`` already holds the conversation.
        max_tokens (int): Tokens to generate; ``-1`` for no limit. Default: ``256``.
        draft_model (nn.Module, optional): Draft model for speculative decoding.
        prompt_cache (list | CacheSpec, optional): A list of caches, updated in place:
            SinkCaches (or mlx-lm KVCache / RotatingKVCache lists to compare against),
            the draft's appended after the target's; or the ``CacheSpec`` of new ones
            (with a draft model, given room for a verify block: ``CacheSpec.for_draft``).
            Default: ``CacheSpec()`` (4 sinks, a 1024-token window).
        sampler (Callable, optional): Logprobs -> token, e.g. mlx-lm's
            ``make_sampler(temp=0.7)``. Default: greedy.
        logits_processors (list[Callable], optional): ``(history, logits) -> logits``,
            e.g. mlx-lm's ``make_logits_processors(repetition_penalty=1.1)``, called
            once per sampled token, in order.
        stop (list[str], optional): Stop strings, cut from the text.
        prefill_step_size (int): Largest prefill chunk. Default: ``512``.
        prompt_progress_callback (Callable[[int, int], None], optional): Called with
            (prompt tokens processed, prompt tokens).
        num_draft_tokens (int): Draft tokens per round. Default: ``3``.
        reclaim (ReclaimSchedule, optional): Pool reclaim cadence. Default: crossing 256.

    Yields:
        GenerationResponse: One per token; the last has ``finish_reason`` set. On eos
        the last response carries the eos token and no new text. Whichever way the
        loop ends, the cache then holds the prompt and every token yielded (see the
        module docstring).
    """
    yield from stream_responses(
        model, tokenizer, prompt, max_tokens, draft_model, prompt_cache, sampler=sampler,
        logits_processors=logits_processors, stop=stop, prefill_step_size=prefill_step_size,
        prompt_progress_callback=prompt_progress_callback, num_draft_tokens=num_draft_tokens,
        reclaim=reclaim,
    )  # fmt: skip


def stream_responses(
    model: nn.Module,
    tokenizer: TokenizerWrapper | Any,
    prompt: str | mx.array | list[int],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    draft_model: nn.Module | None = None,
    prompt_cache: list | CacheSpec | None = None,
    *,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Callable] | None = None,
    stop: Iterable[str] | None = None,
    prefill_step_size: int = 512,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    reclaim: ReclaimSchedule | None = None,
    seed: int | None = None,
    stop_tokens: Iterable[int] | None = None,
    state: DecodeState | None = None,
    steps: Callable[..., Iterable[tuple[int, mx.array, bool]]] | None = None,
    poll: bool = False,
    stop_loops: int = 0,
    **sampling: Any,
) -> Generator[GenerationResponse | None, None, None]:
    """:func:`stream_generate` with what the session, the server and batched decode
    also pass (not part of the public API).

    Args:
        seed (int, optional): Seed for ``mx.random``, when ``sampler`` is not given.
        stop_tokens (list[int], optional): More token ids that end the text like eos
            (e.g. ``model_config.end_of_turn_tokens``).
        state (DecodeState, optional): Filled in by the token generator.
        steps (Callable, optional): The token generator, called like
            :func:`generate_step` (e.g. a row of ``mlx_stream.generate.batch.Batch``).
            Default: :func:`generate_step`.
        poll (bool): Passed to the token generator: ``None`` is yielded (and passed
            on) while the prompt goes in, a chunk at a time, instead of blocking.
        stop_loops (int): End the reply (``finish_reason="loop"``) once its last
            ``stop_loops`` tokens repeat one span exactly
            (:class:`~mlx_stream.generate.loops.LoopGuard`); 0 never does. Default: 0.
        **sampling: :class:`~mlx_stream.generate.model_config.Sampling`'s fields
            (``temp``, ``top_p``, ``min_p``, ``top_k``, ``repetition_penalty``): the
            sampler when ``sampler`` is not given (default greedy); the repetition
            penalty's processor comes before ``logits_processors`` either way.

    The rest: :func:`stream_generate`.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    prompt = as_tokens(prompt)
    sample = Sampling(**sampling)
    if sampler is None:
        sampler, processors = make_sampling(sample, seed)
    else:
        processors = make_logits_processors(repetition_penalty=sample.repetition_penalty)
    if prompt_cache is None or isinstance(prompt_cache, CacheSpec):
        spec = prompt_cache or CacheSpec()
        spec = spec.for_draft(num_draft_tokens) if draft_model else spec
        prompt_cache = spec.build(model)  # refused with the bytes when it cannot fit
        if draft_model is not None:
            prompt_cache += spec.build(draft_model)
    target_cache = prompt_cache[: len(model.layers)] if draft_model else prompt_cache
    reclaim = reclaim if reclaim is not None else ReclaimSchedule()
    state = state if state is not None else DecodeState()
    tokens = (steps or generate_step)(
        prompt, model, prompt_cache,
        sampler, processors + list(logits_processors or []),
        max_tokens=max_tokens, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
        prefill_step_size=prefill_step_size, reclaim=reclaim,
        prompt_progress_callback=prompt_progress_callback, state=state,
        **({"poll": True} if poll else {}),
    )  # fmt: skip
    detokenizer = tokenizer.detokenizer
    # mlx-lm's text state machine holds back text that may begin a stop string.
    stops = list(stop or [])
    machine = TextStateMachine({"normal": [(s, None) for s in stops]} if stops else None)
    text_state = machine.make_state("normal")
    eos = set(tokenizer.eos_token_ids) | set(stop_tokens or ())
    guard = LoopGuard(stop_loops) if stop_loops else None

    def response(token, logprobs, from_draft, text, finish_reason=None):
        gen_time = max(time.perf_counter() - tic - state.prompt_time, 1e-9)
        return GenerationResponse(
            text=text, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=state.prompt_tokens,
            prompt_tps=state.prompt_tokens / max(state.prompt_time, 1e-9),
            generation_tokens=state.generated, generation_tps=state.generated / gen_time,
            active_memory=mx.get_active_memory() / 1e9,
            cache_memory=mx.get_cache_memory() / 1e9,
            peak_memory=mx.get_peak_memory() / 1e9,
            cache_fill=_cache_fill(target_cache), reclaims=reclaim.reclaims,
            finish_reason=finish_reason,
        )  # fmt: skip

    wired = set_wired_limit()  # Metal only, like mlx-lm's wired_limit; None elsewhere
    tic = time.perf_counter()
    emitted = 0  # characters of text yielded
    try:
        for item in tokens:
            if item is None:  # no token yet (polled): the consumer may do other work
                yield None
                continue
            token, logprobs, from_draft = item
            looping = guard is not None and token not in eos and guard.add(token)
            last = token in eos or looping or state.generated == max_tokens
            if token not in eos:
                detokenizer.add_token(token)
            if last:
                detokenizer.finalize()
            text_state, text, name = machine.step(text_state, detokenizer.last_segment)
            if name is None:  # a stop string ended the text: the one right after the text
                at, full = emitted + len(text), detokenizer.text
                last_response = response(token, logprobs, from_draft, text, "stop")
                last_response.stop_string = next((s for s in stops if full.startswith(s, at)), None)
                yield last_response
                return
            if last:
                text_state, tail, _ = machine.flush(text_state)
                reason = "stop" if token in eos else "loop" if looping else "length"
                yield response(token, logprobs, from_draft, text + tail, reason)
                return
            emitted += len(text)
            yield response(token, logprobs, from_draft, text)
    finally:
        tokens.close()
        if wired is not None:
            mx.synchronize()  # never change the wired limit under a running eval
            mx.set_wired_limit(wired)
