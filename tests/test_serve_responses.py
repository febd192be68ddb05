"""OpenAI's Responses API on ``serve``, driven by the official ``openai`` client:
text and item input, instructions, previous_response_id on the same session (cached
tokens), function tools and their outputs, streamed events, GET by id."""

from __future__ import annotations

import json

import pytest

from tests.support.agents import WEATHER, Answer
from tests.support.server import Server, http

openai = pytest.importorskip("openai")

TOOL = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def server(tiny_bpe_model_dir):
    s = Server(tiny_bpe_model_dir, "--sinks", "2", "--window", "2048", "--max-tokens", "200")
    yield s
    s.stop()


def test_text_input_and_previous_response_id_go_on_from_the_cache(server):
    first = server.client.responses.create(model="default", input="hello the sea",
                                           instructions="you are a captain", max_output_tokens=8)  # fmt: skip
    assert first.object == "response" and first.output_text
    assert first.status in ("completed", "incomplete")
    second = server.client.responses.create(
        model="default", input="and the ship", previous_response_id=first.id,
        instructions="you are a captain", max_output_tokens=8,
    )  # fmt: skip
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.total_tokens - 1
    assert 0 < second.usage.input_tokens - cached < 40  # only the new input was fed
    got = server.client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text


def test_item_input_equals_text_input(server):
    a = server.client.responses.create(model="default", input="the whale", max_output_tokens=6,
                                       extra_headers={"X-Session-ID": "r0"})  # fmt: skip
    items = [{"role": "user", "content": [{"type": "input_text", "text": "the whale"}]}]
    b = server.client.responses.create(model="default", input=items, max_output_tokens=6,
                                       extra_headers={"X-Session-ID": "r1"})  # fmt: skip
    assert a.output_text == b.output_text


def test_a_function_call_and_its_output_continue_the_response(server):
    first = server.client.responses.create(model="default", input="weather in paris",
                                           tools=[TOOL], tool_choice="required")  # fmt: skip
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("paris", "rome")
    second = server.client.responses.create(
        model="default", previous_response_id=first.id, tools=[TOOL], max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens - 1


def test_streamed_events_add_up_to_the_whole_response(server):
    kw = {"model": "default", "input": "weather", "tools": [TOOL], "tool_choice": "required"}
    whole = server.client.responses.create(**kw, extra_headers={"X-Session-ID": "s0"})
    kinds, final, args = [], None, ""
    for event in server.client.responses.create(**kw, stream=True,
                                                extra_headers={"X-Session-ID": "s1"}):  # fmt: skip
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            args += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    (call,) = [o for o in whole.output if o.type == "function_call"]
    assert args == call.arguments
    assert [o.model_dump() for o in final.output] == [o.model_dump() for o in whole.output]
    text = list(server.client.responses.create(model="default", input="hi", stream=True,
                                               max_output_tokens=5))  # fmt: skip
    deltas = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    done = [e for e in text if e.type in ("response.completed", "response.incomplete")][0]
    assert deltas == done.response.output_text


def test_text_format_json_schema_is_structured_output(server):
    done = server.client.responses.parse(model="default", input="a color", text_format=Answer)
    assert isinstance(done.output_parsed, Answer)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
         "input.0.call_id"),
        ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                             "schema": {"type": "strang"}}}},
         "text.format.schema"),
    ],
)  # fmt: skip
def test_bad_input_is_400_naming_the_field(server, body, field):
    r = http("POST", server.url + "/v1/responses", json.dumps(body).encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_store_false_keeps_nothing(server):
    done = server.client.responses.create(model="default", input="hi", max_output_tokens=3,
                                          store=False)  # fmt: skip
    assert done.output_text is not None
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(done.id)


def test_unknown_ids_are_404(server):
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        server.client.responses.create(model="default", input="hi", previous_response_id="resp_x")
