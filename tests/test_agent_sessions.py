"""An agent's session on the engine of ``serve``: the client resends the transcript
with its own copy of each reply (re-serialized, or a recorded one replayed), so the
history differs from what the session generated at its last assistant message.

With the agent's session key (Claude Code's ``x-claude-code-session-id``, Codex's
``session-id``) that is repaired in place, not forked into a copy each step; once the
window has evicted (no repair), the session resumes from its checkpoint before the last
turn instead of a rebuild of the whole transcript."""

from __future__ import annotations

import queue

from tests.support.engine import make_engine

SYSTEM = {"role": "system", "content": "you are a coding agent; read files with the tool"}


def turn(engine, messages, **kw) -> dict:
    """One request to its end: the start info, usage and reply text."""
    from mlx_stream.serve.engine import Request

    box: queue.Queue = queue.Queue()
    engine.submit(Request(emit=box.put, messages=messages, max_tokens=4, temp=0.0, **kw))
    out = {"text": ""}
    while (event := box.get(timeout=120))[0] not in ("end", "error"):
        if event[0] == "start":
            out["start"] = event[1]
        elif event[0] == "text":
            out["text"] += event[1]
    assert event[0] == "end", event
    out["usage"] = event[1]
    return out


def result(i: int) -> dict:
    return {"role": "user", "content": f"file {i}: " + "def read(path): return open(path) " * 3}


def scripted(i: int) -> dict:
    return {"role": "assistant", "content": f"I will read file {i + 1} next."}


def replay(engine, steps: int, **kw) -> list[dict]:
    """An agent session whose assistant turns are scripted (never the model's reply)."""
    messages, rows = [SYSTEM, result(0)], []
    for i in range(steps):
        rows.append(turn(engine, messages, **kw))
        messages += [scripted(i), result(i + 1)]
    return rows


def sessions(engine) -> int:
    return len([e for e in engine.entries.values() if not e.transient])


def test_an_agent_session_is_edited_in_place_not_forked_every_step(loaded, tmp_path):
    e = make_engine(loaded, tmp_path, settings={"window": 2048}, repair_tokens=128)
    try:
        rows = replay(e, 4, agent="claude-session-1")
        ids = {r["start"]["session_id"] for r in rows}
        assert len(ids) == 1 and sessions(e) == 1, ids
        for r in rows[1:]:  # the scripted reply is recomputed, the rest was kept
            assert r["usage"]["reused_tokens"] > 0
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        e.stop()


def test_without_an_agent_key_each_edit_forks_a_copy_as_before(loaded, tmp_path):
    e = make_engine(loaded, tmp_path, settings={"window": 2048}, repair_tokens=128)
    try:
        rows = replay(e, 3)
        assert len({r["start"]["session_id"] for r in rows}) == 3 and sessions(e) == 3
    finally:
        e.stop()


def test_past_the_window_a_replaced_reply_resumes_from_the_turn_before(loaded, tmp_path):
    """The window has evicted, so the edit cannot be repaired: the checkpoint before
    the last turn encodes the history up to it, the rest goes in with the turn."""
    e = make_engine(loaded, tmp_path, settings={"window": 48}, repair_tokens=128)
    try:
        rows = replay(e, 4, agent="claude-session-2")
        last = rows[-1]
        assert "resumed from the turn before" in last["start"].get("note", ""), last["start"]
        usage = last["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        fed = usage["prompt_tokens"] - cached
        # resumed: only the last turn's result, the scripted reply and the new result
        # are fed; a rebuild feeds the whole transcript's tail again
        assert cached > 0 and fed < usage["prompt_tokens"] // 2, usage
    finally:
        e.stop()


def test_a_resume_feeds_what_a_session_fed_turn_by_turn_feeds(loaded):
    """Exact: restoring the checkpoint before the last turn and extending its
    transcript feeds the same tokens, from the same state, as a session that was given
    that transcript one turn at a time (past the window's first eviction)."""
    import mlx.core as mx

    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.session import ChatSession, Settings

    model, tokenizer = loaded

    def fresh() -> ChatSession:
        settings = Settings(CacheSpec(sinks=2, window=48), max_tokens=4, temp=0.0)
        return ChatSession(model, tokenizer, settings, system=SYSTEM["content"])

    first = result(0)["content"]
    a, b = fresh(), fresh()
    a.reply(first, lambda t: None)
    b.reply(first, lambda t: None)
    assert a.messages == b.messages  # the same greedy reply
    point = a.checkpoint()
    a.reply([result(1)], lambda t: None)  # the turn the agent resends otherwise
    assert a.caches[0].tokens_seen > 2 + 48  # evicted: no repair could serve
    a.restore(point)
    a.messages = a.messages + [result(1), scripted(1)]
    new = [result(2)]
    tokens_a, _ = a.turn_tokens(new)
    tokens_b, _ = b.turn_tokens([result(1), scripted(1), *new])
    assert tokens_a == tokens_b
    logits_a = a.model(mx.array(tokens_a)[None], cache=a.caches)[0, -1]
    logits_b = b.model(mx.array(tokens_b)[None], cache=b.caches)[0, -1]
    assert mx.array_equal(logits_a, logits_b).item()
