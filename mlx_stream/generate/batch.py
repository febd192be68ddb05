"""Batched decode: every session with decode work steps in one model call.

Contract: a :class:`Batch` holds the rows of one model; :meth:`Batch.step` feeds each
newcomer one prefill chunk, joins those whose prompt is in, then decodes every row in
one call with its own sampling. :meth:`Batch.tokens` is a ``generate_step``-compatible
token source; a row that leaves holds what the same session would hold alone (same
greedy tokens, logits within float tolerance).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import apply_top_p

from mlx_stream.cache.batched import BatchSinkCache, batch_refusal, check_batchable
from mlx_stream.cache.reclaim import ReclaimSchedule
from mlx_stream.defaults import DEFAULT_MAX_TOKENS
from mlx_stream.errors import Unsupported
from mlx_stream.generate.prefill import feed_steps
from mlx_stream.generate.steps import DecodeState, as_tokens, extend_history

DEFAULT_PREFILL_CHUNK = 64  # prompt tokens a newcomer feeds per round


@dataclass(eq=False)
class Row:
    """One session in a :class:`Batch`.

    Attributes:
        caches: The session's prompt cache (one SinkCache per layer).
        prompt: Prompt tokens still to prefill on the session's own cache.
        next_input: The token the next batched call feeds (the last one sampled,
            possibly not evaluated yet).
        inbox: ``(token, logprobs)`` sampled and not yet taken by the consumer.
        budget: Tokens still to sample (``-1``: no limit).
    """

    caches: list
    prompt: list[int]
    next_input: int | None = None
    temp: float = 0.0
    top_p: float = 1.0
    key: mx.array | None = None
    budget: int = -1
    inbox: deque = field(default_factory=deque)
    pending: tuple | None = None  # (tokens, logprobs, index): sampled, not read yet
    joined: bool = False
    processors: list = field(default_factory=list)  # this row's logits processors
    history: mx.array | None = None  # what they read: the prompt and the tokens sampled
    on_fed: Callable[[], None] | None = None  # DecodeState.on_prompt_fed


def _as_input(token) -> mx.array:
    """A row's next input, a token id or a lazy (1,) array, as a (1,) uint32 array."""
    if isinstance(token, mx.array):
        return token.astype(mx.uint32)
    return mx.array([token], dtype=mx.uint32)


def _process(row: Row, logits: mx.array) -> mx.array:
    """``row``'s logits (1, V) through its processors, which are handed the row's
    history (as a session alone hands them: ``decode.extend_history``)."""
    for processor in row.processors:
        logits = processor(row.history, logits)
    return logits


class Batch:
    """The batched rows of one model and the rounds that advance them.

    Args:
        model (nn.Module): The model every row decodes with.
        prefill_chunk (int): Prompt tokens a newcomer feeds per round.
    """

    def __init__(self, model: nn.Module, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        why = check_batchable(model)
        if why:
            raise Unsupported(f"{type(model).__module__.split('.')[-1]}: {why}")
        self.model, self.prefill_chunk = model, prefill_chunk
        self.layers = [BatchSinkCache() for _ in model.layers]
        self.rows: list[Row] = []  # batched, in buffer order
        self.waiting: list[Row] = []  # still prefilling
        self.steps = 0
        self.reclaim = ReclaimSchedule()

    # ----- rows -----------------------------------------------------------------------

    def add(
        self,
        caches: list,
        prompt: list[int],
        temp: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        max_tokens: int = -1,
        processors: list | None = None,
    ) -> Row:
        """A new row: ``prompt`` (at least one token) is prefilled in chunks on
        ``caches`` over the next rounds, then the row joins the batch."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if len(caches) != len(self.layers):
            raise Unsupported(f"{len(caches)} cache layers for a {len(self.layers)}-layer model")
        for c in caches:
            why = batch_refusal(c, joining=False)
            if why:
                raise Unsupported(why)
        seed = random.getrandbits(31) if seed is None else seed
        row = Row(list(caches), list(prompt), temp=temp, top_p=top_p, budget=max_tokens)
        row.processors = list(processors or [])
        if row.processors:
            row.history = extend_history(None, mx.array(prompt, dtype=mx.uint32))
        row.key = mx.random.key(seed)
        self.waiting.append(row)
        return row

    def remove(self, row: Row) -> None:
        """Take ``row`` out (its caches copied back out); other rows are unchanged."""
        if row in self.waiting:
            self.waiting.remove(row)
        if row in self.rows:
            i = self.rows.index(row)
            self.rows.pop(i)
            for layer in self.layers:
                layer.remove(i)
            row.joined = False

    def __contains__(self, row: Row) -> bool:
        return row in self.rows or row in self.waiting

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    # ----- a round ----------------------------------------------------------------------

    def step(self) -> None:
        """One round: a prefill chunk for each newcomer, then one batched decode call
        for every row that still has tokens to sample."""
        for row in list(self.waiting):
            self._prefill(row)
        for row in [r for r in self.rows if r.budget == 0]:
            self._deliver(row)
            self.remove(row)  # sampled all it may: feeds nothing more
        if not self.rows:
            return
        # Pipelined like mlx-lm's loops: this step's call is built on the previous
        # step's tokens before they are read, and runs while they are handed out.
        rows = list(self.rows)
        inputs = mx.concatenate([_as_input(r.next_input) for r in rows])[:, None]
        logits = self.model(inputs, cache=self.layers)[:, -1, :]
        tokens, logprobs = self._draw(rows, logits)
        mx.async_eval(tokens, logprobs)
        for b, row in enumerate(rows):
            self._deliver(row)
            row.pending = (tokens[b : b + 1], logprobs, b)
            row.next_input = tokens[b : b + 1]
        self.reclaim.step(self.steps, self.steps + 1)
        self.steps += 1

    @staticmethod
    def _deliver(row: Row) -> None:
        """Move ``row``'s sampled token (read now) to its inbox."""
        if row.pending is not None:
            token, logprobs, b = row.pending
            row.inbox.append((token.item(), logprobs[b]))
            row.pending = None

    def _prefill(self, row: Row) -> None:
        """Feed one chunk of ``row``'s prompt (all but its last token) on its own
        caches; join the batch when only the last token is left."""
        rest = len(row.prompt) - 1
        if rest > 0:
            chunks = feed_steps([(self.model, row.caches)], row.prompt[:rest], self.prefill_chunk)
            row.prompt = row.prompt[next(chunks) :]  # one chunk
            if len(row.prompt) > 1:
                return
        if row.on_fed is not None:  # all but the last token is in
            row.on_fed()
        self.waiting.remove(row)
        if row.caches[0].keys is None:  # a stream's first token: no buffer to join yet
            logits = self.model(mx.array(row.prompt)[None], cache=row.caches)[:, -1, :]
            row.prompt = []
            tokens, logprobs = self._draw([row], logits)
            row.pending = (tokens, logprobs, 0)
            row.next_input = tokens
            if row.budget == 0:
                self._deliver(row)
                return
        else:
            row.next_input, row.prompt = row.prompt[0], []
        for layer, c in zip(self.layers, row.caches, strict=True):
            layer.add(c)
        self.rows.append(row)
        row.joined = True

    @staticmethod
    def _draw(rows: list[Row], logits: mx.array) -> tuple[mx.array, mx.array]:
        """Each row's next token (B,) drawn with its own parameters (after its own
        logits processors), and the logprobs (B, V); not evaluated yet."""
        if any(row.processors for row in rows):
            logits = mx.concatenate([_process(r, logits[b : b + 1]) for b, r in enumerate(rows)])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1)
        drawn = []
        for b, row in enumerate(rows):
            if row.temp > 0:
                row.key, key = mx.random.split(row.key)
                lp = logprobs[b : b + 1]
                if row.top_p < 1.0:
                    lp = apply_top_p(lp, row.top_p)
                drawn.append((b, mx.random.categorical(lp * (1.0 / row.temp), key=key)))
        if drawn:
            where = mx.array([b for b, _ in drawn])
            tokens[where] = mx.concatenate([t for _, t in drawn]).astype(tokens.dtype)
        for b, row in enumerate(rows):
            if row.processors:
                row.history = extend_history(row.history, tokens[b : b + 1].astype(mx.uint32))
            if row.budget > 0:
                row.budget -= 1
        return tokens, logprobs

    # ----- a token source for stream_responses --------------------------------------------

    def tokens(
        self,
        drive: Callable[[Row], None] | None = None,
        temp: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        on_row: Callable[[Row], None] | None = None,
    ) -> Callable[..., Generator[tuple[int, mx.array, bool], None, None]]:
        """A token source for ``stream_responses(..., steps=...)`` decoding on this batch
        with these sampling parameters. ``drive(row)`` runs rounds until ``row`` has a
        token (default: :meth:`step`; the server's also hands other sessions theirs);
        ``on_row(row)`` is told the row once it is made. Called with ``poll=True`` (by
        ``stream_responses(..., poll=True)``), the source drives nothing: it yields
        ``None`` while its row has no token, and its consumer runs the rounds."""
        drive = drive or (lambda row: self.step())

        def source(prompt, model, prompt_cache, sampler=None, logits_processors=None, *,
                   max_tokens=DEFAULT_MAX_TOKENS, draft_model=None, state=None, poll=False,
                   **_: Any):  # fmt: skip
            if model is not self.model or draft_model is not None:
                raise Unsupported("a batch decodes its own model only, without a draft model")
            prompt = as_tokens(prompt).tolist()
            state = state if state is not None else DecodeState()
            state.prompt_tokens = len(prompt)
            tic = time.perf_counter()
            row = self.add(prompt_cache, prompt, temp, top_p, seed, max_tokens, logits_processors)
            row.on_fed = state.on_prompt_fed
            if on_row is not None:
                on_row(row)
            try:
                while state.generated != max_tokens:
                    while not row.inbox:
                        if row not in self:
                            return
                        if poll:
                            yield None
                        else:
                            drive(row)
                    token, logprobs = row.inbox.popleft()
                    if state.generated == 0:
                        state.prompt_time = time.perf_counter() - tic
                        state.prompt_processed = len(prompt)
                    state.generated += 1
                    state.last_token = token
                    yield token, logprobs, False
            finally:
                self.remove(row)

        return source
