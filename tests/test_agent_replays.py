"""The request bodies Claude Code and Codex really send (captured from the CLIs, see
``tests/fixtures/agents``), replayed against ``serve``: every one answered 200 with the
event sequence its client expects, the long prompt fed whole through a small window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.server import Server, http

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
CLAUDE = ["claude_code_first", "claude_code_tool_result", "claude_code_side_title"]
CODEX = ["codex_first", "codex_tool_result"]
WINDOW = 512  # far below the prompts: they must stream through it, never be refused


@pytest.fixture(scope="module")
def server(tiny_bpe_model_dir):
    s = Server(tiny_bpe_model_dir, "--sinks", "2", "--window", str(WINDOW), "--max-tokens", "8")
    yield s
    s.stop()


def body(name: str, **changes) -> dict:
    captured = json.loads((FIXTURES / f"{name}.json").read_text())
    return {**captured["body"], "model": "default", **changes}


def post(server, path: str, payload: dict, headers: dict | None = None):
    import urllib.request

    req = urllib.request.Request(
        server.url + path, data=json.dumps(payload).encode(), method="POST",
        headers={"content-type": "application/json", **(headers or {})},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, dict(r.headers), r.read().decode()


def sse(text: str) -> list[tuple[str, dict]]:
    """``(event, data)`` of each server-sent event (``data`` only: its ``type``)."""
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields and fields["data"] != "[DONE]":
            data = json.loads(fields["data"])
            out.append((fields.get("event", data.get("type")), data))
    return out


def count_tokens(server, payload: dict) -> int:
    keys = ("model", "messages", "system", "tools")
    done = http("POST", server.url + "/v1/messages/count_tokens",
                json.dumps({k: payload[k] for k in keys if k in payload}).encode())  # fmt: skip
    assert done.status_code == 200, done.text
    return done.json()["input_tokens"]


@pytest.mark.parametrize("name", CLAUDE)
def test_claude_codes_requests_stream_their_events_in_order(server, name):
    payload = body(name, max_tokens=8)
    status, _, text = post(server, "/v1/messages?beta=true", payload,
                           {"anthropic-beta": "mid-conversation-system-2026-04-07"})  # fmt: skip
    assert status == 200
    raw = [k for k, _ in sse(text)]
    if name == "claude_code_first":  # the long prompt going in keeps the stream alive
        assert raw.index("ping") == 1, raw[:4]
        assert http("HEAD", server.url + "/").status_code == 200  # its connectivity check
    kinds = [k for k in raw if k != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = kinds[1:-2]
    assert blocks and blocks[0] == "content_block_start"
    starts, stops = blocks.count("content_block_start"), blocks.count("content_block_stop")
    assert starts == stops >= 1 and "error" not in kinds
    (delta,) = [d for k, d in sse(text) if k == "message_delta"]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


def test_claude_codes_first_request_is_fed_whole(server):
    """Its ~19k-token prompt (here in the tiny tokenizer's tokens) goes in whole through
    a 512-token window: instructions and tools are never dropped."""
    payload = body("claude_code_first", max_tokens=4, stream=False)
    status, _, text = post(server, "/v1/messages", payload, {"X-Session-ID": "cc-whole"})
    assert status == 200
    usage = json.loads(text)["usage"]
    fed = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert fed > 10 * WINDOW
    assert abs(fed - count_tokens(server, payload)) <= 4  # the whole rendered prompt


@pytest.mark.parametrize("name", CODEX)
def test_codexs_requests_stream_their_events_in_order(server, name):
    status, _, text = post(server, "/v1/responses", body(name))
    assert status == 200
    events = sse(text)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "error" not in kinds
    numbers = [d["sequence_number"] for _, d in events]
    assert numbers == list(range(len(numbers)))
    final = events[-1][1]["response"]
    assert final["output"] and final["usage"]["input_tokens"] > 10 * WINDOW
    added = [d["item"]["type"] for k, d in events if k == "response.output_item.added"]
    done = [d["item"]["type"] for k, d in events if k == "response.output_item.done"]
    assert added == done == [item["type"] for item in final["output"]]


def test_hosted_tools_are_left_out_and_said_in_the_log(server):
    status, _, text = post(server, "/v1/responses", body("codex_first", stream=False))
    assert status == 200 and json.loads(text)["status"] in ("completed", "incomplete")
    assert "web_search" in server.log()


def test_a_system_message_after_the_last_turn_joins_it(server):
    """Claude Code's mid-conversation system message follows the user's: one turn,
    kept in the transcript, so the follow-up that echoes it continues the session."""
    none = {"type": "none"}  # a reply of text alone, echoed back as it came
    first = body("claude_code_first", max_tokens=4, stream=False, tool_choice=none)
    status, headers, text = post(server, "/v1/messages", first, {"X-Session-ID": "cc-turns"})
    assert status == 200
    reply = json.loads(text)
    echoed = [b for b in reply["content"] if b["type"] == "text"] or [{"type": "text", "text": ""}]
    follow = {**first, "messages": [*first["messages"], {"role": "assistant", "content": echoed},
                                    {"role": "user", "content": "and now?"}]}  # fmt: skip
    status, _, text = post(server, "/v1/messages", follow, {"X-Session-ID": "cc-turns"})
    usage = json.loads(text)["usage"]
    assert status == 200 and usage["cache_read_input_tokens"] > 10 * WINDOW
    assert usage["input_tokens"] < 64  # only the new message went in


def test_claude_codes_per_run_billing_line_is_not_part_of_the_prompt():
    """Each `claude -p` run sends a different `x-anthropic-billing-header` system block;
    kept, it would make every run's system prompt new and its prefill paid again."""
    from mlx_stream.serve.anthropic import MessagesRequest, to_engine

    payload = body("claude_code_first")
    other = json.loads(json.dumps(payload))
    other["system"][0]["text"] = other["system"][0]["text"].replace("2.1.197.fbe", "2.1.197.3c1")
    assert other != payload
    systems = [to_engine(MessagesRequest(**p))["messages"][0] for p in (payload, other)]
    assert systems[0] == systems[1] and systems[0]["role"] == "system"
    assert "billing" not in systems[0]["content"]
    assert systems[0]["content"].startswith("You are a Claude agent")


def test_claude_codes_note_after_the_question_goes_before_it():
    """Claude Code sends its agent list as a system message after the user's question;
    the question must stay the last text before the reply (the default model went on
    listing agents otherwise), and the order must not depend on later turns, so a
    follow-up request still extends the same transcript."""
    from mlx_stream.serve.anthropic import MessagesRequest, to_engine

    payload = body("claude_code_plain")
    assert [m["role"] for m in payload["messages"]][-2:] == ["user", "system"]
    first = to_engine(MessagesRequest(**payload))["messages"]
    assert [m["role"] for m in first] == ["system", "system", "user"]
    assert first[-1]["content"].endswith("what is 2+2?")
    assert first[1]["content"].startswith("Available agent types")
    later = {**payload, "messages": [*payload["messages"], {"role": "assistant", "content": "4"},
                                     {"role": "user", "content": "and 3+3?"}]}  # fmt: skip
    second = to_engine(MessagesRequest(**later))["messages"]
    assert second[: len(first)] == first
    assert [m["role"] for m in second[len(first) :]] == ["assistant", "user"]
    only = to_engine(MessagesRequest(model="m", max_tokens=8, messages=[
        {"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}]))  # fmt: skip
    assert [m["role"] for m in only["messages"]] == ["user", "system"]  # no system prompt made
