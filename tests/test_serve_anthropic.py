"""Anthropic's Messages API on ``serve``, driven by the official ``anthropic`` client:
whole and streamed replies (events in order), tool use and tool results on one
session, count_tokens, errors in Anthropic's shape, x-api-key auth."""

from __future__ import annotations

import json

import pytest

from tests.support.agents import WEATHER
from tests.support.server import Server, http

anthropic = pytest.importorskip("anthropic")

TOOL = {"name": WEATHER["function"]["name"], "description": "the weather",
        "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_bpe_model_dir):
    s = Server(tiny_bpe_model_dir, "--sinks", "2", "--window", "2048", "--max-tokens", "200")
    s.claude = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    yield s
    s.stop()


def ask(text="hello the sea"):
    return [{"role": "user", "content": text}]


def test_create_answers_in_anthropics_shape(server):
    done = server.claude.messages.create(model="default", max_tokens=12, messages=ask(),
                                         system="you are a captain")  # fmt: skip
    assert done.type == "message" and done.role == "assistant"
    assert done.content[0].type == "text" and done.content[0].text
    assert done.stop_reason in ("end_turn", "max_tokens")
    assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0


def test_stream_sends_the_events_in_order_and_adds_up(server):
    kw = {"model": "default", "max_tokens": 12, "messages": ask("the whale")}
    whole = server.claude.messages.create(**kw, extra_headers={"X-Session-ID": "a0"})
    kinds = []
    with server.claude.messages.stream(**kw, extra_headers={"X-Session-ID": "a1"}) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    raw = [k for k in kinds if k not in ("text",)]  # the SDK adds its own text events
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_and_its_result_continue_the_session(server):
    messages = ask("weather in rome")
    first = server.claude.messages.create(
        model="default", max_tokens=200, messages=messages, tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("paris", "rome")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "clear sky"}]},
    ]  # fmt: skip
    second = server.claude.messages.create(model="default", max_tokens=8, messages=messages,
                                           tools=[TOOL])  # fmt: skip
    used = (
        first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    )
    assert second.usage.cache_read_input_tokens >= used - 1
    assert 0 < second.usage.input_tokens < 100  # only the result was fed


def test_a_streamed_tool_use_equals_the_whole_one(server):
    kw = {"model": "default", "max_tokens": 200, "messages": ask("weather"), "tools": [TOOL],
          "tool_choice": {"type": "any"}}  # fmt: skip
    whole = server.claude.messages.create(**kw, extra_headers={"X-Session-ID": "t0"})
    with server.claude.messages.stream(**kw, extra_headers={"X-Session-ID": "t1"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "tool_use"


def test_count_tokens_counts_what_a_turn_feeds(server):
    counted = server.claude.messages.count_tokens(model="default", messages=ask("the sea"))
    done = server.claude.messages.create(model="default", max_tokens=1, messages=ask("the sea"),
                                         extra_headers={"X-Session-ID": "count"})  # fmt: skip
    fed = done.usage.input_tokens + done.usage.cache_read_input_tokens
    assert counted.input_tokens == fed
    with_tools = server.claude.messages.count_tokens(model="default", messages=ask("the sea"),
                                                     tools=[TOOL])  # fmt: skip
    assert with_tools.input_tokens > counted.input_tokens


def post(server, body):
    return http("POST", server.url + "/v1/messages", json.dumps(body).encode())


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": "default", "messages": ask()}, "max_tokens"),
        ({"model": "default", "max_tokens": 5, "messages": [
            *ask(), {"role": "assistant", "content": "x"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                          "content": "1"}]}]},
         "messages.2.content.0.tool_use_id"),
        ({"model": "default", "max_tokens": 5, "messages": ask(), "tools": [TOOL],
          "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"model": "default", "max_tokens": 5, "messages": ask(),
          "tools": [{**TOOL, "input_schema": {"type": "strang"}}]}, "tools"),
    ],
)  # fmt: skip
def test_bad_input_is_400_in_anthropics_shape(server, body, words):
    before = server.sessions()
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"]
    assert server.sessions() == before or server.sessions().keys() == before.keys()


def test_the_client_raises_anthropics_error(server):
    with pytest.raises(anthropic.NotFoundError):
        server.claude.messages.create(model="gpt-9", max_tokens=5, messages=ask())


def test_x_api_key_is_accepted_as_well_as_bearer(tiny_model_dir):
    s = Server(tiny_model_dir, "--sinks", "2", "--window", "64", "--api-key", "sesame")
    try:
        good = anthropic.Anthropic(base_url=s.url, api_key="sesame", max_retries=0)
        assert good.messages.create(model="default", max_tokens=2, messages=ask()).content
        bad = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model="default", max_tokens=2, messages=ask())
        r = http("POST", s.url + "/v1/messages", b"{}")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    finally:
        s.stop()


def test_top_k_one_samples_the_greedy_reply(server):
    """Sampling fields arrive as extra body fields (this SDK has no arguments for them)."""
    kw = {"model": "default", "max_tokens": 8, "messages": ask("the old captain")}

    def create(session, **sampling):
        return (
            server.claude.messages.create(
                **kw, extra_body=sampling, extra_headers={"X-Session-ID": session}
            )
            .content[0]
            .text
        )

    greedy = create("k0", temperature=0)
    assert create("k1", temperature=1.0, top_k=1) == greedy
    assert any(create(f"k{i + 2}", temperature=1.0) != greedy for i in range(3))  # it samples


def test_a_stop_sequence_is_reported_by_name(server):
    kw = {"model": "default", "max_tokens": 12, "messages": ask("the whale and the sea")}
    whole = server.claude.messages.create(**kw, extra_headers={"X-Session-ID": "q0"})
    text = whole.content[0].text
    word = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text[: text.find(word)]
    stopped = server.claude.messages.create(**kw, stop_sequences=["\x00never", word],
                                            extra_headers={"X-Session-ID": "q1"})  # fmt: skip
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert "".join(b.text for b in stopped.content) == cut
    with server.claude.messages.stream(**kw, stop_sequences=[word],
                                       extra_headers={"X-Session-ID": "q2"}) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None


def test_a_long_prefill_keeps_claude_codes_idle_timer_alive():
    """Claude Code's 300 s idle timer ignores ``ping`` events; from the second ping on
    (5 s of prefill) each one also carries an empty text delta, which resets it. A short
    prompt's single ping changes nothing in the reply."""
    import asyncio

    from mlx_stream.serve import events
    from mlx_stream.serve.anthropic import _stream
    from mlx_stream.serve.event_types import Delta, End

    class Cancel:
        cancelled = asyncio.Event()
        matched_stop = None

    def replay(script):
        async def run():
            job = events.Job(asyncio.get_running_loop())
            for event in script:
                job.events.put_nowait(event)
            return [chunk async for chunk in _stream(job, Cancel(), "msg_1", "default")]

        chunks = asyncio.run(run())
        return [(c.split("\n")[0][7:], json.loads(c.split("\n")[1][6:])) for c in chunks]

    end = End({"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}, "stop")
    short = replay([events.Ping(1, 1), Delta("hi"), end])
    assert [k for k, _ in short][:3] == ["message_start", "ping", "content_block_start"]
    long = replay([events.Ping(1, 9), events.Ping(5, 9), events.Ping(9, 9), Delta("hi"), end])
    kinds = [k for k, _ in long]
    assert kinds[:5] == ["message_start", "ping", "ping", "content_block_start",
                         "content_block_delta"]  # fmt: skip
    deltas = [d["delta"]["text"] for k, d in long if k == "content_block_delta"]
    assert deltas == ["", "", "hi"]  # one text block: the keepalives, then the reply
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
