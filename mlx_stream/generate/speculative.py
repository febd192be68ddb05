"""Speculative decoding: a draft model proposes, the target verifies in one call.

Contract: :func:`speculative` is ``generate_step``'s loop once the prompt is in; after
it stops the target and draft caches hold exactly the prompt plus every yielded token
(rejected drafts trimmed, a yielded token not yet fed fed in ``finally:``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_stream.cache.sink import max_call_tokens
from mlx_stream.generate.steps import call_size, extend_history, rewind, sample


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


def speculative(y, models, sampler, processors, history, max_tokens, num_draft_tokens,
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
        rewind(c, len(track.extra))
        todo = mx.array(track.pending, mx.uint32)
        if tokens is not None:
            todo = mx.concatenate([todo, tokens])
        track.pending, track.extra = [], []
        logits = None
        while todo.size:
            n = call_size(c, step_size, todo.size)
            logits = m(todo[None, :n], cache=c)
            todo = todo[n:]
        return logits

    def _draft(k, history):
        """``k`` draft tokens, each a (1,) array, from the draft model."""
        drafts, inputs = [], None
        for _ in range(k):
            logits = _feed(draft_model, draft_cache, draft, inputs)[:, -1, :]
            inputs, _ = sample(logits, history, sampler, processors)
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
            return sample(logits, None, sampler, [])
        rows = []
        for i in range(len(drafts) + 1):
            rows.append(sample(logits[i : i + 1], history, sampler, processors))
            if i < len(drafts):
                history = extend_history(history, drafts[i])
        return mx.concatenate([t for t, _ in rows]), mx.concatenate([lp for _, lp in rows])

    try:
        remaining = max_tokens
        while remaining != 0:
            safe = False
            with mx.stream(stream):
                rewind(cache, len(target.extra))
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
