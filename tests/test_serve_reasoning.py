"""A model's thought kept apart from its answer (``serve.reasoning``): the split itself
on text cut anywhere, each API's shape of it (OpenAI ``reasoning_content``, Anthropic
``thinking`` blocks, Responses ``reasoning`` items, ollama's ``thinking``) whole and
streamed, tool calls read from the answer only, and a real engine whose template
opens the thought in its generation prompt."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from mlx_stream.serve.event_types import Delta, End, Reasoning, Started, ToolCall
from mlx_stream.serve.reasoning import ThinkStream, left_open, markers

MARKS = ("<think>", "</think>")
USAGE = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
         "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def split(pieces: list[str], opened: bool = False) -> tuple[str, str, dict]:
    out: list = []
    stream = ThinkStream(MARKS, out.append, thinking=opened)
    for piece in pieces:
        stream(Delta(piece))
    stream(End(USAGE, "stop"))
    thought = "".join(e.text for e in out if isinstance(e, Reasoning))
    answer = "".join(e.text for e in out if isinstance(e, Delta))
    return thought, answer, out[-1].usage


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 100])
def test_the_thought_comes_apart_wherever_the_text_is_cut(cut):
    text = "<think>\nthe sea is wide</think>\n\nIt is wide. <think>not again</think>"
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    thought, answer, usage = split(pieces)
    assert thought == "\nthe sea is wide"
    assert answer == "It is wide. <think>not again</think>"  # one thought per reply
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] <= len(pieces)


def test_a_prompt_that_opened_the_thought_makes_the_reply_start_inside_it():
    assert left_open("<|im_start|>assistant\n<think>\n", MARKS)
    assert not left_open("<think>a</think> b", MARKS) and not left_open("plain", MARKS)
    thought, answer, _ = split(["the", " sea", "</th", "ink>", "\n", "\nIt is."], opened=True)
    assert (thought, answer) == ("the sea", "It is.")
    thought, answer, usage = split(["never", " closed"], opened=True)
    assert (thought, answer) == ("never closed", "")
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 2


def test_a_model_without_markers_gets_no_stream():
    assert markers(SimpleNamespace(has_thinking=False, think_start=None)) is None
    assert markers(SimpleNamespace(has_thinking=True, think_start="<a>", think_end="</a>")) == (
        "<a>",
        "</a>",
    )


def test_a_tool_call_is_read_from_the_answer_not_the_thought(tiny_tools_model_dir):
    from mlx_stream.models.loader import load
    from mlx_stream.serve.tools import CallStream, ToolPlan
    from tests.support.agents import WEATHER

    _, tokenizer = load(str(tiny_tools_model_dir))
    plan = ToolPlan.make([WEATHER], "auto", tokenizer)
    out: list = []
    stream = ThinkStream(MARKS, CallStream(plan, out.append))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n</tool_call>'
    for piece in ["<think>maybe ", call, "</think>", call]:
        stream(Delta(piece))
    stream(End(USAGE, "stop"))
    assert [type(e) for e in out] == [Reasoning, Reasoning, ToolCall, End]
    assert call in "".join(e.text for e in out if isinstance(e, Reasoning))
    assert out[-1].finish_reason == "tool_calls"
    session = SimpleNamespace(messages=[{"role": "assistant", "content": "as generated"}])
    stream.settle(session)  # the transcript's reply in the canonical shape, as without a thought
    assert session.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"


# ------------------------------------------------------------------ each API's shape


class Scripted:
    """A stand-in engine: every request gets the same raw reply, split as serve splits
    it (a thought, then an answer, then a tool call)."""

    model_id, weights, stats = "tiny", 0, {}
    settings = SimpleNamespace(cache=SimpleNamespace(window=64), max_tokens=16)
    tokenizer = SimpleNamespace(has_thinking=True, think_start="<think>", think_end="</think>")
    RAW = ["<think>", "the sea", " is wide", "</think>", "\n\n", "It is", " wide."]

    def submit(self, request):
        def run():
            request.emit(Started("s"))
            stream = ThinkStream(MARKS, request.emit)
            for piece in self.RAW:
                stream(Delta(piece))
            stream(End(USAGE, "stop"))

        threading.Thread(target=run).start()


@pytest.fixture
def client():
    from mlx_stream.serve.app import create_app

    with TestClient(create_app(Scripted(), quiet=True, ui=False)) as c:
        yield c


def sse(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            out.append(json.loads(line[6:]))
    return out


MESSAGES = [{"role": "user", "content": "is the sea wide?"}]


def test_openai_chat_reasoning_content_whole_and_streamed(client):
    whole = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "the sea is wide"
    assert message["content"] == "It is wide."
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2
    body = {"messages": MESSAGES, "stream": True}
    chunks = sse(client.post("/v1/chat/completions", json=body).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "the sea is wide"
    assert "".join(d.get("content") or "" for d in deltas) == "It is wide."


def test_anthropic_thinking_blocks_whole_and_streamed(client):
    body = {"model": "tiny", "max_tokens": 16, "messages": MESSAGES}
    whole = client.post("/v1/messages", json=body).json()
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "the sea is wide"
    assert whole["content"][1]["text"] == "It is wide."
    events = sse(client.post("/v1/messages", json={**body, "stream": True}).text)
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [
        (0, "thinking"),
        (1, "text"),
    ]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "the sea is wide"
    assert "".join(d.get("text", "") for d in deltas) == "It is wide."
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]


def test_responses_reasoning_item_whole_and_streamed(client):
    whole = client.post("/v1/responses", json={"input": "is the sea wide?"}).json()
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == "the sea is wide"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    body = {"input": "is the sea wide?", "stream": True}
    events = sse(client.post("/v1/responses", json=body).text)
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "the sea is wide"
    added = [(e["output_index"], e["item"]["type"]) for e in events
             if e["type"] == "response.output_item.added"]  # fmt: skip
    assert added == [(0, "reasoning"), (1, "message")]
    done = next(e for e in events if e["type"] == "response.completed")
    assert [i["type"] for i in done["response"]["output"]] == ["reasoning", "message"]


def test_ollama_thinking_whole_and_streamed(client):
    body = {"model": "tiny", "messages": MESSAGES, "stream": False, "think": True}
    whole = client.post("/api/chat", json=body).json()
    assert whole["message"]["thinking"] == "the sea is wide"
    assert whole["message"]["content"] == "It is wide."
    lines = client.post("/api/chat", json={**body, "stream": True}).text.splitlines()
    pieces = [json.loads(line)["message"] for line in lines]
    assert "".join(p.get("thinking", "") for p in pieces) == "the sea is wide"
    gen = {"model": "tiny", "prompt": "is the sea wide?", "stream": False}
    whole = client.post("/api/generate", json=gen).json()
    assert (whole["thinking"], whole["response"]) == ("the sea is wide", "It is wide.")


# ------------------------------------------------------------------ a real engine


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)  # as Qwen3's switch: thinking off writes an empty thought into the generation prompt


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory):
    """The tiny BPE llama whose tokenizer has ``<think>``/``</think>`` (mlx-lm then
    says it thinks) and whose template opens the thought, as DeepSeek-R1's does."""
    from tests.support.bpe import save_bpe_model_folder

    path = tmp_path_factory.mktemp("thinking") / "tiny-thinking"
    return save_bpe_model_folder(path, THINKING_TEMPLATE, extra_specials=MARKS)


@pytest.fixture(scope="module")
def thinking(thinking_model_dir, tmp_path_factory):
    from mlx_stream.models.loader import load
    from mlx_stream.serve.app import create_app
    from tests.support.engine import make_engine

    loaded = load(str(thinking_model_dir))
    assert markers(loaded[1]) == MARKS
    engine = make_engine(loaded, tmp_path_factory.mktemp("state"), settings={"window": 256})
    try:
        with TestClient(create_app(engine, quiet=True, ui=False)) as c:
            yield c
    finally:
        engine.stop()


def test_a_real_engine_routes_a_thought_the_template_opened(thinking):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    whole = thinking.post("/v1/chat/completions", json=body).json()
    message, usage = whole["choices"][0]["message"], whole["usage"]
    thought, details = message.get("reasoning_content") or "", usage["completion_tokens_details"]
    assert thought and "<think>" not in message["content"] + thought
    assert 1 <= details["reasoning_tokens"] <= usage["completion_tokens"] == 6


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}),
        ("/v1/chat/completions", {"reasoning_effort": "none"}),
        ("/v1/messages", {"model": "tiny", "thinking": {"type": "disabled"}}),
        ("/api/chat", {"model": "tiny", "think": False, "stream": False}),
    ],
)
def test_each_api_can_switch_the_thought_off(thinking, route, body):
    """The request's switch reaches the template (``enable_thinking``): the generation
    prompt then closes the thought, and the whole reply is the answer."""
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, **body}
    if route == "/api/chat":
        body["options"] = {"num_predict": body.pop("max_tokens"), "temperature": 0}
    reply = json.dumps(thinking.post(route, json=body).json())
    assert "reasoning_content" not in reply and '"thinking"' not in reply, reply
    on = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "reasoning_effort": "high"}
    whole = thinking.post("/v1/chat/completions", json=on).json()
    assert whole["choices"][0]["message"].get("reasoning_content")
