"""Agents on ``serve`` with the embedded default model (SmolLM2-135M-Instruct, whose
template has no tool support: tools are rendered into the system prompt and forced
calls are constrained by llguidance), driven by the official openai and anthropic
clients."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from tests.support.agents import WEATHER
from tests.support.server import Server

pytestmark = pytest.mark.real_model
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server(real_model_path):
    s = Server(real_model_path, "--window", "1024", "--max-tokens", "60")
    s.claude = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    yield s
    s.stop()


def chat(server, messages, **kw):
    return server.client.chat.completions.create(model="default", messages=messages, **kw)


def test_parse_returns_a_pydantic_object(server):
    done = server.client.chat.completions.parse(
        model="default", response_format=Person,
        messages=[{"role": "user", "content": "Give me a person as JSON."}],
    )  # fmt: skip
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_a_named_tool_choice_is_a_valid_call_and_streams_the_same(server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    whole = chat(server, ask, tools=[WEATHER], tool_choice=NAMED,
                 extra_headers={"X-Session-ID": "w0"})  # fmt: skip
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"}
    parts, finish = {}, None
    for chunk in chat(server, ask, tools=[WEATHER], tool_choice=NAMED, stream=True,
                      extra_headers={"X-Session-ID": "w1"}):  # fmt: skip
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                p = parts.setdefault(d.index, ["", "", ""])
                p[0] += d.id or ""
                p[1] += d.function.name or ""
                p[2] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert parts == {0: [call.id, "get_weather", call.function.arguments]}


def test_a_three_step_tool_loop_reuses_the_cache(server):
    messages = [{"role": "system", "content": "You answer with tools."},
                {"role": "user", "content": "What is the weather in Rome?"}]  # fmt: skip
    first = chat(server, messages, tools=[WEATHER], tool_choice="required")
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]  # fmt: skip
    second = chat(server, messages, tools=[WEATHER], max_tokens=20)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.total_tokens - 1
    assert second.usage.prompt_tokens - cached < 40  # the tool result alone (of ~300)
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": "Thanks!"}]  # fmt: skip
    third = chat(server, messages, tools=[WEATHER], max_tokens=10)
    assert third.usage.prompt_tokens_details.cached_tokens >= second.usage.total_tokens - 1


def test_keep_system_pins_the_tool_definitions(server):
    ask = [{"role": "system", "content": "You answer with tools."},
           {"role": "user", "content": "Hi"}]  # fmt: skip
    chat(server, ask, max_tokens=2, extra_headers={"X-Session-ID": "plain"})
    chat(server, ask, max_tokens=2, tools=[WEATHER], extra_headers={"X-Session-ID": "tools"})
    sessions = server.sessions()
    assert sessions["tools"]["sinks"] > sessions["plain"]["sinks"] + 50  # definitions pinned


def test_anthropic_create_and_stream_with_tool_use(server):
    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip
    kw = {"model": "default", "max_tokens": 60, "tools": [tool],
          "messages": [{"role": "user", "content": "Weather in Paris?"}],
          "tool_choice": {"type": "tool", "name": "get_weather"}}  # fmt: skip
    whole = server.claude.messages.create(**kw, extra_headers={"X-Session-ID": "a0"})
    assert whole.stop_reason == "tool_use"
    kinds = []
    with server.claude.messages.stream(**kw, extra_headers={"X-Session-ID": "a1"}) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.input for b in final.content if b.type == "tool_use"] == [
        b.input for b in whole.content if b.type == "tool_use"
    ]
    plain = server.claude.messages.create(model="default", max_tokens=10,
                                          messages=[{"role": "user", "content": "Hello"}])  # fmt: skip
    assert plain.content[0].text and plain.stop_reason in ("end_turn", "max_tokens")


def test_responses_previous_response_id_reports_cached_tokens(server):
    first = server.client.responses.create(model="default", input="What is the capital of France?",
                                           max_output_tokens=20)  # fmt: skip
    second = server.client.responses.create(model="default", input="And of Italy?",
                                            previous_response_id=first.id, max_output_tokens=20)  # fmt: skip
    assert first.output_text and second.output_text
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens - 1


def test_auto_gives_text_or_a_valid_call(server):
    """tool_choice auto on a template without tool support: whatever the model
    chooses, a call it writes is a valid one and text never holds a broken call."""
    reply = chat(server, [{"role": "user", "content": "What is the weather in Paris?"}],
                 tools=[WEATHER], max_tokens=60)  # fmt: skip
    choice = reply.choices[0]
    for call in choice.message.tool_calls or []:
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and args["city"] in ("paris", "rome")
    if choice.finish_reason != "tool_calls":
        assert "<tool_call>" not in (choice.message.content or "")
