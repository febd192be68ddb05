"""Repair in place after an edit in the middle of a conversation
(mlx_stream.generate.repair, mlx_stream.cache.splice): exact when the recomputed window
covers the rest, the session and its caches in step, serve's usage and rollbacks."""

from __future__ import annotations

import os
import queue

import mlx.core as mx
import pytest

from mlx_stream import blas
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.generate import repair as fix
from mlx_stream.generate.session import ChatSession, Settings, cache_count
from mlx_stream.serve.event_types import End, Failed, Started
from tests.support.engine import ask_turn, on_worker

TURNS = ["hello there friend", "what is the sea", "tell me more about it", "and the ships"]
EXACT = 10**6


def session(loaded, window=400, **kw) -> ChatSession:
    model, tokenizer = loaded
    settings = Settings(CacheSpec(sinks=4, window=window), max_tokens=kw.pop("max_tokens", 6))
    return ChatSession(model, tokenizer, settings, system="you are a captain", **kw)


def talked(loaded, **kw) -> ChatSession:
    s = session(loaded, **kw)
    for text in TURNS:
        s.reply(text, lambda t: None)
    return s


def edited(messages: list[dict]) -> list[dict]:
    out = [dict(m) for m in messages]
    out[2] = {"role": "user", "content": "what is the big blue ocean under the sky"}
    return out


def same_logits(a: mx.array, b: mx.array) -> bool:
    """Bit for bit under MLX's reference BLAS, which rounds a row alike in a call of any
    size; an optimized one (OpenBLAS, Accelerate) blocks by the call's shape, so the
    repair's other call sizes round a little apart there (OpenBLAS: 4.5e-5 in logits ~20)."""
    if os.path.basename(blas.active_blas() or "").startswith("libblas"):
        return mx.array_equal(a, b).item()
    return mx.allclose(a, b, rtol=0, atol=1e-4).item()


def next_logits(s: ChatSession, user: str) -> tuple[mx.array, list[int]]:
    tokens, _ = s.turn_tokens(user)
    return s.model(mx.array(tokens)[None], cache=s.caches)[0, -1], s.tokens + tokens


def test_an_exact_repair_equals_the_rebuild_bit_for_bit(loaded):
    s = talked(loaded)
    history = edited(s.messages)
    done = fix.repair(s, history, "new question", EXACT)
    assert not isinstance(done, str), done
    assert done.moved == 0 and done.prefix > 0 and done.recomputed > 0
    rebuilt = session(loaded)
    rebuilt.messages = [dict(m) for m in history]
    a, fed_a = next_logits(s, "new question")
    b, fed_b = next_logits(rebuilt, "new question")
    assert fed_a == fed_b
    assert same_logits(a, b), mx.abs(a - b).max().item()


def test_an_approximate_repair_keeps_the_caches_in_step_with_the_transcript(loaded):
    s = talked(loaded)
    old = len(s.tokens)
    history = edited(s.messages)
    done = fix.repair(s, history, "new question", 4)
    assert not isinstance(done, str), done
    assert done.recomputed >= 4 and done.moved > 0 and done.shift != 0
    assert done.prefix + done.recomputed + done.moved == cache_count(s.caches) == len(s.tokens)
    assert cache_count(s.caches) == old + done.shift
    assert s.messages == history
    assert s.tokens + s.pending == fix.encode_like_rebuild(s, s.fed_text)
    reply = s.reply("new question", lambda t: None)  # the next turn appends as usual
    assert reply.prompt_tokens > 0 and len(s.tokens) == cache_count(s.caches)


def test_a_pasted_tail_sits_where_a_prefill_puts_it(loaded):
    """The first layer's keys depend on the token and its position only: a tail cut
    from one context and pasted after a longer one equals that context's own keys."""
    from mlx_stream.cache import splice

    model, _ = loaded
    s = session(loaded)
    head, longer, tail = [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11, 12, 13, 14, 15], [20, 21, 22, 23]
    a, b, c = (s.make_caches() for _ in range(3))
    model(mx.array(head + tail)[None], cache=a)
    model(mx.array(longer + tail)[None], cache=b)
    model(mx.array(longer)[None], cache=c)
    cut = splice.cut(a, len(head))
    splice.paste(c, cut, len(longer) - len(head))
    n = len(longer) + len(tail)
    assert c[0].tokens_seen == n
    got, want = c[0].keys[..., len(longer) : n, :], b[0].keys[..., len(longer) : n, :]
    assert mx.allclose(got, want, atol=1e-4).item()
    assert not mx.allclose(cut.pairs[0][0], want, atol=1e-2).item()  # it did move


def test_chat_edit_replaces_a_turn_and_answers_the_last_message_again(loaded):
    s = talked(loaded)
    again, done = fix.edit(
        s, 2, "what is the big blue ocean under the sky", fix.DEFAULT_REPAIR_TOKENS
    )
    assert again == TURNS[-1] and not isinstance(done, str)
    assert [m["content"] for m in s.messages if m["role"] == "user"] == [
        TURNS[0], "what is the big blue ocean under the sky", TURNS[2],
    ]  # fmt: skip
    s.reply(again, lambda t: None)
    assert len(s.messages) == 8
    from mlx_stream.errors import UserError

    with pytest.raises(UserError, match="no turn 9"):
        fix.edit(s, 9, "x", 4)


# ----- serve ------------------------------------------------------------------------


@pytest.fixture
def engine(loaded, tmp_path):
    from mlx_stream.serve.engine import Engine

    made = []

    def make(window=400, **kw):
        model, tokenizer = loaded
        settings = Settings(CacheSpec(sinks=2, window=window), max_tokens=6)
        e = Engine(model, tokenizer, settings, "tiny", state_dir=tmp_path, **kw)
        e.start()
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


def converse(e, session_id=None) -> list[dict]:
    history: list[dict] = [{"role": "system", "content": "you are a captain"}]
    for text in TURNS[:3]:
        history.append({"role": "user", "content": text})
        reply, _ = ask_turn(e, history, session_id)
        history.append({"role": "assistant", "content": reply})
    return history


def edit_request(history: list[dict]) -> list[dict]:
    out = [dict(m) for m in history]
    out[3] = {"role": "user", "content": "what is the big blue ocean under the sky"}
    return out + [{"role": "user", "content": TURNS[3]}]


def test_serve_without_repair_rebuilds_as_before(engine):
    e, fresh = engine(repair_tokens=0), engine(repair_tokens=0)
    request = edit_request(converse(e))
    text, usage = ask_turn(e, request)
    assert "repaired_tokens" not in usage and usage["prompt_tokens_details"]["cached_tokens"] <= 64
    assert ask_turn(fresh, request)[0] == text


def test_serve_repairs_an_edit_and_counts_it(engine):
    e, exact, fresh = engine(repair_tokens=4), engine(repair_tokens=EXACT), engine()
    request = edit_request(converse(e))
    converse(exact)
    _, usage = ask_turn(e, request)
    details = usage["prompt_tokens_details"]
    assert usage["repaired_tokens"] >= 4 and usage["reused_tokens"] > usage["repaired_tokens"]
    assert details["cached_tokens"] == usage["reused_tokens"]
    fed = usage["prompt_tokens"] - details["cached_tokens"] - usage["repaired_tokens"]
    assert 0 < fed < 16  # the new message only
    text, usage = ask_turn(exact, request)
    assert usage["reused_tokens"] > 0
    assert text == ask_turn(fresh, request)[0]  # exact: the rebuilt session's reply


def test_serve_repairs_an_edit_of_the_first_message_without_a_session_id(engine):
    e = engine(repair_tokens=4)
    request = [dict(m) for m in converse(e)]
    request[1] = {"role": "user", "content": "hello the big blue sea"}  # the first message
    _, usage = ask_turn(e, request + [{"role": "user", "content": TURNS[3]}])
    assert usage["repaired_tokens"] >= 4 and usage["reused_tokens"] > usage["repaired_tokens"]


def test_a_cancelled_or_failed_turn_after_a_repair_goes_back_to_before(engine, monkeypatch):
    e = engine(repair_tokens=4)
    history = converse(e, "mine")
    entry = e.entries[("", "mine")]
    before = (list(entry.session.tokens), entry.session.fed_text, [dict(m) for m in entry.messages])
    from mlx_stream.serve.engine import Request

    events: queue.Queue = queue.Queue()
    request = Request(emit=events.put, messages=edit_request(history), session_id="mine")
    request.cancelled.set()  # the client went away: nothing more is sent
    e.submit(request)
    assert isinstance(events.get(timeout=60), Started)
    while e.call(lambda: entry.busy).result():
        pass
    s = entry.session
    assert (s.tokens, s.fed_text, entry.messages) == before
    assert cache_count(s.caches) == len(s.tokens)

    def broken(*a, **kw):
        raise RuntimeError("the model failed")

    monkeypatch.setattr(fix, "feed", broken)
    _, err = ask_turn(e, edit_request(history), "mine")
    assert err[1] == 500 and "the model failed" in err[2]
    s = entry.session
    assert (s.tokens, s.fed_text, entry.messages) == before
    assert cache_count(s.caches) == len(s.tokens)
    _, usage = ask_turn(e, history + [{"role": "user", "content": "more"}], "mine")
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(before[0])  # appended


def edited_past_the_window(e, at: int) -> tuple[dict, tuple]:
    """The start info and last event of a conversation resent with its message ``at``
    (from the end) changed, past the window's first eviction."""
    from mlx_stream.serve.engine import Request

    request = converse(e)
    request[at] = {**request[at], "content": "a different recent message"}
    events: queue.Queue = queue.Queue()
    e.submit(Request(emit=events.put, messages=request + [{"role": "user", "content": "so"}]))
    start = events.get(timeout=60)
    while not isinstance(last := events.get(timeout=60), (End, Failed)):
        pass
    return start, last


def test_serve_resumes_an_edit_reaching_the_window_from_the_prompt_before_it(engine):
    # the reply before the last question, past the first eviction: no repair, but the
    # mark of the prompt before that reply (two turns back) encodes what comes before it
    start, last = edited_past_the_window(engine(window=24, repair_tokens=4), -3)
    assert isinstance(last, End) and "repaired_tokens" not in last.usage
    # how it was served goes to the access log with the request
    assert start.note.startswith("resumed from the prompt 2 turns back ("), start
    assert "tokens were evicted" in start.note
    assert last.usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_serve_resumes_an_edit_of_the_last_turn_past_its_first_eviction(engine):
    """The mark of the last turn's prompt encodes everything before the edit (its
    reply): the session goes back to it and feeds the rest, not the whole transcript
    again."""
    start, last = edited_past_the_window(engine(window=24, repair_tokens=4), -1)
    assert isinstance(last, End), last
    assert start.note.startswith("resumed from the last turn's prompt ("), start
    assert last.usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_serve_resumes_an_edit_of_the_last_question_from_the_turn_before(engine):
    """The last question edited: the checkpoint before its turn holds more of the
    transcript than the mark of the prompt before it, and serves."""
    start, last = edited_past_the_window(engine(window=24, repair_tokens=4), -2)
    assert isinstance(last, End) and last.usage["reused_tokens"] > 0, last
    assert start.note.startswith("edit resumed from the turn before, not repaired: ")
    assert last.usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_serve_keeps_a_session_whose_edit_is_among_evicted_tokens(engine):
    e = engine(window=24, repair_tokens=4)
    history = converse(e)
    entry = next(iter(e.entries.values()))
    seen = on_worker(e, lambda: cache_count(entry.session.caches))
    _, usage = ask_turn(e, edit_request(history))  # the second turn: long evicted
    assert (usage["repaired_tokens"], usage["reused_tokens"]) == (0, seen)
    assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] < 16


def test_serve_refuses_a_negative_repair_window_in_one_line():
    from typer.testing import CliRunner

    from cli.main import app
    from tests.support.cli import assert_one_line_error

    result = CliRunner().invoke(app, ["serve", "--repair-tokens", "-1"])
    assert_one_line_error(result, 2, "--repair-tokens must be at least 0")


# ----- edits among evicted tokens ------------------------------------------------------


def long_talk(loaded) -> ChatSession:
    """A chat whose window (48) has long since evicted its first turns."""
    s = session(loaded, window=48, max_tokens=8)
    for text in TURNS * 3:
        s.reply(text, lambda t: None)
    assert cache_count(s.caches) > 4 + 48 + 40
    return s


def test_an_edit_among_evicted_tokens_keeps_every_cache_as_it_is(loaded):
    s, same = long_talk(loaded), long_talk(loaded)
    seen = cache_count(s.caches)
    history = [dict(m) for m in s.messages]
    history[0] = {"role": "user", "content": "a much longer first message about the sea"}
    done = fix.repair(s, history, "and now", EXACT)
    assert not isinstance(done, str), done
    assert (done.recomputed, done.reused) == (0, seen)
    assert s.messages == history and cache_count(s.caches) == seen == len(s.tokens)
    # a second edit there, after the first, is again among evicted tokens
    history[2] = {"role": "user", "content": "short"}
    assert not isinstance(fix.repair(s, history, "and now", EXACT), str)
    # no KV changed: the next logits are the unedited session's
    assert mx.array_equal(next_logits(s, "and now")[0], next_logits(same, "and now")[0]).item()


def test_an_edit_reaching_the_window_of_an_evicting_cache_is_refused(loaded):
    s = long_talk(loaded)
    history = [dict(m) for m in s.messages]
    history[-2] = {"role": "user", "content": "a different recent question"}
    before = (list(s.tokens), s.fed_text, cache_count(s.caches))
    why = fix.repair(s, history, "and now", EXACT)
    assert isinstance(why, str) and "window" in why
    assert (s.tokens, s.fed_text, cache_count(s.caches)) == before


def test_a_second_edit_at_the_end_keeps_the_run_between_the_two(loaded):
    """An agent clears an old tool result and resends its last reply otherwise than it
    was generated: the run of tokens between the two edits is kept (moved), not
    computed again, and the caches stay in step with the transcript."""
    s = talked(loaded)
    old = len(s.tokens)
    history = edited(s.messages)
    history[-1] = {"role": "assistant", "content": "a reply written otherwise"}
    p = fix.plan(s, history, "new question", 4)
    assert not isinstance(p, str) and p.keep is not None, p
    done = fix.apply(s, history, p)
    assert done.moved > done.recomputed > 4  # the edited span and 4 tokens after it
    assert done.prefix + done.recomputed + done.moved == cache_count(s.caches) == len(s.tokens)
    assert len(s.tokens) < old  # the old tokens after the run were dropped, not kept
    assert s.messages == history
    assert s.tokens + s.pending == fix.encode_like_rebuild(s, s.fed_text)
    rebuilt = session(loaded)
    rebuilt.messages = [dict(m) for m in history]
    a, fed_a = next_logits(s, "new question")
    b, fed_b = next_logits(rebuilt, "new question")
    assert fed_a == fed_b  # the same transcript: only the moved run's KV is approximate


def test_one_edit_plans_as_before(loaded):
    s = talked(loaded)
    p = fix.plan(s, edited(s.messages), "new question", 4)
    assert not isinstance(p, str) and p.keep is None
