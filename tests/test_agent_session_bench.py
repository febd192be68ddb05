"""benchmarks/agent_session.py: the scripted agent session is what a coding agent
sends (every step resends the transcript, the prefix shifts are where the plan puts
them), and the harness replays it end to end against ``serve`` on the tiny model."""

from __future__ import annotations

import json

import pytest

from tests.support.bench import assert_finite, load_script


@pytest.fixture
def script(monkeypatch):
    import importlib

    load_script("common", monkeypatch)  # puts benchmarks/ on the path
    return importlib.import_module("agent_script")  # by name: its dataclasses need it


def test_the_session_has_every_kind_of_step_and_is_the_same_every_time(script):
    steps = script.plan()
    assert len(steps) >= 30
    kinds = {s.kind for s in steps}
    assert kinds == {"first", "append", "second", "cleared", "edit", "fork", "restart",
                     "fork-edit", "compaction"}  # fmt: skip
    again = script.plan()
    assert [json.dumps(s.body) for s in steps] == [json.dumps(s.body) for s in again]
    assert [s.restart for s in steps].count(True) == 1


def test_each_append_resends_the_whole_transcript_with_one_exchange_more(script):
    steps = [s for s in script.plan() if s.conversation == "A"]
    for before, step in zip(steps, steps[1:], strict=False):
        old, new = before.body["messages"], step.body["messages"]
        if step.kind in ("append", "restart"):
            strip = lambda ms: [  # noqa: E731 - the cache marker moves every step
                {**m, "content": [{k: v for k, v in b.items() if k != "cache_control"}
                                  for b in m["content"]]} if isinstance(m["content"], list) else m
                for m in ms
            ]  # fmt: skip
            assert strip(new[: len(old)]) == strip(old) and len(new) == len(old) + 2
            call, result = new[-2]["content"][1], new[-1]["content"][0]
            assert call["type"] == "tool_use" and result["tool_use_id"] == call["id"]
            assert "\t" in result["content"]  # cat -n numbering, as Read returns it
            assert new[-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
        elif step.kind == "cleared":
            assert script.CLEARED in json.dumps(new) and script.CLEARED not in json.dumps(old)
        elif step.kind == "compaction":
            assert len(new) < len(old) and "continued from a previous" in json.dumps(new[0])


def test_the_other_servers_get_the_same_text_on_the_chat_route(monkeypatch, script):
    bench = load_script("agent_session", monkeypatch)
    body = script.plan(steps=3)[-1].body
    chat = bench.openai_body(body, "m")
    assert chat["messages"][0]["role"] == "system"
    system = chat["messages"][0]["content"]
    assert "<tools>" in system and all(t["name"] in system for t in body["tools"])
    assert "<tool_call>" in chat["messages"][-2]["content"]
    assert "<tool_response>" in chat["messages"][-1]["content"]
    assert len(chat["messages"]) == len(body["messages"]) + 1


@pytest.mark.slow
def test_the_harness_replays_three_steps_on_serve(monkeypatch, tmp_path, tiny_bpe_model_dir):
    bench = load_script("agent_session", monkeypatch)
    out = tmp_path / "agent_session.jsonl"
    args = ["--quick", "--model", str(tiny_bpe_model_dir), "--servers", "mlx-stream",
            "--concurrent", "0", "--out", str(out)]  # fmt: skip
    records = bench.main(args)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == json.loads(json.dumps(records))
    session, summary = lines
    assert_finite({k: v for k, v in session.items() if k != "failed"})
    assert session["server"] == "mlx-stream" and session["ok"] == session["requests"] == 3
    rows = session["rows"]
    assert [r["kind"] for r in rows] == ["first", "append", "append"]
    assert all(r["status"] == 200 and r["ttft_s"] > 0 for r in rows)
    prompts = [r["prompt_tokens"] for r in rows]
    assert prompts == sorted(prompts) and prompts[0] > 0
    assert all(r["cached_tokens"] > 0 for r in rows[1:])  # the transcript so far was kept
    assert session["series"] and session["rss_mb_max"] > 0
    assert summary["summary"] is True


def test_codex_gets_the_same_conversation_on_the_responses_route(monkeypatch, script):
    """``--route responses``: the Anthropic step as Codex sends it (instructions, the
    messages, calls and their outputs as input items), with its usage read back."""
    bench = load_script("agent_session", monkeypatch)
    body = script.plan(steps=3)[-1].body
    sent = bench.responses_body(body, "m")
    assert sent["instructions"].startswith(body["system"][0]["text"][:40])
    kinds = [item["type"] for item in sent["input"]]
    assert kinds.count("function_call") == kinds.count("function_call_output") >= 2
    calls = [i for i in sent["input"] if i["type"] == "function_call"]
    outputs = [i for i in sent["input"] if i["type"] == "function_call_output"]
    assert [c["call_id"] for c in calls] == [o["call_id"] for o in outputs]
    assert sent["store"] is False and sent["stream"] is True
    assert {t["name"] for t in sent["tools"]} == {t["name"] for t in body["tools"]}
    row: dict = {}
    done = {"type": "response.completed", "response": {"usage": {
        "input_tokens": 90, "input_tokens_details": {"cached_tokens": 60}, "output_tokens": 4}}}  # fmt: skip
    bench.usage_fields(done, row)
    assert (row["prompt_tokens"], row["cached_tokens"], row["output_tokens"]) == (90, 60, 4)
    assert bench.has_text({"type": "response.output_text.delta", "delta": "a"})
    assert not bench.has_text({"type": "response.output_text.delta", "delta": ""})


@pytest.mark.slow
def test_the_harness_replays_three_steps_on_the_responses_route(
    monkeypatch, tmp_path, tiny_bpe_model_dir
):
    bench = load_script("agent_session", monkeypatch)
    out = tmp_path / "agent_session.jsonl"
    args = ["--quick", "--model", str(tiny_bpe_model_dir), "--servers", "mlx-stream",
            "--concurrent", "0", "--route", "responses", "--out", str(out)]  # fmt: skip
    session = bench.main(args)[0]
    rows = session["rows"]
    assert session["ok"] == session["requests"] == 3 and session["route"] == "responses"
    assert all(r["status"] == 200 and r["ttft_s"] > 0 for r in rows)
    assert all(r["cached_tokens"] > 0 for r in rows[1:])  # Codex's session-id header kept it
