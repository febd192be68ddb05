"""The decode engine: chunked prefill, pipelined decode and speculative decoding.

Contract: the engine knows tokens, models and prompt caches; the tokenizer appears only
in :func:`stream_generate`. Every model call feeds at most
``cache.max_call_tokens(prompt_cache)`` tokens (a SinkCache changes its sink/rebase
layout only at stride boundaries), so chunked prefill, token-by-token decode and
speculative verify blocks mean exactly the same thing and give the same greedy tokens.
One :class:`~mlx_stream.cache.reclaim.ReclaimSchedule` clears MLX's buffer pool on the
crossing rule, for prefill chunks, decode steps and speculative rounds alike.

Cache after a generator stops (finished, ``close()``-d, or abandoned by a consumer that
raised, e.g. ``KeyboardInterrupt`` in the loop body, once it is closed): the target
cache (and the draft cache) hold exactly the prompt plus every token the generator
yielded, the eos or stop token included, and nothing else. A chat feeds only its next
turn. Rejected drafts are trimmed and a yielded token not yet fed is fed (one short
model call) in ``finally:``. The one exception is an exception raised *inside* the
generator while a model call was being built (a Ctrl-C that lands there, not in the
consumer): then ``DecodeState.consistent`` is False and the cache must be rebuilt. Use
:class:`StopOnInterrupt` in a terminal loop so Ctrl-C always lands between tokens.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import TextStateMachine, generation_stream
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_stream.cache.reclaim import ReclaimSchedule, set_wired_limit
from mlx_stream.cache.sink import SinkCache, max_call_tokens
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.defaults import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
)
from mlx_stream.errors import UserError
from mlx_stream.recall.tier import prompt_end as recall_prompt_end

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


@dataclass
class _Track:
    """What one cache holds relative to the yielded stream: ``extra`` tokens it holds
    past the stream (drafts, verified or not yet), ``pending`` stream tokens it lacks."""

    pending: list[int] = field(default_factory=list)
    extra: list[int] = field(default_factory=list)

    def emitted(self, token: int) -> None:
        if not self.pending and self.extra and self.extra[0] == token:
            self.extra.pop(0)
        else:
            self.pending.append(token)


def _as_tokens(prompt: mx.array | list[int]) -> mx.array:
    tokens = prompt if isinstance(prompt, mx.array) else mx.array(list(prompt))
    return tokens.reshape(-1).astype(mx.uint32)


def _call_size(cache: list, limit: int, n: int) -> int:
    """Tokens the next call may feed: ``n`` capped by ``limit`` and the cache."""
    bound = max_call_tokens(cache)
    size = min(n, limit) if bound is None else min(n, limit, bound)
    assert size >= 1, f"the cache admits no token (max_call_tokens={bound})"
    return size


def _rewind(cache: list, n: int) -> None:
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


def _sample(logits, history, sampler, processors):
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
    prompt = _as_tokens(prompt)
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
    total, done, rest = prompt.size, 0, prompt[:-1]
    progress(0, total)
    while rest.size:
        with mx.stream(stream):  # entered per chunk: a poll yields outside of it
            n = min(_call_size(c, prefill_step_size, rest.size) for _, c in models)
            for m, c in models:
                m(rest[None, :n], cache=c)
            mx.eval([[layer.state for layer in c] for _, c in models])
        rest = rest[n:]
        state.prompt_processed = state.cache_tokens = done = done + n
        progress(done, total)
        reclaim.step(done - n, done)
        if poll:
            yield None
    with mx.stream(stream):
        for m, c in models:  # recall: the prompt's own queries choose what its end recalls
            recall_prompt_end(m, c, prompt[:-1])

    run = _speculative if draft_model is not None else _plain
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
            return _sample(logits, history, sampler, processors)

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


def _speculative(y, models, sampler, processors, history, max_tokens, num_draft_tokens,
                 step_size, reclaim, state, stream, prompt_done, tic):  # fmt: skip
    """Draft with the small model, verify with the target in one call per round."""
    (model, cache), (draft_model, draft_cache) = models
    first = y.item()
    target, draft = _Track(pending=[first]), _Track(pending=[first])
    count = state.prompt_tokens
    safe = True  # True while the caches match the tracks (at a yield, between rounds)

    def _feed(m, c, track, tokens=None):
        """Trim what ``c`` holds past the stream, then feed its pending tokens and
        ``tokens`` in calls it admits; returns the logits of the last call."""
        _rewind(c, len(track.extra))
        todo = mx.array(track.pending, mx.uint32)
        if tokens is not None:
            todo = mx.concatenate([todo, tokens])
        track.pending, track.extra = [], []
        logits = None
        while todo.size:
            n = _call_size(c, step_size, todo.size)
            logits = m(todo[None, :n], cache=c)
            todo = todo[n:]
        return logits

    def _draft(k, history):
        """``k`` draft tokens, each a (1,) array, from the draft model."""
        drafts, inputs = [], None
        for _ in range(k):
            logits = _feed(draft_model, draft_cache, draft, inputs)[:, -1, :]
            inputs, _ = _sample(logits, history, sampler, processors)
            mx.async_eval(inputs)
            drafts.append(inputs)
            if processors:
                history = extend_history(history, inputs)
        return drafts

    def _verify(drafts, history):
        """The target's tokens (k+1,) and logprobs (k+1, V) after the pending token
        and after every draft, from one call."""
        logits = _feed(model, cache, target, mx.concatenate(drafts) if drafts else None)[0]
        assert logits.shape[0] == len(drafts) + 1, "the verify block was split"
        if not processors:
            return _sample(logits, None, sampler, [])
        rows = []
        for i in range(len(drafts) + 1):
            rows.append(_sample(logits[i : i + 1], history, sampler, processors))
            if i < len(drafts):
                history = extend_history(history, drafts[i])
        return mx.concatenate([t for t, _ in rows]), mx.concatenate([lp for _, lp in rows])

    try:
        remaining = max_tokens
        while remaining != 0:
            safe = False
            with mx.stream(stream):
                _rewind(cache, len(target.extra))
                target.extra = []
                # Verify block = pending token + k drafts, within what the cache admits.
                k = num_draft_tokens if remaining < 0 else min(num_draft_tokens, remaining - 1)
                bound = max_call_tokens(cache)
                if bound is not None:
                    k = max(0, min(k, bound - len(target.pending)))
                drafts = _draft(k, history)
                tokens, logprobs = _verify(drafts, history)
                mx.eval(tokens, drafts)
            tokens = tokens.tolist()
            drafts = [d.item() for d in drafts]
            target.extra = drafts
            draft.extra = drafts[:-1]  # the last draft was sampled, never fed
            safe = True
            if state.generated == 0:
                state.prompt_time = time.perf_counter() - tic
                prompt_done()
            n = 0
            while n < k and tokens[n] == drafts[n]:
                n += 1
            state.drafted += k
            state.accepted += n
            out = [(t, True) for t in drafts[:n]] + [(tokens[n], False)]
            for i, (token, from_draft) in enumerate(out):
                target.emitted(token)
                draft.emitted(token)
                if processors:
                    history = extend_history(history, mx.array([token], mx.uint32))
                state.generated += 1
                state.cache_tokens = state.prompt_tokens + state.generated - len(target.pending)
                state.last_token = token
                yield token, logprobs[i], from_draft
            remaining -= len(out)
            reclaim.step(count, count + len(out))
            count += len(out)
    finally:
        state.consistent = safe
        if safe:
            # Trim rejected drafts, feed yielded tokens a cache lacks (at most two).
            with mx.stream(stream):
                for m, c, track in ((model, cache, target), (draft_model, draft_cache, draft)):
                    if track.pending or track.extra:
                        _feed(m, c, track)
                mx.eval([c.state for c in cache + draft_cache])
            state.cache_tokens = state.prompt_tokens + state.generated


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
        finish_reason: ``"stop"`` (eos or stop string), ``"length"``, or None.
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
    sinks: int = DEFAULT_SINKS,
    window: int = DEFAULT_WINDOW,
    draft_model: nn.Module | None = None,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    prompt_cache: list | None = None,
    prefill_step_size: int = 512,
    reclaim: ReclaimSchedule | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    stop: Iterable[str] | None = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    top_k: int = 0,
    stop_tokens: Iterable[int] | None = None,
    slack: int | None = None,
    state: DecodeState | None = None,
    steps: Callable[..., Iterable[tuple[int, mx.array, bool]]] | None = None,
    cache_spec: CacheSpec | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Callable] | None = None,
    poll: bool = False,
) -> Generator[GenerationResponse | None, None, None]:
    """Generate text from ``prompt`` on a sink+window cache, like mlx-lm's
    ``stream_generate``.

    Args:
        model (nn.Module): The model.
        tokenizer (TokenizerWrapper): Its tokenizer (a Hugging Face one is wrapped).
        prompt (str | mx.array | list[int]): Text or token ids: the whole prompt, or
            only the new turn when ``prompt_cache`` already holds the conversation.
        max_tokens (int): Tokens to generate; ``-1`` for no limit. Default: ``256``.
        sinks (int): Attention sinks of a new cache. Default: ``4``.
        window (int): Window of a new cache. Default: ``1024``.
        draft_model (nn.Module, optional): Draft model for speculative decoding.
        num_draft_tokens (int): Draft tokens per round. Default: ``3``.
        prompt_cache (list, optional): Updated in place: SinkCaches (or mlx-lm
            KVCache / RotatingKVCache lists to compare against), the draft's appended
            after the target's. Default: new SinkCaches (``CacheSpec.build``).
        prefill_step_size (int): Largest prefill chunk. Default: ``512``.
        reclaim (ReclaimSchedule, optional): Pool reclaim cadence. Default: crossing 256.
        prompt_progress_callback (Callable[[int, int], None], optional): Called with
            (prompt tokens processed, prompt tokens).
        stop (list[str], optional): Stop strings, cut from the text.
        temp, top_p, min_p (float), top_k (int): Sampling (mlx-lm's
            ``make_sampler``). Default: greedy.
        repetition_penalty (float, optional): mlx-lm's repetition penalty.
        seed (int, optional): Seed for ``mx.random``.
        stop_tokens (list[int], optional): More token ids that end the text like eos
            (e.g. ``model_config.end_of_turn_tokens``).
        slack (int, optional): Slack of new SinkCaches (rollback only). Default: 0,
            and at least ``num_draft_tokens + 1`` with a draft model.
        state (DecodeState, optional): Filled in by the token generator.
        steps (Callable, optional): The token generator, called like
            :func:`generate_step` (e.g. a row of ``mlx_stream.generate.batch.Batch``).
            Default: :func:`generate_step`.
        cache_spec (CacheSpec, optional): The policy of new SinkCaches, in place of
            ``sinks``, ``window`` and ``slack`` (with a draft model, given room for a
            verify block: ``CacheSpec.for_draft``).
        sampler (Callable, optional): Replaces the sampler made from ``temp`` and
            ``top_p`` (e.g. one with its own random key); ``seed`` is then not applied.
        logits_processors (list[Callable], optional): More processors, after the
            repetition penalty's (each called once per sampled token, in order).
        poll (bool): Passed to the token generator: ``None`` is yielded (and passed
            on) while the prompt goes in, a chunk at a time, instead of blocking.

    Yields:
        GenerationResponse: One per token; the last has ``finish_reason`` set. On eos
        the last response carries the eos token and no new text. Whichever way the
        loop ends, the cache then holds the prompt and every token yielded (see the
        module docstring).
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    prompt = _as_tokens(prompt)
    if seed is not None and sampler is None:
        mx.random.seed(seed)
    if prompt_cache is None:
        if cache_spec is None:  # slack: rollback only, a verify block's under drafts
            cache_spec = CacheSpec(sinks, window, slack)
        spec = cache_spec.for_draft(num_draft_tokens) if draft_model else cache_spec
        prompt_cache = spec.build(model)  # refused with the bytes when it cannot fit
        if draft_model is not None:
            prompt_cache += spec.build(draft_model)
    target_cache = prompt_cache[: len(model.layers)] if draft_model else prompt_cache
    reclaim = reclaim if reclaim is not None else ReclaimSchedule()
    state = state if state is not None else DecodeState()
    tokens = (steps or generate_step)(
        prompt, model, prompt_cache,
        sampler or make_sampler(temp, top_p, min_p, top_k=top_k),
        make_logits_processors(repetition_penalty=repetition_penalty) + list(logits_processors or []),
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
            last = token in eos or state.generated == max_tokens
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
                reason = "stop" if token in eos else "length"
                yield response(token, logprobs, from_draft, text + tail, reason)
                return
            emitted += len(text)
            yield response(token, logprobs, from_draft, text)
    finally:
        tokens.close()
        if wired is not None:
            mx.synchronize()  # never change the wired limit under a running eval
            mx.set_wired_limit(wired)


class StopOnInterrupt:
    """Turn Ctrl-C (and any other ``signals``) into a flag while a loop runs, so it
    stops between model calls.

    A ``KeyboardInterrupt`` raised inside a model call can leave a prompt cache torn;
    in the main thread this context manager records the signal instead, and the loop
    checks ``interrupted`` after each step and breaks (which closes a generator and
    leaves the cache consistent). A second signal raises ``KeyboardInterrupt`` at once.
    Elsewhere it does nothing.

    Args:
        signals (tuple): The signals to catch. Default: ``(SIGINT,)``; add
            ``SIGTERM`` for a batch job that should save its work when killed politely.

    Example:
        with StopOnInterrupt() as ctrl_c:
            for r in stream_generate(...):
                print(r.text, end="", flush=True)
                if ctrl_c.interrupted:
                    break
    """

    def __init__(self, signals: tuple = (signal.SIGINT,)):
        self.interrupted = False
        self.signals = signals
        self._previous: dict = {}

    def __enter__(self) -> StopOnInterrupt:
        current = signal.getsignal(signal.SIGINT)
        if getattr(current, "final", False):  # e.g. distributed: Ctrl-C ends every rank
            return self
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def _handle(self, signum, frame) -> None:
        if self.interrupted:  # a second signal stops at once
            raise KeyboardInterrupt
        self.interrupted = True

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
