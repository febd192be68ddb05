"""``serve``'s access log (one stderr line per request, ``quiet`` for none), prefill
keepalive pings, and whole replies that stop when their client leaves: in-process
apps over a tiny model (a TestClient, or the ASGI app called directly)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

import pytest
from fastapi import Request

from mlx_stream.generate.session import Settings
from mlx_stream.serve import accesslog, events
from mlx_stream.serve.event_types import Delta, End, Prefill, Started

SYSTEM = "you are a captain"
LINE = re.compile(
    r"^\d\d:\d\d:\d\d (?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d+|-)"
    r"(?: session=(?P<session>\S+))?"
    r"(?: fed=(?P<fed>[\d,]+) cached=(?P<cached>[\d,]+) gen=(?P<gen>[\d,]+))?"
    r"(?: ttft=(?P<ttft>[\d.]+)s)? total=(?P<total>[\d.]+)s(?P<notes>.*)$"
)


@pytest.fixture
def engine(loaded, tmp_path):
    from mlx_stream.cache import CacheSpec
    from mlx_stream.serve.engine import Engine

    made = []

    def make(max_tokens=8, **kw):
        model, tokenizer = loaded
        settings = Settings(CacheSpec(sinks=2, window=64), max_tokens=max_tokens)
        e = Engine(model, tokenizer, settings, "tiny", state_dir=tmp_path / f"s{len(made)}", **kw)
        e.start()
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


def lines(err: str) -> list[dict]:
    """The access-log lines of captured stderr, parsed (every line must parse)."""
    out = []
    for text in err.splitlines():
        match = LINE.match(text)
        assert match, text
        out.append(match.groupdict())
    return out


def numbers(line: dict) -> tuple[int, int, int]:
    return tuple(int(line[k].replace(",", "")) for k in ("fed", "cached", "gen"))


def from_usage(usage: dict) -> tuple[int, int, int]:
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens"] - cached, cached, usage["completion_tokens"]


def chat_body(text: str, **kw) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return {"messages": messages, **kw}


# ------------------------------------------------------------------ the log lines


def test_one_line_per_request_with_the_replys_numbers(engine, capsys):
    from fastapi.testclient import TestClient

    from mlx_stream.serve.app import create_app

    with TestClient(create_app(engine())) as client:
        capsys.readouterr()
        assert client.get("/health").status_code == 200
        whole = client.post(
            "/v1/chat/completions", json=chat_body("hello"), headers={"X-Session-ID": "ab12cd"}
        )
        assert whole.status_code == 200
        body = chat_body("the sea", stream=True, stream_options={"include_usage": True})
        streamed = client.post("/v1/chat/completions", json=body)
        assert streamed.status_code == 200
        chunks = [json.loads(x[6:]) for x in streamed.text.split("\n\n") if x[6:7] == "{"]
        missing = client.post("/v1/chat/completions", json={**chat_body("hi"), "model": "nope"})
        assert missing.status_code == 404
        plain = client.post("/v1/completions", json={"prompt": "the old ship"})
        assert plain.status_code == 200
    got = lines(capsys.readouterr().err)
    assert [(g["method"], g["path"], g["status"]) for g in got] == [
        ("GET", "/health", "200"),
        ("POST", "/v1/chat/completions", "200"),
        ("POST", "/v1/chat/completions", "200"),
        ("POST", "/v1/chat/completions", "404"),
        ("POST", "/v1/completions", "200"),
    ]
    health, first, stream, refused, completion = got
    assert health["session"] is None and health["fed"] is None and health["ttft"] is None
    assert refused["session"] is None and refused["fed"] is None
    assert first["session"] == "ab12cd"
    assert numbers(first) == from_usage(whole.json()["usage"])
    assert numbers(first)[1] == 0  # its system prompt computed for it: nothing cached
    assert stream["session"] == streamed.headers["x-session-id"]
    assert numbers(stream) == from_usage(chunks[-1]["usage"])
    assert numbers(stream)[1] > 0  # another session: the system prompt's shared snapshot
    assert completion["session"] == "-"  # a plain completion keeps no session
    assert numbers(completion) == from_usage(plain.json()["usage"])
    for line in (first, stream, completion):
        assert line["ttft"] is not None and float(line["ttft"]) <= float(line["total"])


def test_quiet_writes_nothing(engine, capsys):
    from fastapi.testclient import TestClient

    from mlx_stream.serve.app import create_app

    with TestClient(create_app(engine(), quiet=True)) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/chat/completions", json=chat_body("hello")).status_code == 200
        assert client.post("/v1/chat/completions", json={}).status_code == 400
    assert capsys.readouterr().err == ""


def test_refusals_by_key_and_notes_of_routes_are_logged(engine, capsys):
    """Behind API keys the record still reaches the routes (with the key's owner)."""
    from fastapi.testclient import TestClient

    from mlx_stream.serve.app import create_app, owner_of

    app = create_app(engine(), api_keys=["k1"])

    @app.get("/v1/noted")
    async def noted(http: Request):
        events.note(http, "ignored hosted tools: web_search")
        return {"owner": owner_of(http)}

    key = {"Authorization": "Bearer k1"}
    with TestClient(app) as client:
        capsys.readouterr()
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/noted", headers=key).json()["owner"]
        reply = client.post("/v1/chat/completions", json=chat_body("hello"), headers=key)
        assert reply.status_code == 200
        sessions = client.get("/v1/sessions", headers=key).json()["data"]
    refused, noted_line, chat, listed = lines(capsys.readouterr().err)
    assert (refused["path"], refused["status"]) == ("/v1/models", "401")
    assert noted_line["notes"] == " · ignored hosted tools: web_search"
    assert chat["session"] == reply.headers["x-session-id"] == sessions[0]["id"]
    assert numbers(chat) == from_usage(reply.json()["usage"])
    assert listed["status"] == "200"


def test_a_prompt_over_the_limit_is_413_on_every_route_before_the_engine(engine, capsys):
    from fastapi.testclient import TestClient

    from mlx_stream.serve.app import create_app

    long = "the sea " * 40
    with TestClient(create_app(engine(max_prompt_tokens=20))) as client:
        capsys.readouterr()
        chat = client.post("/v1/chat/completions", json=chat_body(long))
        body = {
            "model": "default",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": long}],
        }
        claude = client.post("/v1/messages", json=body)
    assert chat.status_code == claude.status_code == 413
    assert "--max-prompt-tokens" in chat.json()["error"]["message"]
    assert claude.json()["type"] == "error"
    got = lines(capsys.readouterr().err)
    assert [(g["path"], g["status"], g["session"]) for g in got] == [
        ("/v1/chat/completions", "413", None),
        ("/v1/messages", "413", None),
    ]
    assert "error 413: the prompt has" in got[0]["notes"]


def test_record_lines_and_prefill_progress():
    out: list[str] = []
    record = accesslog.Record("POST", "/v1/messages", started=100.0, out=out.append)
    record.event(Started("ab12cd"), 100.0)
    record.event(Prefill(512, 18718), 101.0)  # too soon for a progress line
    record.event(Prefill(4096, 18718), 110.0)
    record.event(Prefill(8192, 18718), 115.0)
    record.event(Prefill(18718, 18718), 120.5)
    record.event(Delta("a"), 171.3)
    record.event(Delta("b"), 172.0)
    usage = {"prompt_tokens": 18718, "completion_tokens": 42,
             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    record.event(End(usage, "stop"), 174.0)
    record.status = 200
    record.finish(175.0)
    record.finish(176.0)  # once
    progress = [line.split(" ", 1)[1] for line in out[:-1]]
    assert progress == [
        # 4,096 in 10 s: 410 tok/s, 14,622 left at that rate
        "POST /v1/messages prefill session=ab12cd 4,096/18,718 tokens · 410 tok/s · ~36s left",
        "POST /v1/messages prefill session=ab12cd 18,718/18,718 tokens",
    ]
    assert len(out) == 3
    assert out[-1].split(" ", 1)[1] == (
        "POST /v1/messages 200 session=ab12cd fed=18,718 cached=0 gen=42 ttft=71.3s total=75.0s"
    )


# ------------------------------------------------------------------ pings


@dataclass(frozen=True)
class Mystery:
    """An event kind no consumer knows."""

    n: int = 0


class FakeLoop:
    """Runs what the worker thread hands over at once (no event loop needed)."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


def test_prefill_becomes_at_most_one_ping_per_ping_every():
    now = [0.0]
    job = events.Job(FakeLoop(), clock=lambda: now[0])
    job.emit(Started(None))
    for t, done in [(0.0, 1), (1.0, 2), (4.9, 3), (5.0, 4), (7.0, 5), (9.9, 6), (10.5, 7)]:
        now[0] = t
        job.emit(Prefill(done, 100))
    job.emit(Mystery(1))
    job.emit(Delta("x"))
    queued = []
    while not job.events.empty():
        queued.append(job.events.get_nowait())
    assert queued == [
        Started(None),
        events.Ping(1, 100),  # the first at once
        events.Ping(4, 100),
        events.Ping(7, 100),
        Mystery(1),
        Delta("x"),
    ]
    assert events.PING_EVERY == 5.0


def test_consumers_ignore_pings_and_unknown_events():
    from mlx_stream.serve.app import _Shape, _sse

    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    script = [events.Ping(1, 9), Delta("hi"), Mystery(), End(usage, "stop")]

    class Engine:
        def submit(self, request):
            for event in [events.Ping(0, 9), Started("s"), *script]:
                request.emit(event)

    async def main():
        job, request, first = await events.start(Engine(), messages=[])
        reply = await events.drain(job, request)
        job = events.Job(asyncio.get_running_loop())
        for event in script:
            job.take(event)
        shape = _Shape("chat", "id", 0, "tiny")
        sent = [x async for x in _sse(job, request.cancelled, shape, False)]
        return first, reply, sent

    first, reply, sent = asyncio.run(main())
    assert first == Started("s")
    assert (reply.text, reply.finish, reply.error) == ("hi", "stop", None)
    assert sent[1] == ": ping\n\n"
    assert sent[-1] == "data: [DONE]\n\n" and not any('"error"' in s for s in sent)
    assert sum(s.startswith("data: {") for s in sent) == 3  # role, "hi", finish


# ------------------------------------------------------------------ a client that leaves


class LeavingClient:
    """A starlette request's ``is_disconnected`` that says yes after ``after`` seconds."""

    def __init__(self, after: float):
        self.at, self.scope = time.monotonic() + after, {}

    async def is_disconnected(self) -> bool:
        return time.monotonic() >= self.at


def wait_idle(e, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while e.call(lambda: any(x.busy for x in e.entries.values())).result():
        assert time.monotonic() < deadline, "a cancelled request never ended"
        time.sleep(0.01)


def endless(e) -> dict[int, float]:
    """A ``logit_bias`` that keeps the tiny model from ever ending its reply."""
    return {i: -100 for i in e.tokenizer.eos_token_ids}


def turns(e, session_id: str) -> int:
    return e.call(lambda: len(e.entries[("", session_id)].messages) // 2).result()


def test_drain_stops_a_reply_whose_client_left_and_the_session_rolls_back(engine):
    e = engine(max_tokens=100_000)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]

    async def ask(messages, http=None, **kw):
        job, request, first = await events.start(
            e, http=http, messages=messages, session_id="gone", **kw
        )
        assert isinstance(first, Started), first
        return request, await events.drain(job, request, http)

    _, first = asyncio.run(ask(messages, max_tokens=4))
    assert first.error is None and first.usage["completion_tokens"] == 4
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "the sea"}]  # fmt: skip
    began = time.monotonic()
    bias = {str(i): b for i, b in endless(e).items()}
    request, reply = asyncio.run(ask(messages, http=LeavingClient(0.5), logit_bias=bias))
    assert time.monotonic() - began < 5
    assert reply.error == (499, "the client closed the connection")
    assert reply.text and request.cancelled.is_set()  # it was generating, and stopped
    wait_idle(e)
    assert turns(e, "gone") == 1  # back to before the cut-off turn


def test_the_chat_route_stops_a_whole_reply_whose_client_left_and_logs_499(engine, monkeypatch):
    """The app called as ASGI: the client's ``http.disconnect`` comes 0.5 s in."""
    from mlx_stream.serve.app import create_app

    e = engine(max_tokens=100_000)
    app = create_app(e)
    out: list[str] = []
    monkeypatch.setattr(accesslog, "write", out.append)
    body = json.dumps(chat_body("hello", max_tokens=100_000, logit_bias=endless(e))).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", b"application/json"), (b"x-session-id", b"left")],
    }  # fmt: skip

    async def main():
        left, given, sent = time.monotonic() + 0.5, [], []

        async def receive():
            if not given:
                given.append(body)
                return {"type": "http.request", "body": body, "more_body": False}
            while time.monotonic() < left:
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 499
    wait_idle(e)
    assert turns(e, "left") == 0
    (line,) = lines("\n".join(out))
    assert line["path"] == "/v1/chat/completions"
    assert (line["status"], line["session"]) == ("499", "left")
    assert float(line["ttft"]) < 0.4 < float(line["total"]) < 5
