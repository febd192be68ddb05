"""ollama's API on ``serve``, driven by the official ``ollama`` Python client: chat and
generate, whole and streamed (the same text, ollama's counts), a tool call and its
result continuing the session, ``format`` as a JSON constraint, options mapped, the
model routes, and errors in ollama's shape."""

from __future__ import annotations

import json

import pytest

from tests.support.agents import WEATHER
from tests.support.server import Server, http

ollama = pytest.importorskip("ollama")


@pytest.fixture(scope="module")
def server(tiny_bpe_model_dir):
    s = Server(tiny_bpe_model_dir, "--sinks", "2", "--window", "2048", "--max-tokens", "200")
    s.client = ollama.Client(host=s.url)
    yield s
    s.stop()


def ask(text="hello the sea"):
    return [{"role": "user", "content": text}]


GREEDY = {"temperature": 0, "num_predict": 10}


def test_chat_whole_and_streamed_agree_with_ollamas_counts(server):
    whole = server.client.chat(model="default", messages=ask(), options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.prompt_eval_count > 0 and 0 < whole.eval_count <= 10
    assert whole.total_duration >= whole.prompt_eval_duration > 0
    parts = list(server.client.chat(model="default", messages=ask(), options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_num_predict_and_stop_are_honored(server):
    one = server.client.chat(model="default", messages=ask("the whale"),
                             options={"temperature": 0, "num_predict": 1})  # fmt: skip
    assert one.eval_count == 1 and one.done_reason == "length"
    text = server.client.chat(model="default", messages=ask("the whale"), options=GREEDY)
    word = text.message.content.split()[1] if len(text.message.content.split()) > 1 else None
    if word:
        cut = server.client.chat(model="default", messages=ask("the whale"),
                                 options={**GREEDY, "stop": [word]})  # fmt: skip
        assert word not in cut.message.content


def test_generate_renders_the_prompt_as_a_turn_and_raw_as_text(server):
    done = server.client.generate(model="default", prompt="the sea", options=GREEDY)
    assert done.response and done.done and done.prompt_eval_count > 2
    raw = server.client.generate(model="default", prompt="the sea", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < done.prompt_eval_count  # no template around it
    streamed = "".join(p.response for p in server.client.generate(
        model="default", prompt="the sea", options=GREEDY, stream=True))  # fmt: skip
    assert streamed == done.response


def test_an_empty_request_loads_the_model(server):
    assert server.client.generate(model="default").done_reason == "load"
    assert server.client.chat(model="default", messages=[]).done_reason == "load"


CALL = {"function": {"name": "get_weather", "arguments": {"city": "rome", "days": 2}}}


def test_a_tool_call_and_its_result_continue_the_session(server):
    """A transcript with an assistant's tool call (arguments an object, no id, as
    ollama's clients send it) and its result; resent with the reply and a new
    question, it continues the same session: only the new turn is fed."""
    messages = [*ask("weather in rome"), {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "clear sky", "tool_name": "get_weather"}]  # fmt: skip
    first = server.client.chat(model="default", messages=messages, tools=[WEATHER], options=GREEDY)
    assert first.done and first.prompt_eval_count > 0
    messages += [first.message.model_dump(exclude_none=True), *ask("and tomorrow")]
    second = server.client.chat(model="default", messages=messages, tools=[WEATHER], options=GREEDY)
    assert second.prompt_eval_count > first.prompt_eval_count + first.eval_count
    line = [x for x in server.log().splitlines() if "POST /api/chat" in x][-1]
    cached = int(line.split(" cached=")[1].split()[0].replace(",", ""))
    assert cached >= first.prompt_eval_count, line


def test_tool_calls_and_results_in_the_engines_shape():
    from mlx_stream.serve.ollama import Message, _call, chat_messages

    out = chat_messages([
        Message(role="assistant", content="", tool_calls=[CALL, CALL]),
        Message(role="tool", content="b", tool_name="get_weather"),
        Message(role="tool", content="c"),
    ])  # fmt: skip
    ids = [c["id"] for c in out[0]["tool_calls"]]
    assert len(set(ids)) == 2 and [m["tool_call_id"] for m in out[1:]] == ids
    assert json.loads(out[0]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "rome",
        "days": 2,
    }
    back = _call(out[0]["tool_calls"][0])
    assert back == {"function": {"name": "get_weather", "arguments": {"city": "rome", "days": 2}}}


def test_format_holds_the_reply_to_json_and_a_schema(server):
    done = server.client.chat(model="default", messages=ask("a city"), format="json",
                              options={"temperature": 0, "num_predict": 60})  # fmt: skip
    if done.done_reason == "stop":
        assert isinstance(json.loads(done.message.content), dict)
    else:  # ran out of tokens inside the object: still a prefix of one
        assert done.message.content.startswith("{")
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["rome"]}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    done = server.client.chat(model="default", messages=ask("a city"), format=schema,
                              options={"temperature": 1.0, "seed": 3, "num_predict": 200})  # fmt: skip
    assert done.done_reason == "stop", done
    assert json.loads(done.message.content) == {"city": "rome"}


def test_repeat_penalty_changes_the_sampling(server):
    plain = server.client.generate(model="default", prompt="the the the", raw=True,
                                   options={"temperature": 0, "num_predict": 24})  # fmt: skip
    penalized = server.client.generate(model="default", prompt="the the the", raw=True,
                                       options={"temperature": 0, "num_predict": 24,
                                                "repeat_penalty": 5.0})  # fmt: skip
    assert plain.response != penalized.response


def test_model_routes(server):
    tags = server.client.list()
    names = [m.model for m in tags.models]
    assert names and all(m.size > 0 and m.details.family for m in tags.models)
    shown = server.client.show(names[0])
    assert "tools" in shown.capabilities and shown.details.parameter_size
    running = server.client.ps()
    assert running.models[0].size >= tags.models[0].size
    version = http("GET", server.url + "/api/version").json()
    assert version["version"]


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/api/chat", {"model": "default", "messages": ask(), "think": True}, "think"),
        ("/api/chat", {"model": "default", "messages": [{"role": "user", "content": "x",
                                                         "images": ["aGk="]}]}, "images"),
        ("/api/generate", {"model": "default", "prompt": "x", "suffix": "y"}, "suffix"),
        ("/api/generate", {"model": "default", "prompt": "x", "context": [1, 2]}, "context"),
        ("/api/chat", {"model": "default", "messages": ask(), "format": "yaml"}, "format"),
        ("/api/chat", {"model": "default", "messages": ask(),
                       "options": {"temperature": -1}}, "temperature"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_in_ollamas_shape(server, path, body, words):
    r = http("POST", server.url + path, json.dumps(body).encode())
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"]


def test_an_unknown_model_is_404_and_the_client_raises(server):
    with pytest.raises(ollama.ResponseError) as raised:
        server.client.chat(model="llama9:70b", messages=ask())
    assert raised.value.status_code == 404 and "llama9:70b" in raised.value.error
