"""A prompt longer than the window is a stream like any other on ``serve``: the head of
a long system prompt is pinned (at most ``pin`` tokens), the rest flows through the
window, a new session's whole history goes in, and only ``--max-prompt-tokens`` (counted
over all that is fed) refuses a request, leaving no session behind."""

from __future__ import annotations

import queue

from mlx_stream.generate.batch import DEFAULT_PREFILL_CHUNK
from mlx_stream.serve.event_types import End, Failed, Prefill
from tests.support.engine import ask, make_engine, on_worker

SYSTEM = "you are a captain of the sea " * 60  # ~360 tokens: far over a 64-token window


def sessions(engine) -> dict[str, dict]:
    on_worker(engine, engine.publish)
    return {s["id"]: s for s in engine.stats["sessions"]}


def rendered_tokens(engine, messages) -> int:
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def test_a_system_prompt_longer_than_the_window_is_served_with_its_head_pinned(loaded, tmp_path):
    e = make_engine(loaded, tmp_path, pin=16)
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        text, usage, error = ask(e, messages, session_id="long", max_tokens=4)
        assert error is None, error
        assert usage["prompt_tokens"] == rendered_tokens(e, messages)  # fed whole
        info = sessions(e)["long"]
        assert info["sinks"] == 16 and info["tokens_evicted"] > 0, info
        follow = [*messages, {"role": "assistant", "content": text},
                  {"role": "user", "content": "and then"}]  # fmt: skip
        _, usage, error = ask(e, follow, session_id="long", max_tokens=4)
        assert error is None and usage["prompt_tokens_details"]["cached_tokens"] > 300, usage
    finally:
        e.stop()


def test_a_long_system_prompt_is_fed_once_then_shared_by_the_next_sessions(loaded, tmp_path):
    e = make_engine(loaded, tmp_path, pin=16)
    try:
        system = {"role": "system", "content": SYSTEM}
        first = [system, {"role": "user", "content": "hi"}]
        _, one, error = ask(e, first, session_id="one", max_tokens=2)
        assert error is None and one["prompt_tokens_details"]["cached_tokens"] == 0
        assert len(e.snapshots) == 1
        second = [system, {"role": "user", "content": "hello the ship"}]
        text, two, error = ask(e, second, session_id="two", max_tokens=2)
        assert error is None
        head = one["prompt_tokens"] - 12  # all but the first turn's few tokens
        assert two["prompt_tokens_details"]["cached_tokens"] > head, (one, two)
        history = [
            {"role": "user", "content": "of the sea"},
            {"role": "assistant", "content": "ok"},
        ]
        third = [system, *history, {"role": "user", "content": "the ship"}]  # a rebuild
        _, three, error = ask(e, third, session_id="three", max_tokens=2)
        assert error is None and three["prompt_tokens_details"]["cached_tokens"] > head, three
        alone = make_engine(loaded, tmp_path / "alone", pin=16)
        try:  # the shared copy answers as a session that fed its own
            assert ask(alone, second, session_id="two", max_tokens=2)[0] == text
        finally:
            alone.stop()
    finally:
        e.stop()


def test_a_fork_of_the_first_session_with_a_long_prompt_starts_from_its_snapshot(loaded, tmp_path):
    """The first session had a history: its checkpoint was taken before its head went
    in. A second question on that history (no id: a fork of it) takes the head from the
    snapshot the first one left, not from that checkpoint."""
    e = make_engine(loaded, tmp_path, pin=16)
    try:
        system = {"role": "system", "content": SYSTEM}
        history = [
            {"role": "user", "content": "of the sea"},
            {"role": "assistant", "content": "ok"},
        ]
        first = [system, *history, {"role": "user", "content": "the ship"}]
        _, one, error = ask(e, first, max_tokens=2)
        assert error is None and one["prompt_tokens_details"]["cached_tokens"] == 0
        fork = [system, *history, {"role": "user", "content": "the whale"}]
        _, two, error = ask(e, fork, max_tokens=2)
        assert error is None and len(sessions(e)) == 2
        assert two["prompt_tokens_details"]["cached_tokens"] > one["prompt_tokens"] - 30, two
    finally:
        e.stop()


def test_the_pin_defaults_to_the_window_when_that_is_smaller(loaded, tmp_path):
    e = make_engine(loaded, tmp_path)  # window 64 < DEFAULT_PIN_TOKENS
    try:
        assert e.pin == 64
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        _, _, error = ask(e, messages, session_id="pinned", max_tokens=2)
        assert error is None and sessions(e)["pinned"]["sinks"] == 64
    finally:
        e.stop()


def test_a_first_request_with_a_history_is_fed_whole(loaded, tmp_path):
    e = make_engine(loaded, tmp_path)
    try:
        history = []
        for i in range(6):
            history += [{"role": "user", "content": f"tell me of the sea {i} " * 20},
                        {"role": "assistant", "content": "the whale and the ship " * 10}]  # fmt: skip
        messages = [*history, {"role": "user", "content": "and now"}]
        events: queue.Queue = queue.Queue()
        from mlx_stream.serve.engine import Request

        e.submit(Request(emit=events.put, messages=messages, max_tokens=2, progress=True))
        seen = []
        while not isinstance(event := events.get(timeout=120), (End, Failed)):
            seen.append(event)
        assert isinstance(event, End), event
        whole = rendered_tokens(e, messages)
        assert event.usage["prompt_tokens"] == whole > 10 * 64
        progress = [(ev.done, ev.total) for ev in seen if isinstance(ev, Prefill)]
        assert progress and all(total == whole for _, total in progress)
        done = [d for d, _ in progress]
        assert done == sorted(done) and 0 < done[-1] <= whole
        # read from the caches, not counted from polls: the last line says all but the
        # prompt's last chunk (which goes in with the first token) is in
        assert done[-1] >= whole - DEFAULT_PREFILL_CHUNK - 1, (done[-1], whole)
    finally:
        e.stop()


def test_progress_is_what_the_caches_hold_not_a_count_of_polls():
    from types import SimpleNamespace

    from mlx_stream.serve.matching import Entry
    from mlx_stream.serve.scheduler import Job, fed_so_far

    layer = SimpleNamespace(tokens_seen=700, offset=0)
    entry = Entry(id="x", system=None, session=SimpleNamespace(caches=[layer]))
    job = Job(request=None, entry=entry, tokens=iter(()), cached=500, prompt=1000)
    assert fed_so_far(job) == 200
    layer.tokens_seen = 1900  # the window wrapped: tokens_seen still counts every token
    assert fed_so_far(job) == 1000
    job.cached = 2000  # a stored head read: cached grew past what the caches had counted
    assert fed_so_far(job) == 0




def test_over_max_prompt_tokens_in_all_is_413_and_leaves_no_session(loaded, tmp_path):
    """The new message is short; its history is not: counted once matched."""
    e = make_engine(loaded, tmp_path, max_prompt_tokens=200)
    try:
        history = [{"role": "user", "content": "the sea " * 80},
                   {"role": "assistant", "content": "the whale " * 80}]  # fmt: skip
        messages = [*history, {"role": "user", "content": "hi"}]
        _, _, error = ask(e, messages, session_id="big", max_tokens=2)
        assert error is not None and error[1] == 413, error
        assert "--max-prompt-tokens" in error[2] and "\n" not in error[2]
        assert "big" not in sessions(e)
        _, _, error = ask(e, [{"role": "user", "content": "hi"}], session_id="big", max_tokens=2)
        assert error is None  # the name is free, the engine serves on
    finally:
        e.stop()


def test_system_messages_anywhere_stay_in_the_transcript(loaded, tmp_path):
    e = make_engine(loaded, tmp_path)
    try:
        turn = [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}]
        text, usage, error = ask(e, turn, session_id="notes", max_tokens=3)
        assert error is None, error
        assert usage["prompt_tokens"] == rendered_tokens(e, turn)
        follow = [*turn, {"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
        _, usage, error = ask(e, follow, session_id="notes", max_tokens=3)
        assert error is None and usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
    finally:
        e.stop()


def test_an_operators_ceiling_is_said_in_a_header_and_the_log(tiny_model_dir):
    import json

    from tests.support.server import Server

    s = Server(tiny_model_dir, "--window", "64", "--max-tokens-ceiling", "3")
    try:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 500,
            "logit_bias": {"1": -100, "3": -100},
        }  # fmt: skip (no end of text)
        import urllib.request

        req = urllib.request.Request(s.url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            headers, done = dict(r.headers), json.loads(r.read())
        assert headers["x-max-tokens-ceiling"] == "3"
        assert done["usage"]["completion_tokens"] <= 3
        assert done["choices"][0]["finish_reason"] == "length"
    finally:
        s.stop()
    assert "max_tokens 500 capped at --max-tokens-ceiling 3" in s.log()
