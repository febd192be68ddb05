"""gpt-oss's harmony format (``serve.harmony``): a reply's ``analysis`` channel as
reasoning, ``final`` and preambles as text, a message to ``functions.NAME`` as a tool
call (the recipient after or before the channel), on text cut anywhere; the chat route
and ollama's and Anthropic's, whole and streamed, on a tiny tokenizer whose template is
written in OpenAI's documented harmony format (not copied from a model repository)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from mlx_stream.serve.event_types import Delta, End, Reasoning, Started, ToolCall
from mlx_stream.serve.harmony import HarmonyStream
from tests.support.agents import WEATHER

SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
            "<|return|>", "<|call|>")  # fmt: skip
# Harmony as documented: a developer message declares the functions, each message is
# <|start|>ROLE...<|message|>BODY<|end|>, a call goes to=functions.NAME on commentary
# and ends with <|call|>, its result comes from functions.NAME; the generation prompt
# is <|start|>assistant.
TEMPLATE = (
    "{% set ns = namespace(name='') %}"
    "{% if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\n"
    "namespace functions {\n\n{% for t in tools %}// {{ t.function.description }}\n"
    "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n\n"
    "{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "{% set ns.name = c.function.name %}<|start|>assistant<|channel|>commentary "
    "to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ ns.name }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
ARGS = '{"city": "rome", "days": 2}'
THOUGHT = "<|channel|>analysis<|message|>the sea is wide<|end|>"
ANSWER = THOUGHT + "<|start|>assistant<|channel|>final<|message|>It is wide."
CALL = (THOUGHT + "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather "
        "<|constrain|>json<|message|>" + ARGS)  # fmt: skip
CALL_FIRST = (THOUGHT + "<|start|>assistant to=functions.get_weather<|channel|>commentary "
              "json<|message|>" + ARGS)  # fmt: skip
USAGE = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
         "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


@pytest.fixture(scope="module")
def harmony_model_dir(tmp_path_factory):
    from tests.support.bpe import save_bpe_model_folder

    path = tmp_path_factory.mktemp("harmony") / "tiny-harmony"
    return save_bpe_model_folder(path, TEMPLATE, extra_specials=SPECIALS)


@pytest.fixture(scope="module")
def tokenizer(harmony_model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(harmony_model_dir)


def read(tokenizer, reply: str, cut: int, tools: list | None = None, session=None) -> list:
    """The events of ``reply`` cut every ``cut`` characters, through the streams a
    chat request with ``tools`` gets (then settled into ``session``)."""
    from mlx_stream.serve.reasoning import reader
    from mlx_stream.serve.tools import CallStream, ToolPlan

    out: list = []
    plan = ToolPlan.make(tools, "auto", tokenizer)
    emit = CallStream(plan, out.append) if plan is not None else out.append
    stream = reader(tokenizer, emit)
    assert isinstance(stream, HarmonyStream)
    for i in range(0, len(reply), cut):
        stream(Delta(reply[i : i + cut]))
    stream(End(USAGE, "stop"))
    if session is not None:
        stream.settle(session)
    return out


def parts(events: list) -> tuple[str, str, list]:
    thought = "".join(e.text for e in events if isinstance(e, Reasoning))
    text = "".join(e.text for e in events if isinstance(e, Delta))
    calls = [e.call["function"] for e in events if isinstance(e, ToolCall)]
    return thought, text, [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_analysis_is_the_thought_and_final_the_answer_wherever_cut(tokenizer, cut):
    events = read(tokenizer, ANSWER, cut)
    assert parts(events) == ("the sea is wide", "It is wide.", [])
    details = events[-1].usage["completion_tokens_details"]
    assert 0 < details["reasoning_tokens"] <= len(ANSWER) // cut + 1
    assert events[-1].finish_reason == "stop"


@pytest.mark.parametrize("reply", [CALL, CALL_FIRST], ids=["channel-first", "recipient-first"])
@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_a_message_to_a_function_is_a_call_wherever_its_recipient_is(tokenizer, reply, cut):
    session = SimpleNamespace(messages=[{"role": "assistant", "content": "as generated"}])
    events = read(tokenizer, reply, cut, [WEATHER], session)
    thought, text, calls = parts(events)
    assert thought == "the sea is wide"
    assert text == ("Let me look." if reply is CALL else "")  # a preamble is text
    assert calls == [("get_weather", {"city": "rome", "days": 2})]
    assert events[-1].finish_reason == "tool_calls"
    # the transcript's reply in the canonical shape, as for every family
    assert session.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_no_marker_reaches_the_text_and_a_call_without_tools_is_its_body(tokenizer):
    thought, text, calls = parts(read(tokenizer, CALL, 2))
    assert (thought, calls) == ("the sea is wide", [])
    assert text == "Let me look." + ARGS
    assert not any(s in thought + text for s in SPECIALS)


def test_plain_text_and_a_forced_call_outside_any_message_stay_for_the_call_reader(tokenizer):
    from mlx_stream.serve.tools import START, ToolPlan

    assert parts(read(tokenizer, "no header here", 4)) == ("", "no header here", [])
    stray = "a<|constrain|>b<|start|>c<|channel|>d"
    assert parts(read(tokenizer, stray, 3)) == ("", "abcd", [])  # out of place: dropped
    plan = ToolPlan.make([WEATHER], "required", tokenizer)
    assert (plan.start, plan.end) == (START, "</tool_call>")  # what the grammar writes


def test_harmony_is_found_and_its_reply_ends_at_return_or_call_not_end(tokenizer):
    from mlx_stream.generate.model_config import end_of_turn_tokens
    from mlx_stream.serve import call_formats

    assert call_formats.native(tokenizer).name == "harmony"
    vocab = tokenizer.get_vocab()
    ends = set(end_of_turn_tokens(tokenizer))
    assert {vocab["<|return|>"], vocab["<|call|>"]} <= ends
    assert not {vocab[s] for s in ("<|end|>", "<|start|>", "<|message|>")} & ends


def test_the_template_writes_a_call_back_that_reads_again(tokenizer):
    from mlx_stream.serve.tools import ToolPlan

    plan = ToolPlan.make([WEATHER], "auto", tokenizer)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": ARGS}}  # fmt: skip
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]  # fmt: skip
    shown, extra = plan.toolset.for_template(messages)
    prompt = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True,
                                           **extra)  # fmt: skip
    assert "type get_weather" in prompt and prompt.endswith("<|start|>assistant")
    written = prompt.split("<|start|>user<|message|>weather?<|end|><|start|>assistant")[1]
    written = written.split("<|start|>functions.get_weather to=assistant")[0]
    assert parts(read(tokenizer, written, 5, [WEATHER]))[2] == [
        ("get_weather", {"city": "rome", "days": 2})
    ]


# ------------------------------------------------------------------ each API's shape


class Scripted:
    """A stand-in engine on the harmony tokenizer: each request is planned as serve
    plans it (its streams assembled by the planner) and gets ``RAW`` in pieces."""

    model_id, weights, stats = "tiny", 0, {}
    settings = SimpleNamespace(cache=SimpleNamespace(window=64), max_tokens=16)

    def __init__(self, tokenizer):
        from mlx_stream.generate.model_config import DEFAULT_SAMPLING
        from mlx_stream.serve.planning import Planner

        self.tokenizer, self.raw = tokenizer, ANSWER
        self.planner = Planner(tokenizer, DEFAULT_SAMPLING, self.settings, draft=False,
                               max_prompt_tokens=4096, max_tokens_ceiling=None)  # fmt: skip

    def submit(self, request):
        emit = self.planner.plan(request).request.emit

        def run():
            emit(Started("s"))
            for i in range(0, len(self.raw), 5):
                emit(Delta(self.raw[i : i + 5]))
            emit(End(USAGE, "stop"))

        threading.Thread(target=run).start()


@pytest.fixture
def engine(tokenizer):
    return Scripted(tokenizer)


@pytest.fixture
def client(engine):
    from mlx_stream.serve.app import create_app

    with TestClient(create_app(engine, quiet=True, ui=False)) as c:
        yield c


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


MESSAGES = [{"role": "user", "content": "is the sea wide?"}]


def test_chat_route_whole_and_streamed(client, engine):
    whole = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("the sea is wide", "It is wide.")
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 1
    chunks = sse(
        client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True}).text
    )
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "the sea is wide"
    assert "".join(d.get("content") or "" for d in deltas) == "It is wide."


@pytest.mark.parametrize("raw", [CALL, CALL_FIRST], ids=["channel-first", "recipient-first"])
def test_chat_route_tool_call_whole_and_streamed(client, engine, raw):
    engine.raw = raw
    body = {"messages": MESSAGES, "tools": [WEATHER]}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "the sea is wide"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "rome", "days": 2}
    chunks = sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    streamed = [c for d in deltas for c in d.get("tool_calls") or ()]
    assert streamed and streamed[0]["function"]["name"] == "get_weather"
    args = "".join(c["function"].get("arguments") or "" for c in streamed)
    assert json.loads(args) == {"city": "rome", "days": 2}
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == ("Let me look." if raw is CALL else "")
    assert not any(s in text for s in SPECIALS)


def test_ollama_thinking_and_call_whole_and_streamed(client, engine):
    body = {"model": "tiny", "messages": MESSAGES, "stream": False, "think": True}
    whole = client.post("/api/chat", json=body).json()
    assert (whole["message"]["thinking"], whole["message"]["content"]) == (
        "the sea is wide",
        "It is wide.",
    )
    lines = client.post("/api/chat", json={**body, "stream": True}).text.splitlines()
    pieces = [json.loads(line)["message"] for line in lines]
    assert "".join(p.get("thinking", "") for p in pieces) == "the sea is wide"
    assert "".join(p.get("content", "") for p in pieces) == "It is wide."
    engine.raw = CALL_FIRST
    whole = client.post("/api/chat", json={**body, "tools": [WEATHER]}).json()
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "rome", "days": 2}}
    lines = client.post("/api/chat", json={**body, "tools": [WEATHER], "stream": True}).text
    calls = [
        c
        for line in lines.splitlines()
        for c in json.loads(line)["message"].get("tool_calls") or ()
    ]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_anthropic_thinking_block_and_tool_use_whole(client, engine):
    body = {"model": "tiny", "max_tokens": 16, "messages": MESSAGES}
    whole = client.post("/v1/messages", json=body).json()
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "the sea is wide"
    engine.raw = CALL
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]  # fmt: skip
    whole = client.post("/v1/messages", json={**body, "tools": tools}).json()
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][2]["input"] == {"city": "rome", "days": 2}
    assert whole["stop_reason"] == "tool_use"


def test_a_real_engine_serves_a_harmony_model(harmony_model_dir, tmp_path):
    """The tiny model (random weights) on the harmony template: its reply goes through
    the harmony stream, and no marker reaches the client."""
    from mlx_stream.models.loader import load
    from mlx_stream.serve.app import create_app
    from tests.support.engine import make_engine

    engine = make_engine(load(str(harmony_model_dir)), tmp_path, settings={"window": 256})
    try:
        with TestClient(create_app(engine, quiet=True, ui=False)) as c:
            body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
            whole = c.post("/v1/chat/completions", json=body).json()
    finally:
        engine.stop()
    message = whole["choices"][0]["message"]
    text = (message.get("content") or "") + (message.get("reasoning_content") or "")
    assert not any(s in text for s in SPECIALS)
    assert "reasoning_tokens" in whole["usage"]["completion_tokens_details"]
