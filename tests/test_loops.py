"""Replies that fall into a loop end early (``stop_loops``): the guard's rule, the
decode loop's ``finish_reason="loop"`` with the cache in step, and ``serve`` answering
such a reply as a finished one, with a note in its access log."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_stream.generate.loops import CHECK_EVERY, MIN_REPEATS, LoopGuard, repeating_period
from mlx_stream.generate.session import Settings

PROMPT = [2, 5, 9, 13]


def forcing(pattern: list[int]):
    """A logits processor making the model say ``pattern`` over and over."""
    said = [0]

    def processor(tokens, logits):
        want = pattern[said[0] % len(pattern)]
        said[0] += 1
        forced = mx.where(mx.arange(logits.shape[-1]) == want, 0.0, -1e9)
        return mx.broadcast_to(forced, logits.shape).astype(logits.dtype)

    return processor


def fed_until_loop(guard: LoopGuard, tokens: list[int]) -> int | None:
    """How many of ``tokens`` the guard took before it called a loop (None: never)."""
    for i, token in enumerate(tokens, 1):
        if guard.add(token):
            return i
    return None


def test_the_shortest_period_is_found():
    assert repeating_period([7, 7, 7, 7], 4) == 1
    assert repeating_period([1, 2, 3] * 5, 8) == 3
    assert repeating_period([1, 2, 3] * 5 + [9], 8) is None
    assert repeating_period([1, 2, 3, 4, 5] * 3, 4) is None  # longer than allowed


def test_a_loop_is_called_once_its_period_fills_the_span():
    span, line = 64, [11, 12, 13, 14, 15, 16, 17]  # a 7-token "line" said again and again
    opening = list(range(100, 140))  # 40 tokens before the loop starts
    at = fed_until_loop(LoopGuard(span), opening + line * 40)
    # the first check at which the last `span` tokens are all inside the loop
    first = len(opening) + span
    assert at is not None and first <= at < first + CHECK_EVERY
    assert (at - span) % CHECK_EVERY == 0


def test_text_without_an_exact_repeat_is_never_called_a_loop():
    rng = np.random.default_rng(0)
    assert fed_until_loop(LoopGuard(64), rng.integers(0, 50, 5000).tolist()) is None
    # a line that comes back, but fewer than MIN_REPEATS times in the span
    line = list(range(20))
    assert fed_until_loop(LoopGuard(64), line * 50) is None  # 64 // 20 < MIN_REPEATS
    # a repeat with something changing in each round (a counter) is not a loop
    counted = [t for i in range(300) for t in (1, 2, 3, 100 + i)]
    assert fed_until_loop(LoopGuard(64), counted) is None


def test_a_span_shorter_than_the_repeats_is_refused():
    with pytest.raises(ValueError, match="at least"):
        LoopGuard(MIN_REPEATS - 1)


def test_stream_generate_ends_a_loop_and_keeps_the_cache_in_step(tiny_llama, tokenizer):
    from mlx_stream.generate.decode import stream_responses

    def run(stop_loops):
        from mlx_stream.cache import CacheSpec

        out = []
        caches = CacheSpec(sinks=2, window=256).build(tiny_llama)
        for r in stream_responses(tiny_llama, tokenizer, PROMPT, max_tokens=300, prompt_cache=caches,
                                 logits_processors=[forcing([20, 21, 22, 23, 24])],
                                 stop_loops=stop_loops):  # fmt: skip
            out.append(r)
        return out, caches

    plain, _ = run(0)
    assert len(plain) == 300 and plain[-1].finish_reason == "length"
    looped, caches = run(40)
    tokens = [r.token for r in looped]
    assert looped[-1].finish_reason == "loop"
    assert 40 <= len(tokens) < 40 + CHECK_EVERY  # the loop began with the reply
    assert tokens == [r.token for r in plain[: len(tokens)]]  # only ended early
    assert repeating_period(tokens[-40:], 10) == 5
    assert caches[0].offset == len(PROMPT) + len(tokens)  # the cache holds what was said


def test_a_session_setting_reaches_every_reply(tiny_llama, tokenizer):
    from mlx_stream.cache import CacheSpec
    from mlx_stream.generate.session import ChatSession

    settings = Settings(CacheSpec(sinks=2, window=256), max_tokens=300, stop_loops=32)
    session = ChatSession(tiny_llama, tokenizer, settings)
    for _ in session.stream("hello", logits_processors=[forcing([30, 31])]):
        pass
    assert session.last.finish_reason == "loop" and 32 <= session.last.tokens < 32 + CHECK_EVERY


def test_serve_answers_a_stopped_loop_as_a_finished_reply(loaded, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from mlx_stream.cache import CacheSpec
    from mlx_stream.serve import accesslog
    from mlx_stream.serve.app import create_app
    from mlx_stream.serve.engine import Engine

    model, tokenizer = loaded
    settings = Settings(CacheSpec(sinks=2, window=256), max_tokens=400, stop_loops=32)
    engine = Engine(model, tokenizer, settings, "tiny", state_dir=tmp_path / "s")
    engine.start()
    token = 40  # one token forced: a period-1 loop
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "max_tokens": 400, "logit_bias": {str(token): 100}}  # fmt: skip
    try:
        with TestClient(create_app(engine)) as client:
            capsys.readouterr()
            chat = client.post("/v1/chat/completions", json=body).json()
            err = capsys.readouterr().err
    finally:
        engine.stop()
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert 32 <= chat["usage"]["completion_tokens"] < 32 + CHECK_EVERY
    (line,) = [line for line in err.splitlines() if "POST /v1/chat/completions 200" in line]
    assert line.endswith(accesslog.LOOP_NOTE), err


def test_the_agent_apis_end_a_stopped_loop_as_a_finished_turn():
    from types import SimpleNamespace

    from mlx_stream.serve import anthropic

    request = SimpleNamespace(matched_stop=None)
    assert anthropic.stop_fields("loop", request)["stop_reason"] == "end_turn"
    assert anthropic.stop_fields("length", request)["stop_reason"] == "max_tokens"
