"""Streaming perplexity (StreamingLLM's protocol): feed a long text as one stream and
score every token's negative log-likelihood under the cache policy.

The logits at position ``i`` predict token ``i + 1``. Each call feeds the pending last
token of the previous call plus all but the last of the new tokens, and scores the new
tokens; the last new token becomes pending. So every token after the first is scored
exactly once, and a checkpoint needs only the cache, the sums, the stream position and
that pending token. Calls never feed more than ``max_call_tokens`` of the cache, so
chunked evaluation gives the token-by-token numbers (see ``mlx_stream.cache``).

Baselines: ``positions="absolute"`` (mlx-lm-style sinks at absolute positions),
``sinks=0`` (window only), a ``prompt_cache`` of mlx-lm ``KVCache``s (full cache), and
:func:`recompute_perplexity` (sliding window with re-computation, the quality oracle).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlx_stream import checkpoint as ckpt
from mlx_stream.cache.reclaim import ReclaimSchedule
from mlx_stream.cache.sink import max_call_tokens
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.defaults import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_CHUNK,
    DEFAULT_SINKS,
    DEFAULT_WINDOW,
)
from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.generate.prefill import feed_prompt

DEFAULT_BLOCK_CHARS = 1 << 16
# Last place in a block where a word ends and whitespace begins.
_SEAM = re.compile(r"\S(?=\s)")


def iter_tokens(
    path_or_file: str | os.PathLike | IO[str],
    tokenizer: Any,
    block_chars: int = DEFAULT_BLOCK_CHARS,
    add_special_tokens: bool = True,
) -> Iterator[int]:
    """Tokenize a text file block by block, never holding the whole file.

    Each block is cut right before the last whitespace run that follows a word, and
    the rest is carried into the next block, so a block starts with the whitespace
    that starts a word (where byte-level BPE pre-tokenizers split anyway). The stream
    equals tokenizing the whole text except possibly at seams: tokenizers that add a
    prefix space per call (SentencePiece) or merge across whitespace may differ by a
    token there, and a block without whitespace is cut mid-word.

    Args:
        path_or_file: A path, or an open text file.
        tokenizer: Has ``encode(text, add_special_tokens=...)``.
        block_chars (int): Characters read per block. Default: ``65536``.
        add_special_tokens (bool): Let the first block get the tokenizer's BOS.
            Default: ``True``.

    Yields:
        int: Token ids.
    """
    own = not hasattr(path_or_file, "read")
    # A stray bad byte deep in a long file becomes U+FFFD rather than ending the run.
    f = open(path_or_file, encoding="utf-8", errors="replace") if own else path_or_file  # noqa: SIM115
    try:
        carry, first = "", True
        while True:
            block = f.read(block_chars)
            text = carry + block
            if not block:
                cut = len(text)
            else:
                seams = list(_SEAM.finditer(text))
                cut = seams[-1].end() if seams and seams[-1].end() > 0 else len(text)
            carry, piece = text[cut:], text[:cut]
            if piece:
                yield from tokenizer.encode(piece, add_special_tokens=first and add_special_tokens)
                first = False
            if not block:
                return
    finally:
        if own:
            f.close()


@dataclass
class PerplexityResult:
    """What :func:`stream_perplexity` measured.

    Attributes:
        perplexity: ``exp(nll)``.
        nll: Mean negative log-likelihood per scored token (nats).
        tokens: Tokens scored (every token after the first).
        tokens_per_second: Tokens fed per second in this run (a resumed run counts
            only its own part).
        seconds: Wall time of this run.
        peak_memory: Peak MLX memory of this run in bytes.
        segments: ``{start, end, tokens, nll, perplexity}`` per ``segment`` tokens of the
            stream; ``[start, end)`` are stream indices and the segments partition the
            scored tokens.
        position: Tokens consumed from the stream (scored + 1).
        interrupted: ``should_stop`` ended the run early (the checkpoint, if any,
            holds its state).
        checkpoint_error: Why a checkpoint could not be saved (the run went on), or
            ``None``.
        failure: Why the run stopped early on a runtime failure (the recall store
            could not grow: a full disk), or ``None``; the checkpoint, if any, holds the
            state before the call that failed.
        prompt_cache: The cache as the run left it (a resumed run loads its own).
    """

    perplexity: float
    nll: float
    tokens: int
    tokens_per_second: float
    seconds: float
    peak_memory: int
    segments: list[dict] = field(default_factory=list)
    position: int = 0
    interrupted: bool = False
    checkpoint_error: str | None = None
    prompt_cache: list | None = field(default=None, repr=False)
    failure: str | None = None


@dataclass
class _Totals:
    """Resumable evaluation state (saved as JSON in the checkpoint's metadata)."""

    position: int = 0  # tokens consumed, the pending one included
    pending: int | None = None  # consumed, not yet fed: it predicts nothing yet
    nll_sum: float = 0.0
    scored: int = 0
    segment: int = 4096
    sums: dict[str, list] = field(default_factory=dict)  # segment index -> [nll sum, count]

    def add(self, start: int, nll: np.ndarray) -> None:
        """Add the NLLs of the tokens at stream indices ``start...``."""
        idx = np.arange(start, start + nll.size) // self.segment
        for k in np.unique(idx):
            part = nll[idx == k]
            s = self.sums.setdefault(str(int(k)), [0.0, 0])
            s[0] += float(part.sum())
            s[1] += int(part.size)
        self.nll_sum += float(nll.sum())
        self.scored += int(nll.size)

    def segments(self) -> list[dict]:
        out = []
        for k in sorted(self.sums, key=int):
            total, n = self.sums[k]
            start = int(k) * self.segment
            end = min(start + self.segment, self.position)
            out.append({"start": start, "end": end, "tokens": n, "nll": total / n,
                        "perplexity": math.exp(total / n)})  # fmt: skip
        return out


def _token_nll(logits: mx.array, targets: mx.array) -> mx.array:
    """Negative log-likelihood of ``targets`` (L,) under ``logits`` (L, V), float32."""
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[:, None], axis=-1).squeeze(-1)
    return mx.logsumexp(logits, axis=-1) - picked


def stream_perplexity(
    model: nn.Module,
    tokens: Iterable[int],
    sinks: int = DEFAULT_SINKS,
    window: int = DEFAULT_WINDOW,
    chunk: int = DEFAULT_CHUNK,
    positions: str = "cache",
    prompt_cache: list | None = None,
    callback: Callable[[int, float], None] | None = None,
    segment: int = 4096,
    limit_tokens: int | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
    resume: bool | str | os.PathLike = False,
    reclaim: ReclaimSchedule | None = None,
    identity: dict | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_cache: Callable[[list], None] | None = None,
    cache_spec: CacheSpec | None = None,
) -> PerplexityResult:
    """Feed ``tokens`` as one stream and score every token under the cache policy.

    A model call that raises a ``RuntimeFailure`` (a recall store that cannot grow
    fails before the call changes the cache) stops the run like ``should_stop``: the
    checkpoint is saved and the result returned with ``failure`` set.

    Args:
        model (nn.Module): The model.
        tokens (Iterable[int]): The stream, e.g. :func:`iter_tokens`. When resuming,
            pass the same stream from its start: the consumed part is checked against
            the checkpoint's digest and skipped.
        sinks (int): Attention sinks. Default: ``4``.
        window (int): Window. Default: ``1024``.
        chunk (int): Most tokens per model call (fewer where the cache admits fewer).
            Default: ``64``.
        positions (str): ``"cache"`` or ``"absolute"`` (baseline). Default: ``"cache"``.
        prompt_cache (list, optional): Cache to evaluate with (e.g. mlx-lm KVCaches
            for the full-cache baseline). Default: ``cache_spec.build(model)``.
        callback (Callable[[int, float], None], optional): After each call, with
            (tokens consumed, running perplexity).
        segment (int): Tokens per reported segment. Default: ``4096``.
        limit_tokens (int, optional): Stop after consuming this many tokens.
        checkpoint (path, optional): Where to save the state (cache + totals) each time
            the position crosses a multiple of ``checkpoint_every``, when
            ``should_stop`` ends the run, and at the end (see
            :mod:`mlx_stream.checkpoint`). A save that fails is reported in the
            result's ``checkpoint_error``; the run goes on without saving.
        checkpoint_every (int): Checkpoint cadence in tokens. Default: ``4096``.
        resume (bool | path): Continue from ``checkpoint`` if it exists (``True``),
            or from this checkpoint file (saving to ``checkpoint`` from then on, so
            the file resumed from stays as it was). Default: ``False``.
        reclaim (ReclaimSchedule, optional): Pool reclaims. Default: crossing 256.
        identity (dict, optional): What a checkpoint belongs to (model, settings),
            saved with it and checked on resume; ``segment`` is always part of it, and
            so are the recall settings of ``cache_spec`` when it is given.
        should_stop (Callable[[], bool], optional): Checked between model calls; when
            it returns True the run stops there, saves its checkpoint and returns
            with ``interrupted`` set (e.g. after Ctrl-C).
        on_cache (Callable[[list], None], optional): Called once, before the first
            model call, with the cache the run uses (the checkpoint's when resuming).
        cache_spec (CacheSpec, optional): The policy of a new cache, in place of
            ``sinks``, ``window`` and ``positions``.

    Returns:
        PerplexityResult: Totals so far (a resumed run includes the earlier part).

    Raises:
        UserError: The checkpoint belongs to another run (model, settings, text) or
            its arrays (or its recall store's files) are corrupted.
    """
    totals = _Totals(segment=segment)
    identity = {**(identity or {}), "segment": segment}
    recall: Any = "saved"
    if cache_spec is not None:
        recall = cache_spec.recall
        identity.update(ckpt.recall_identity(recall))
    digest = ckpt.TextDigest()
    stream = iter(tokens)
    source = checkpoint if resume is True else (resume or None)
    if source is not None and Path(source).exists():
        prompt_cache, state, saved = ckpt.load(source, model, identity, recall)
        try:
            totals = _Totals(**state)
        except TypeError:
            raise UserError(f"{source}: not a stream-run checkpoint of this version") from None
        consumed = 0
        while consumed < totals.position:  # hashed in blocks: a long stream stays small
            block = list(itertools.islice(stream, min(1 << 16, totals.position - consumed)))
            if not block:
                break
            digest.update(block)
            consumed += len(block)
        if consumed < totals.position or digest.hexdigest() != saved.get(ckpt.TEXT_FIELD):
            raise UserError(
                f"{source}: made from another text (its first {totals.position} tokens "
                "differ from this one's)"
            )
    elif prompt_cache is None:
        spec = cache_spec or CacheSpec(sinks, window, positions=positions)
        prompt_cache = spec.build(model)  # refused with the bytes when it cannot fit
    if on_cache is not None:
        on_cache(prompt_cache)
    reclaim = reclaim if reclaim is not None else ReclaimSchedule()
    saves = ReclaimSchedule(every=checkpoint_every)  # the same crossing rule
    stream = itertools.islice(
        stream, None if limit_tokens is None else max(limit_tokens - totals.position, 0)
    )
    errors: list[str] = []

    def save() -> None:
        if checkpoint is None or errors:
            return
        try:
            ckpt.save(checkpoint, prompt_cache, asdict(totals),
                      {**identity, ckpt.TEXT_FIELD: digest.hexdigest()})  # fmt: skip
        except OSError as e:
            errors.append(f"cannot save checkpoint {checkpoint}: {e.strerror or e}")

    mx.reset_peak_memory()
    tic, start = time.perf_counter(), totals.position
    interrupted, failure = False, None
    if totals.pending is None:
        totals.pending = next(stream, None)
        totals.position += totals.pending is not None
        if totals.pending is not None:
            digest.update([totals.pending])
    while totals.pending is not None:
        if should_stop is not None and should_stop():
            interrupted = True
            break
        bound = max_call_tokens(prompt_cache)
        n = chunk if bound is None else min(chunk, bound)
        new = list(itertools.islice(stream, n))
        if not new:
            break
        x = mx.array([totals.pending] + new[:-1])
        try:
            logits = model(x[None], cache=prompt_cache)[0]
        except RuntimeFailure as e:  # raised before the call changed the cache
            failure = str(e)
            break
        nll = np.array(_token_nll(logits, mx.array(new)), dtype=np.float64)
        digest.update(new)  # only now: a checkpoint after a failed call has not seen them
        totals.add(totals.position, nll)
        previous = totals.position
        totals.pending, totals.position = new[-1], previous + len(new)
        reclaim.step(previous, totals.position)
        if callback is not None:
            callback(totals.position, math.exp(totals.nll_sum / totals.scored))
        if saves.due(previous, totals.position):
            save()
    save()
    seconds = time.perf_counter() - tic
    nll = totals.nll_sum / max(totals.scored, 1)
    return PerplexityResult(
        perplexity=math.exp(nll), nll=nll, tokens=totals.scored,
        tokens_per_second=(totals.position - start) / max(seconds, 1e-9), seconds=seconds,
        peak_memory=mx.get_peak_memory(), segments=totals.segments(),
        position=totals.position, interrupted=interrupted,
        checkpoint_error=errors[0] if errors else None, prompt_cache=prompt_cache,
        failure=failure,
    )  # fmt: skip


def recompute_perplexity(
    model: nn.Module,
    tokens: list[int],
    sinks: int = DEFAULT_SINKS,
    window: int = DEFAULT_WINDOW,
    indices: Iterable[int] | None = None,
) -> PerplexityResult:
    """The quality oracle: sliding window with re-computation.

    Token ``i`` is scored by a fresh forward pass over its context, the first
    ``sinks`` tokens plus the ``window`` tokens ending at ``i - 1``, at positions
    ``0..len(context) - 1``. One forward per token: use it on subsamples.

    Args:
        model (nn.Module): The model.
        tokens (list[int]): The stream.
        sinks (int): Attention sinks. Default: ``4``.
        window (int): Window. Default: ``1024``.
        indices (Iterable[int], optional): Stream indices to score (each >= 1).
            Default: every token after the first.

    Returns:
        PerplexityResult: One segment per call (``segments`` lists the scored range).
    """
    tokens = list(tokens)
    indices = range(1, len(tokens)) if indices is None else list(indices)
    tic, total, n = time.perf_counter(), 0.0, 0
    mx.reset_peak_memory()
    for i in indices:
        assert 1 <= i < len(tokens), f"index {i} outside 1..{len(tokens) - 1}"
        lo = max(0, i - window)
        context = tokens[: min(sinks, lo)] + tokens[lo:i]
        cache = make_prompt_cache(model)
        if len(context) > 1:  # one call; only the cache is evaluated, never its logits
            feed_prompt(model, cache, context[:-1], step=len(context) - 1)
        logits = model(mx.array(context[-1:])[None], cache=cache)[0, -1:]
        total += _token_nll(logits, mx.array([tokens[i]])).item()
        n += 1
    seconds = time.perf_counter() - tic
    nll = total / max(n, 1)
    return PerplexityResult(
        perplexity=math.exp(nll), nll=nll, tokens=n, tokens_per_second=n / max(seconds, 1e-9),
        seconds=seconds, peak_memory=mx.get_peak_memory(), position=len(tokens),
    )  # fmt: skip
