"""Agents on ``serve`` (issue 25), as their clients meet them: a real server driven by
the official ``openai`` client. Sampling fields with OpenAI's meanings, structured
output (llguidance, per batch row), tool calls in OpenAI's shape."""

from __future__ import annotations

import json
import threading

import pytest

from mlx_stream.serve.event_types import Delta, End, ToolCall
from tests.support.agents import WEATHER, Answer
from tests.support.server import Server, http

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
         "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server(tiny_model_dir, "--sinks", "2", "--window", "256", "--max-tokens", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bpe(tiny_bpe_model_dir):
    s = Server(tiny_bpe_model_dir, "--sinks", "2", "--window", "2048", "--max-tokens", "200")
    yield s
    s.stop()


def chat(server, messages, **kw):
    return server.client.chat.completions.create(model="default", messages=messages, **kw)


def post(server, body: dict, path: str = "/v1/chat/completions"):
    return http("POST", server.url + path, json.dumps(body).encode())


HI = [{"role": "user", "content": "hello the sea"}]


# -------------------------------------------------------------------- sampling fields


def test_logit_bias_moves_the_greedy_choice(server):
    plain = chat(server, HI, max_tokens=6, logprobs=True, extra_headers={"X-Session-ID": "b0"})
    first = plain.choices[0].logprobs.content[0].token
    from tests.tiny import make_tokenizer

    tok = make_tokenizer()  # the served folder's vocabulary
    banned = tok.convert_tokens_to_ids(first)
    forced = tok.convert_tokens_to_ids("whale")
    reply = chat(server, HI, max_tokens=6, logprobs=True, logit_bias={str(banned): -100},
                 extra_headers={"X-Session-ID": "b1"})  # fmt: skip
    assert reply.choices[0].logprobs.content[0].token != first
    reply = chat(server, HI, max_tokens=4, logit_bias={str(forced): 100},
                 extra_headers={"X-Session-ID": "b2"})  # fmt: skip
    assert reply.choices[0].message.content.split() == ["whale"] * 4


def test_a_reply_ends_at_every_token_that_ends_a_turn(server):
    """A model that writes <|im_start|> has begun someone else's turn: the reply ends
    there (it ran on, role text and all, while only eos ended it; Claude Code then got
    max_tokens replies from the default model)."""
    from tests.tiny import make_tokenizer

    start = make_tokenizer().convert_tokens_to_ids("<|im_start|>")
    reply = chat(server, HI, max_tokens=6, logit_bias={str(start): 100},
                 extra_headers={"X-Session-ID": "eot"})  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "" and reply.usage.completion_tokens <= 1


def test_a_logit_bias_outside_the_vocabulary_is_400_naming_it(server):
    r = post(server, {"messages": HI, "logit_bias": {"999999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = post(server, {"messages": HI, "logit_bias": {"5": 500}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text


def test_penalties_change_how_often_the_reply_repeats_itself(server):
    """Negative penalties reward what the reply already said: the greedy reply then
    repeats its own words (the plain one does not)."""

    def distinct(**kw):
        reply = chat(server, HI, max_tokens=12, logprobs=True, **kw)
        tokens = [t.token for t in reply.choices[0].logprobs.content]
        return len(set(tokens)), len(tokens)

    plain, n = distinct(extra_headers={"X-Session-ID": "f0"})
    frequent, _ = distinct(frequency_penalty=-2.0, extra_headers={"X-Session-ID": "f1"})
    present, _ = distinct(presence_penalty=-2.0, extra_headers={"X-Session-ID": "f2"})
    assert plain > frequent and plain > present, (plain, frequent, present, n)


def test_reply_penalties_follow_openais_formula():
    import mlx.core as mx
    import numpy as np

    from mlx_stream.serve.sampling import ReplyPenalties

    p = ReplyPenalties(presence=0.5, frequency=0.25)
    logits = mx.zeros((1, 8))
    out = p(mx.array([3, 3, 3]), logits)  # the prompt's tokens count for nothing
    assert np.allclose(np.array(out), 0)
    for token in (5, 5, 2):
        out = p(mx.array([token]), logits)
    expected = np.zeros(8)
    expected[5] = -(0.5 + 0.25 * 2)
    expected[2] = -(0.5 + 0.25)
    assert np.allclose(np.array(out)[0], expected)


def sampled(server, seed, session, **kw):
    reply = chat(server, HI, max_tokens=10, temperature=1.0, seed=seed,
                 extra_headers={"X-Session-ID": session}, **kw)  # fmt: skip
    return reply.choices[0].message.content


def test_a_seed_is_the_requests_own_whatever_runs_beside_it(server, tiny_model_dir):
    alone = sampled(server, 7, "s0")
    assert sampled(server, 7, "s1") == alone
    assert sampled(server, 8, "s2") != alone
    # Beside other sampling requests (batched together): the same tokens.
    results = {}

    def other(i):
        results[i] = sampled(server, 100 + i, f"o{i}")

    threads = [threading.Thread(target=other, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    results["mine"] = sampled(server, 7, "s3")
    for t in threads:
        t.join(60)
    assert results["mine"] == alone
    # Decoding alone (no batch) keys its sampler the same way.
    unbatched = Server(tiny_model_dir, "--sinks", "2", "--window", "256", "--no-batch")
    try:
        assert sampled(unbatched, 7, "n0") == alone
    finally:
        unbatched.stop()


# -------------------------------------------------------------------- structured output


def test_parse_with_a_pydantic_model_returns_the_object(bpe):
    done = bpe.client.chat.completions.parse(
        model="default", messages=HI, response_format=Answer, temperature=1.0, seed=3
    )
    answer = done.choices[0].message.parsed
    assert isinstance(answer, Answer)
    assert done.choices[0].finish_reason == "stop"


def test_json_object_gives_an_object(bpe):
    reply = chat(bpe, HI, response_format={"type": "json_object"}, max_tokens=60)
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # ran out of tokens inside the object: still a prefix of one
        assert text.startswith("{")


def test_constraints_are_per_row_inside_the_batch(bpe):
    """Two constrained rows and a plain one decode together; the plain one replies
    what it replies alone, the constrained ones parse."""
    plain_alone = chat(bpe, HI, max_tokens=30, extra_headers={"X-Session-ID": "p0"})
    steps = bpe.get("/v1/sessions")["batch"]["steps"]
    out = {}

    def constrained(i):
        done = bpe.client.chat.completions.parse(
            model="default", messages=[{"role": "user", "content": f"the sea {i}"}],
            response_format=Answer, extra_headers={"X-Session-ID": f"c{i}"},
        )  # fmt: skip
        out[i] = done.choices[0].message.parsed

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    out["plain"] = chat(bpe, HI, max_tokens=30, extra_headers={"X-Session-ID": "p1"})
    for t in threads:
        t.join(120)
    assert out["plain"].choices[0].message.content == plain_alone.choices[0].message.content
    assert all(isinstance(out[i], Answer) for i in range(2))
    batch = bpe.get("/v1/sessions")["batch"]
    assert batch["enabled"] and batch["steps"] > steps


@pytest.mark.parametrize(
    "response_format, field",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "xml"}, "response_format.type"),
    ],
)  # fmt: skip
def test_a_schema_that_is_not_a_schema_is_400_naming_the_field(server, response_format, field):
    before = server.sessions()
    r = post(server, {"messages": HI, "response_format": response_format})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert server.sessions().keys() == before.keys()


def test_a_tokenizer_llguidance_cannot_read_is_400(server):
    """The tiny WordLevel tokenizer has no byte map: refused, not ignored."""
    r = post(server, {"messages": HI, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"], r.text


# -------------------------------------------------------------------- tool calls


def test_a_named_tool_choice_returns_a_valid_call(bpe):
    reply = chat(bpe, [{"role": "user", "content": "weather in paris"}], tools=[WEATHER, CLOCK],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert args["city"] in ("paris", "rome") and args["days"] in (1, 2, 3)


def test_required_picks_one_of_the_tools(bpe):
    reply = chat(bpe, [{"role": "user", "content": "the time"}], tools=[WEATHER, CLOCK],
                 tool_choice="required", temperature=1.0, seed=5)  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")


def test_a_streamed_tool_call_adds_up_to_the_whole_one(bpe):
    ask = [{"role": "user", "content": "weather please"}]
    kw = {"tools": [WEATHER], "tool_choice": "required"}
    whole = chat(bpe, ask, extra_headers={"X-Session-ID": "w0"}, **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(bpe, ask, stream=True, extra_headers={"X-Session-ID": "w1"}, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
    (call,) = whole.message.tool_calls
    assert finish == whole.finish_reason == "tool_calls"
    assert calls == {0: {"id": call.id, "name": call.function.name,
                         "arguments": call.function.arguments}}  # fmt: skip


def test_a_tool_loop_feeds_only_the_result(bpe):
    """Call, result, answer: the turn with the tool result reuses the session's cache."""
    messages = [{"role": "system", "content": "you call tools"},
                {"role": "user", "content": "weather in rome"}]  # fmt: skip
    first = chat(bpe, messages, tools=[WEATHER], tool_choice="required")
    (call,) = first.choices[0].message.tool_calls
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    second = chat(bpe, messages, tools=[WEATHER], max_tokens=10)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.total_tokens - 1
    assert 0 < second.usage.prompt_tokens - cached < 100  # the result alone (of ~800)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tool_input_is_400_naming_the_field_and_the_session_stays(bpe):
    asks = [{"role": "user", "content": "weather"}]
    first = chat(bpe, asks, tools=[WEATHER], tool_choice="required",
                 extra_headers={"X-Session-ID": "bad"})  # fmt: skip
    before = bpe.sessions()["bad"]
    (call,) = first.choices[0].message.tool_calls
    history = asks + [first.choices[0].message.model_dump(exclude_none=True)]
    cases = [
        ({"messages": asks, "tools": [WEATHER], "tool_choice": {"type": "function",
          "function": {"name": "nope"}}}, "tool_choice"),
        ({"messages": history + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}],
          "tools": [WEATHER]}, "messages.2.tool_call_id"),
        ({"messages": [*asks, {"role": "tool", "tool_call_id": call.id, "content": "1"}],
          "tools": [WEATHER]}, "messages.1.tool_call_id"),
        ({"messages": asks, "tools": [{"type": "retrieval"}]}, "tools.0"),
        ({"messages": asks, "tool_choice": "required"}, "tool_choice"),
    ]  # fmt: skip
    for body, field in cases:
        r = post_with(bpe, body, "bad")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text
    after = bpe.sessions()["bad"]
    assert (after["tokens_seen"], after["turns"]) == (before["tokens_seen"], before["turns"])


def post_with(server, body, session):
    import urllib.error
    import urllib.request

    from tests.support.server import Response

    req = urllib.request.Request(
        server.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json", "X-Session-ID": session},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return Response(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, e.read())


def test_tool_call_text_is_parsed_from_a_stream_of_pieces():
    """CallStream holds back what may begin a marker and parses the call whole."""
    from mlx_stream.serve.tools import CallStream, ToolPlan
    from tests.tiny import make_tokenizer

    plan = ToolPlan.make([WEATHER], "auto", make_tokenizer())
    events = []
    stream = CallStream(plan, events.append)
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n</tool_call>'
    for i in range(0, len(text), 3):
        stream(Delta(text[i : i + 3]))
    stream(End({}, "stop"))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "Sure."
    (call,) = [e.call for e in events if isinstance(e, ToolCall)]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "rome", "days": 2}'}
    assert events[-1] == End({}, "tool_calls")


def test_a_template_with_tool_support_gets_the_tools_and_its_own_parser(tiny_tools_model_dir):
    """mlx-lm infers the template's parser (json_tools); the tools go to the template
    (tools=) and a forced call, rendered back by the template, matches what the
    model wrote, so the tool result alone is fed."""
    from mlx_stream.models.loader import load

    _, tok = load(str(tiny_tools_model_dir))
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    s = Server(tiny_tools_model_dir, "--sinks", "2", "--window", "2048", "--max-tokens", "200")
    try:
        ask = [{"role": "user", "content": "weather in rome"}]
        plain = chat(s, ask, max_tokens=1, extra_headers={"X-Session-ID": "n0"})
        first = chat(s, ask, tools=[WEATHER], tool_choice="required",
                     extra_headers={"X-Session-ID": "n1"})  # fmt: skip
        assert first.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the definitions
        (call,) = first.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        messages = ask + [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "clear"},
        ]
        second = chat(s, messages, tools=[WEATHER], max_tokens=4,
                      extra_headers={"X-Session-ID": "n1"})  # fmt: skip
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.total_tokens - 1
        assert 0 < second.usage.prompt_tokens - cached < 100
    finally:
        s.stop()


def test_decoding_alone_constrains_the_same_and_a_draft_model_is_refused(tiny_bpe_model_dir):
    """--no-batch: the constraint runs in the decode loop (same JSON as batched, greedy);
    with a draft model (speculative decoding) constraints are refused, not ignored."""
    asks = [{"role": "user", "content": "a color"}]
    batched = Server(tiny_bpe_model_dir, "--sinks", "2", "--window", "256", "--max-tokens", "60")
    try:
        want = batched.client.chat.completions.parse(model="default", messages=asks,
                                                     response_format=Answer)  # fmt: skip
    finally:
        batched.stop()
    alone = Server(tiny_bpe_model_dir, "--sinks", "2", "--window", "256", "--max-tokens", "60",
                   "--no-batch")  # fmt: skip
    try:
        got = alone.client.chat.completions.parse(model="default", messages=asks,
                                                  response_format=Answer)  # fmt: skip
    finally:
        alone.stop()
    assert got.choices[0].message.parsed == want.choices[0].message.parsed
    assert got.choices[0].message.content == want.choices[0].message.content
    drafted = Server(tiny_bpe_model_dir, "--sinks", "2", "--window", "256",
                     "--draft-model", str(tiny_bpe_model_dir))  # fmt: skip
    try:
        r = post(drafted, {"messages": asks, "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and "draft model" in r.json()["error"]["message"], r.text
        r = post(drafted, {"messages": asks, "logit_bias": {"5": 3}})
        assert r.status_code == 400, r.text
    finally:
        drafted.stop()


def test_auto_without_template_support_allows_text_or_only_valid_calls(tiny_bpe_model_dir):
    """The auto grammar (a template without tool support): free text, or text then
    calls of the declared tools with valid arguments; nothing else."""
    import llguidance

    from mlx_stream.models.loader import load
    from mlx_stream.serve.structured import Grammars
    from mlx_stream.serve.tools import ToolPlan

    _, tok = load(str(tiny_bpe_model_dir))
    plan = ToolPlan.make([WEATHER, CLOCK], "auto", tok)
    ll = Grammars(tok).ll_tokenizer()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n</tool_call>'
    cases = {
        "just text (with a.b (c) [d])": True,
        "sure. " + call: True,
        call + "\n" + call.replace("rome", "paris"): True,
        call.replace("rome", "oslo"): False,  # not in the enum
        call.replace("get_weather", "get_wether"): False,  # no such tool
        "<tool_call>\nnot json": False,
    }
    for text, ok in cases.items():
        matcher = llguidance.LLMatcher(ll, plan.grammar, log_level=0)
        fed = all(matcher.consume_token(t) for t in ll.tokenize_str(text))
        assert (fed and matcher.is_accepting()) == ok, text


def test_a_parsers_arguments_are_stored_as_their_echo_reads():
    """Whatever spacing a template's parser returns, the call carries one canonical
    JSON text (what canonical_message makes of the client's echo), so the follow-up
    matches the session; output a parser cannot read stays text."""
    from mlx_stream.serve.tools import CallStream, ToolPlan, canonical_message
    from tests.tiny import make_tokenizer

    plan = ToolPlan.make([WEATHER], "auto", make_tokenizer())
    plan.parser = lambda text, tools: {"name": "get_weather", "arguments": text.strip()}
    events = []
    stream = CallStream(plan, events.append)
    stream(Delta('<tool_call>{ "city" :"rome",\n "days": 2 }</tool_call>'))
    stream(Delta("<tool_call>[1, 2]</tool_call>"))  # not an object: text
    stream(End({}, "stop"))
    (call,) = [e.call for e in events if isinstance(e, ToolCall)]
    echo = canonical_message({"role": "assistant", "tool_calls": [call]})
    assert call["function"]["arguments"] == '{"city": "rome", "days": 2}'
    assert echo["tool_calls"][0]["function"] == call["function"]
    assert (
        "".join(e.text for e in events if isinstance(e, Delta)) == "<tool_call>[1, 2]</tool_call>"
    )
