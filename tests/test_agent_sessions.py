"""An agent's session on the engine of ``serve``: the client resends the transcript
with its own copy of each reply (re-serialized, or a recorded one replayed), so the
history differs from what the session generated at its last assistant message.

With the agent's session key (Claude Code's ``x-claude-code-session-id``, Codex's
``session-id``) that is repaired in place, not forked into a copy each step; once the
window has evicted (no repair), the session resumes from its checkpoint before the last
turn instead of a rebuild of the whole transcript."""

from __future__ import annotations

import queue

from mlx_stream.serve.event_types import Delta, End, Failed, Started
from tests.support.engine import make_engine

SYSTEM = {"role": "system", "content": "you are a coding agent; read files with the tool"}


def turn(engine, messages, **kw) -> dict:
    """One request to its end: the start info, usage and reply text."""
    from mlx_stream.serve.engine import Request

    box: queue.Queue = queue.Queue()
    engine.submit(Request(emit=box.put, messages=messages, max_tokens=4, temp=0.0, **kw))
    out = {"text": ""}
    while not isinstance(event := box.get(timeout=120), (End, Failed)):
        if isinstance(event, Started):
            out["start"] = event
        elif isinstance(event, Delta):
            out["text"] += event.text
    assert isinstance(event, End), event
    out["usage"] = event.usage
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
        ids = {r["start"].session_id for r in rows}
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
        assert len({r["start"].session_id for r in rows}) == 3 and sessions(e) == 3
    finally:
        e.stop()


def test_past_the_window_a_replaced_reply_resumes_from_the_last_prompt(loaded, tmp_path):
    """The window has evicted, so the edit cannot be repaired: the mark of the last
    turn's prompt encodes the history up to the reply, the rest goes in with the turn."""
    e = make_engine(loaded, tmp_path, settings={"window": 48}, repair_tokens=128)
    try:
        rows = replay(e, 4, agent="claude-session-2")
        for r in rows[2:]:
            assert "resumed from the last turn's prompt" in r["start"].note, r["start"]
            usage = r["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            # only the scripted reply and the new result are fed (a rebuild feeds the
            # whole transcript's tail again, the turn before its result too)
            fed = usage["prompt_tokens"] - cached
            new = len(e.tokenizer.encode(scripted(0)["content"] + result(1)["content"]))
            assert cached > 0 and fed <= new + 16, (usage, new)
    finally:
        e.stop()


# Another exchange in place of the last one (words the tiny tokenizer tells apart).
OTHER = [
    {"role": "assistant", "content": "Let me look at the tests instead."},
    {"role": "user", "content": "tests: assert the path is open and read"},
]


def sent_steps(engine, steps: int, agent: str) -> list[dict]:
    """``steps`` scripted steps of an agent's session; the messages of the last sent."""
    messages = [SYSTEM, result(0)]
    for i in range(steps):
        turn(engine, messages, agent=agent)
        sent = list(messages)
        messages += [scripted(i), result(i + 1)]
    return sent


def test_past_the_window_a_fork_of_the_last_exchange_resumes_two_prompts_back(
    loaded, tmp_path
):
    """The last exchange replaced by another (a fork): the mark of the prompt before
    it, two turns back, serves."""
    e = make_engine(loaded, tmp_path, settings={"window": 48}, repair_tokens=128)
    try:
        sent = sent_steps(e, 3, "claude-session-3")
        forked = sent[:-2] + OTHER  # the last exchange sent, replaced
        r = turn(e, forked, agent="claude-session-3")
        assert "resumed from the prompt 2 turns back" in r["start"].note, r["start"]
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        e.stop()


def test_an_edit_among_evicted_tokens_and_a_fork_resume_from_a_mark(loaded, tmp_path):
    """An agent prunes an old tool result (long evicted) and replaces its last
    exchange: the mark two turns back serves, the pruned text changing no KV (as a
    repair keeps such an edit); an edit the window still reads does not."""
    e = make_engine(loaded, tmp_path, settings={"window": 48}, repair_tokens=128)
    try:
        sent = sent_steps(e, 4, "claude-session-4")
        other = OTHER
        pruned = [SYSTEM, {"role": "user", "content": "[cleared]"}] + sent[2:-2] + other
        r = turn(e, pruned, agent="claude-session-4")
        assert "turns back" in r["start"].note, r["start"]
        assert "edited only where its window had evicted" in r["start"].note
        recent = pruned[:-3] + [{"role": "user", "content": "[cleared]"}] + other
        r = turn(e, recent, agent="claude-session-4")
        assert "resumed from" not in (r["start"].note or ""), r["start"]
    finally:
        e.stop()


def test_a_mark_serves_the_greedy_reply_of_a_rebuild(loaded, tmp_path):
    """Inside the window (nothing evicted, a rebuild is exact): a request served from a
    mark (repair off, so the resent reply is not repaired) replies as a fresh server
    given the whole request."""
    e = make_engine(loaded, tmp_path, settings={"window": 2048}, repair_tokens=0)
    fresh = make_engine(loaded, tmp_path / "fresh", settings={"window": 2048}, repair_tokens=0)
    try:
        messages = [SYSTEM, result(0)]
        for i in range(3):
            turn(e, messages, session_id="s")
            messages += [scripted(i), result(i + 1)]
        r = turn(e, messages, session_id="s")
        assert "resumed from the last turn's prompt" in r["start"].note, r["start"]
        assert r["text"] == turn(fresh, messages)["text"]
    finally:
        e.stop()
        fresh.stop()


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


def test_after_a_restart_an_agent_step_resumes_from_the_saved_mark(loaded, tmp_path):
    """drain + stop (SIGTERM) saves each session with its newest mark; the restarted
    server finds the agent's session on disk by its key and resumes the next step
    (its reply resent otherwise) from the mark: no rebuild of the transcript."""
    e = make_engine(loaded, tmp_path, settings={"window": 48}, repair_tokens=128)
    messages = [SYSTEM, result(0)]
    try:
        for i in range(3):
            turn(e, messages, agent="claude-session-5")
            messages += [scripted(i), result(i + 1)]
        e.drain()
    finally:
        e.stop()
    assert list(tmp_path.glob("*.mark.safetensors")), list(tmp_path.iterdir())
    again = make_engine(loaded, tmp_path, settings={"window": 48}, repair_tokens=128)
    try:
        r = turn(again, messages, agent="claude-session-5")
        assert "resumed from the last turn's prompt" in r["start"].note, r["start"]
        assert sessions(again) == 1
    finally:
        again.stop()


def test_an_edit_deep_in_a_session_resumes_from_its_base_on_disk(loaded, tmp_path):
    """Past the window, an agent truncates an early tool result the window has since
    overwritten and replaces its last exchange: no mark in memory holds it, but the
    base (the session's last whole mark, written to disk as the window first filled)
    is cut back to the tokens the request keeps: fewer fed than a rebuild, and the
    greedy reply of a fresh server given the whole request."""
    e = make_engine(loaded, tmp_path, settings={"window": 512}, repair_tokens=128)
    fresh = make_engine(loaded, tmp_path / "fresh", settings={"window": 512}, repair_tokens=128)
    try:
        sent = sent_steps(e, 14, "claude-session-6")
        assert list(tmp_path.glob("*.base.safetensors")), list(tmp_path.iterdir())
        edited = deep_edit(sent)
        r = turn(e, edited, agent="claude-session-6")
        assert "base on disk" in r["start"].note, r["start"]
        kept = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        rebuilt = turn(fresh, edited)
        assert kept > rebuilt["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r["text"] == rebuilt["text"]
    finally:
        e.stop()
        fresh.stop()


def deep_edit(sent: list[dict]) -> list[dict]:
    """``sent`` with an early tool result truncated (one the last marks' windows still
    read) and its last exchange replaced."""
    return [*sent[:7], {"role": "user", "content": "file 3: [truncated]"}, *sent[8:-2], *OTHER]


def test_a_damaged_base_is_a_rebuild_not_a_wrong_reply(loaded, tmp_path):
    e = make_engine(loaded, tmp_path, settings={"window": 512}, repair_tokens=128)
    fresh = make_engine(loaded, tmp_path / "fresh", settings={"window": 512}, repair_tokens=128)
    try:
        edited = deep_edit(sent_steps(e, 14, "claude-session-7"))
        (base,) = tmp_path.glob("*.base.safetensors")
        base.write_bytes(base.read_bytes()[:100])
        r = turn(e, edited, agent="claude-session-7")
        assert "rebuilt" in r["start"].note, r["start"]
        assert not list(tmp_path.glob("*.base.safetensors"))  # forgotten
        assert r["text"] == turn(fresh, edited)["text"]
    finally:
        e.stop()
        fresh.stop()


def test_the_base_outlives_a_restart(loaded, tmp_path):
    """SIGTERM saves the base with the session (checksummed in the index): after the
    restart the same deep edit resumes from it."""
    e = make_engine(loaded, tmp_path, settings={"window": 512}, repair_tokens=128)
    try:
        edited = deep_edit(sent_steps(e, 14, "claude-session-8"))
        e.drain()
    finally:
        e.stop()
    again = make_engine(loaded, tmp_path, settings={"window": 512}, repair_tokens=128)
    try:
        r = turn(again, edited, agent="claude-session-8")
        assert "base on disk" in r["start"].note, r["start"]
    finally:
        again.stop()


def test_a_system_prompt_computed_for_a_request_is_not_reported_cached(loaded, tmp_path):
    """The first session's system prompt is computed for its first request (usage: no
    cached tokens); a second session with the same prompt starts from its shared
    snapshot (cached)."""
    e = make_engine(loaded, tmp_path, settings={"window": 256})
    try:
        first = turn(e, [SYSTEM, result(0)])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        second = turn(e, [SYSTEM, result(1)])
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert sessions(e) == 2
    finally:
        e.stop()


def test_caches_that_cannot_be_cut_back_keep_no_base_and_rebuild_exactly(loaded, tmp_path):
    """4-bit keys quantized per channel cannot reopen an older group: no base is
    written, and the same deep edit is rebuilt (the fresh server's greedy reply)."""
    from tests import tiny

    wide = (tiny.make_model("llama", num_attention_heads=2, num_key_value_heads=1), loaded[1])
    quant = {"window": 512, "kv_bits": 4, "kv_group_size": 32}  # head dimension 32
    e = make_engine(wide, tmp_path, settings=quant, repair_tokens=128)
    fresh = make_engine(wide, tmp_path / "fresh", settings=quant, repair_tokens=128)
    try:
        edited = deep_edit(sent_steps(e, 14, "claude-session-9"))
        assert not list(tmp_path.glob("*.base.safetensors"))
        r = turn(e, edited, agent="claude-session-9")
        assert "base on disk" not in (r["start"].note or ""), r["start"]
        assert r["text"] == turn(fresh, edited)["text"]
    finally:
        e.stop()
        fresh.stop()


def test_a_base_whose_tokens_disagree_with_its_caches_is_not_used(loaded, tmp_path):
    """The base's token list is checked against the tokens its loaded caches record
    (a torn write could pair one file with the other's older self): a base said to
    hold the request itself is dropped, and the request is served exactly."""
    from mlx_stream.generate.repair import encode_like_rebuild
    from mlx_stream.generate.transcript import new_messages
    from mlx_stream.serve.matching import split_messages

    e = make_engine(loaded, tmp_path, settings={"window": 512}, repair_tokens=128)
    fresh = make_engine(loaded, tmp_path / "fresh", settings={"window": 512}, repair_tokens=128)
    try:
        edited = deep_edit(sent_steps(e, 14, "claude-session-10"))
        (entry,) = [x for x in e.entries.values() if x.marks.base]
        session = entry.session
        _, history, user = split_messages(edited)
        full = session.render(session.conversation(list(history) + new_messages(user)))
        entry.marks.base = encode_like_rebuild(session, full)  # what it does not hold
        r = turn(e, edited, agent="claude-session-10")
        assert "base on disk" not in (r["start"].note or ""), r["start"]
        assert not list(tmp_path.glob("*.base.safetensors"))  # forgotten
        assert r["text"] == turn(fresh, edited)["text"]
    finally:
        e.stop()
        fresh.stop()
