"""``serve --recall``: every session keeps its own recall store (its own folder, removed
with the session), sessions decode alone, device bytes stay flat while the store grows
(``/v1/sessions``), admission counts region and store RAM, a regenerated turn rewinds the
tier, and a session whose save cannot carry its store is dropped and rebuilt, never a
crash. In-process engines on the tiny llama."""

from __future__ import annotations

import pytest

from mlx_stream.generate.session import Settings
from mlx_stream.serve.event_types import End, Failed, Started
from tests.support.cli import assert_one_line_error
from tests.support.engine import ask, on_worker

WORDS = ("the sea ship whale captain ahab sail water wind day night land man men old new "
         "long time way said like just so then now up down out over only very good great "
         "little paris france capital city").split()  # fmt: skip


def text(n: int, seed: int) -> str:
    """``n`` words of the tiny vocabulary, a different order per ``seed``."""
    return " ".join(WORDS[(i * (seed + 3) + seed) % len(WORDS)] for i in range(n))


def make_engine(loaded, state_dir, recall_dir=None, ram=0, blocks=2, **kw):  # noqa: F811
    from mlx_stream.cache import CacheSpec
    from mlx_stream.recall import RecallSpec
    from mlx_stream.serve.engine import Engine

    model, tokenizer = loaded
    spec = RecallSpec(blocks=blocks, ram_bytes=ram,
                      folder=None if recall_dir is None else str(recall_dir))  # fmt: skip
    settings = Settings(CacheSpec(sinks=2, window=64, recall=spec), max_tokens=12)
    e = Engine(model, tokenizer, settings, "tiny", state_dir=state_dir, **kw)
    e.start()
    return e


def sessions(engine) -> dict:
    on_worker(engine, engine.publish)
    return {s["id"]: s for s in engine.stats["sessions"]}


def chat(engine, sid, *turns):
    """Messages of ``turns`` (user texts), each answered in session ``sid``; the replies."""
    messages, replies = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        reply, _, err = ask(engine, messages, session_id=sid)
        assert err is None, err
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return messages, replies


def test_each_session_has_its_own_store_device_bytes_stay_flat_and_stats_show_both(
    loaded, tmp_path  # noqa: F811
):  # fmt: skip
    recall_dir = tmp_path / "recall"
    (recall_dir / "serve-0123abcd").mkdir(parents=True)  # left by a killed run
    e = make_engine(loaded, tmp_path / "state", recall_dir)
    try:
        assert not (recall_dir / "serve-0123abcd").exists()
        assert e.stats["batch"]["enabled"] is False and "--recall" in e.stats["batch"]["reason"]
        chat(e, "a", text(300, 1))
        chat(e, "b", text(300, 2))
        first = sessions(e)
        a, b = first["a"], first["b"]
        for s in (a, b):
            assert s["blocks_stored"] > 0 and s["region_bytes"] > 0
            assert s["store_disk_bytes"] > 0 and s["store_ram_bytes"] == 0  # --recall-ram 0
            assert s["device_bytes"] > s["region_bytes"]  # the caches + the region
            assert 0 < s["summary_bytes"] < s["store_disk_bytes"]  # the index: on disk too
            assert s["store_bytes"] == s["store_ram_bytes"] + s["store_disk_bytes"]
            use = s["recall"]  # stream-run --json's recall object
            assert use["ram_bytes"] == 0 and use["stored_blocks"] == s["blocks_stored"]
            assert use["index_bytes"] == s["summary_bytes"] and use["refresh_seconds"] >= 0
        folders = sorted(p.name for p in recall_dir.iterdir())
        assert len(folders) == 2 and all(f.startswith("serve-") for f in folders)
        # a longer stream (past a segment of 32 blocks): the store grows, the device
        # bytes do not
        chat(e, "a", text(300, 1), text(2200, 3))
        later = sessions(e)["a"]
        assert later["blocks_stored"] > a["blocks_stored"]
        assert later["store_bytes"] > a["store_bytes"]
        assert later["device_bytes"] == a["device_bytes"]
        memory = e.stats["memory"]
        total = sum(s["device_bytes"] for s in sessions(e).values())
        assert memory["device_bytes"] == total
        assert memory["store_disk_bytes"] == later["store_disk_bytes"] + b["store_disk_bytes"]
        assert memory["recall"]["blocks"] == 2
        # the routes show them per session and in total (the caller's sessions)
        from fastapi.testclient import TestClient

        from mlx_stream.serve.app import create_app

        with TestClient(create_app(e)) as client:
            body = client.get("/v1/sessions").json()
        assert {s["id"] for s in body["data"]} == {"a", "b"}
        assert body["totals"]["store_bytes"] == sum(s["store_bytes"] for s in body["data"]) > 0
        assert body["totals"]["device_bytes"] == total
    finally:
        e.stop()
    assert list(recall_dir.iterdir()) == []  # every session's folder went with it


def test_admission_counts_region_and_store_ram_once_per_session(loaded, tmp_path):  # noqa: F811
    from mlx_stream.cache.estimate import model_layout, recall_bytes

    model, _ = loaded
    e = make_engine(loaded, tmp_path / "state", ram=3_000_000)
    try:
        measured = on_worker(e, lambda: e.measure_cache(2))
        region = recall_bytes(model_layout(model), 2, 2)["region_bytes"]
        assert e.session_bytes(2) == 2 * measured + region + 3_000_000
        assert e.admission.single_bytes(2) == measured + region + 3_000_000
    finally:
        e.stop()
    from mlx_stream.errors import UserError

    with pytest.raises(UserError, match="--recall-ram"):
        make_engine(loaded, tmp_path / "state2", ram=10**9, budget=e.weights + 10**8)


def test_a_regenerated_turn_rewinds_the_recall_tier(loaded, tmp_path):  # noqa: F811
    """A session that answered a turn, then regenerates it with another question,
    answers as a session that never saw the first version (and its tier's blocks and
    selection are the same)."""
    e = make_engine(loaded, tmp_path / "state")
    try:
        first, second, other = text(300, 1), text(200, 4), text(200, 5)
        messages, _ = chat(e, "a", first, second)
        edited = messages[:2] + [{"role": "user", "content": other}]
        again, _, err = ask(e, edited, session_id="a")
        assert err is None
        _, replies = chat(e, "b", first, other)
        assert again == replies[1]
        tiers = {k: e.entries[("", k)].session.caches[0].hooks for k in ("a", "b")}
        assert tiers["a"] is not tiers["b"]
        assert tiers["a"].stored == tiers["b"].stored > 0
        assert tiers["a"].selection == tiers["b"].selection
        # and the next turn goes on alike
        extra = text(150, 6)
        after_a, _, _ = ask(e, [*edited, {"role": "assistant", "content": again},
                                {"role": "user", "content": extra}], session_id="a")  # fmt: skip
        _, replies_b = chat(e, "b", first, other, extra)
        assert after_a == replies_b[2]
    finally:
        e.stop()


def test_an_unsaveable_recall_session_is_dropped_then_rebuilt_from_the_history(
    loaded, tmp_path, monkeypatch  # noqa: F811
):  # fmt: skip
    """Room for a new session while the idle one cannot be saved (a save that does
    not carry the recall store): its caches and store go, no error reaches anyone,
    and its next request is answered from the client's history."""
    from mlx_stream.errors import UserError
    from mlx_stream.generate.session import ChatSession

    def refuse(self, path):
        raise UserError("/save does not carry the recall store yet")

    monkeypatch.setattr(ChatSession, "save", refuse)
    recall_dir = tmp_path / "recall"
    e = make_engine(loaded, tmp_path / "state", recall_dir, max_sessions=1)
    try:
        messages, _ = chat(e, "a", text(300, 1))
        chat(e, "b", text(300, 2))  # needs a's room
        assert e.dropped == 1 and e.evictions == 0
        assert set(sessions(e)) == {"a", "b"} and not sessions(e)["a"]["resident"]
        assert len(list(recall_dir.iterdir())) == 1  # a's folder is gone
        reply, _, err = ask(e, [*messages, {"role": "user", "content": text(50, 3)}],
                            session_id="a")  # fmt: skip
        assert err is None and reply is not None
        assert sessions(e)["a"]["resident"] and e.dropped == 2  # b made room in turn
    finally:
        e.stop()  # the drain cannot save them: one line each, no crash


def test_an_evicted_recall_session_continues_from_the_state_folder(loaded, tmp_path):  # noqa: F811
    """An evicted session's store goes to the state folder with it and comes back:
    it answers as a session that was never evicted."""
    e = make_engine(loaded, tmp_path / "state", tmp_path / "recall", max_sessions=1)
    try:
        first, second = text(300, 1), text(200, 4)
        messages, _ = chat(e, "a", first)
        chat(e, "b", text(300, 2))  # evicts a
        assert e.evictions == 1
        messages.append({"role": "user", "content": second})
        resumed, _, err = ask(e, messages, session_id="a")
        assert err is None and e.restores == 1
        tier = e.entries[("", "a")].session.caches[0].hooks
        blocks, selection = tier.stored, tier.selection
    finally:
        e.stop()
    plain = make_engine(loaded, tmp_path / "state2")
    try:
        _, replies = chat(plain, "a", first, second)
        tier = plain.entries[("", "a")].session.caches[0].hooks
        assert resumed == replies[1]
        assert (blocks, selection) == (tier.stored, tier.selection)
    finally:
        plain.stop()


def test_serve_recall_bad_settings_are_one_line(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    base = ["serve", "-m", str(tiny_model_dir), "--recall"]
    assert_one_line_error(runner.invoke(app, [*base, "--recall-blocks", "0"]), 2,
                          "--recall-blocks")  # fmt: skip
    assert_one_line_error(runner.invoke(app, [*base, "--recall-bits", "3"]), 2, "--recall-bits")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = runner.invoke(app, [*base, "--recall-dir", str(blocker / "store")])
    assert_one_line_error(result, 2, "cannot write the recall store")


def test_a_plain_completion_on_a_recall_server_has_its_own_store_gone_at_its_end(
    loaded, tmp_path  # noqa: F811
):  # fmt: skip
    import queue

    from mlx_stream.serve.engine import Request

    recall_dir = tmp_path / "recall"
    e = make_engine(loaded, tmp_path / "state", recall_dir)
    try:
        box: queue.Queue = queue.Queue()
        e.submit(Request(emit=box.put, prompt=text(300, 7), max_tokens=4))
        while not isinstance(event := box.get(timeout=120), (End, Failed)):
            pass
        assert isinstance(event, End), event
        assert list(recall_dir.iterdir()) == []  # the completion's store went with it
        assert sessions(e) == {}
    finally:
        e.stop()


def test_serve_recall_flags_reach_the_server(tiny_model_dir, tmp_path):
    """A real ``mlx-stream serve --recall``: the banner names recall, sessions are not
    batched, ``/v1/sessions`` shows the store apart from the device bytes, and the
    per-session folder under --recall-dir goes at exit."""
    from tests.support.server import Server, conversation

    recall_dir = tmp_path / "recall"
    server = Server(tiny_model_dir, "--sinks", "2", "--window", "64", "--max-tokens", "8",
                    "--recall", "--recall-blocks", "2", "--recall-ram", "0",
                    "--recall-dir", str(recall_dir))  # fmt: skip
    try:
        reply = server.client.chat.completions.create(
            model="tiny-llama", messages=conversation(text(300, 1), system=None)
        )
        assert reply.choices[0].message.content is not None
        body = server.get("/v1/sessions")
        (s,) = body["data"]
        assert s["blocks_stored"] > 0 and s["store_disk_bytes"] > 0 and s["region_bytes"] > 0
        assert body["totals"]["store_bytes"] == s["store_bytes"]
        assert body["batch"]["enabled"] is False and "--recall" in body["batch"]["reason"]
        health = server.get("/health")
        assert health["recall"]["blocks"] == 2 and health["recall"]["ram_bytes_per_session"] == 0
        assert len(list(recall_dir.iterdir())) == 1
    finally:
        server.stop()
    assert "recall 2 blocks" in server.log()
    assert list(recall_dir.iterdir()) == []


def test_the_serve_recall_benchmark_runs(tiny_model_dir, tmp_path):
    """``benchmarks/serve_recall.py --quick`` on the tiny model: one line per turn and
    cache; the recall session's device bytes stay flat while its store grows."""
    import json
    import subprocess
    import sys

    from tests.support.paths import REPO

    out = tmp_path / "lines.jsonl"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_recall.py"), "--model",
                    str(tiny_model_dir), "--quick", "--out", str(out)], check=True,
                   capture_output=True, cwd=REPO)  # fmt: skip
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["cache"], r["turn"]) for r in lines] == [
        (c, t) for t in (1, 2, 3) for c in ("window", "recall")
    ]  # fmt: skip
    recall = [r for r in lines if r["cache"] == "recall"]
    assert recall[-1]["blocks_stored"] > recall[0]["blocks_stored"] > 0
    assert len({r["device_bytes"] for r in recall[1:]}) == 1  # flat once the region exists
    assert all(r["store_bytes"] == 0 for r in lines if r["cache"] == "window")
    assert "session_budget_bytes" in recall[-1]


def test_sessions_with_one_system_prompt_share_no_snapshot_and_answer_alike(
    loaded, tmp_path  # noqa: F811
):  # fmt: skip
    """The pinned system prompt is each recall session's own prefill (a shared copy
    would share its store): two sessions with it answer as each other."""
    e = make_engine(loaded, tmp_path / "state")
    try:
        system = {"role": "system", "content": "you are a captain of the sea"}
        replies = []
        for sid in ("a", "b"):
            reply, _, err = ask(e, [system, {"role": "user", "content": text(300, 1)}],
                                session_id=sid)  # fmt: skip
            assert err is None
            replies.append(reply)
        assert replies[0] == replies[1] and len(e.snapshots) == 0
        a, b = (e.entries[("", k)].session for k in ("a", "b"))
        assert a.sinks == b.sinks > 2  # the system prompt is the sinks
        assert a.caches[0].hooks is not b.caches[0].hooks
        assert a.caches[0].hooks.stored == b.caches[0].hooks.stored > 0
    finally:
        e.stop()


def test_a_turn_cancelled_mid_prefill_rewinds_the_recall_tier(loaded, tmp_path, monkeypatch):  # noqa: F811
    """A client that leaves while its long message goes in (blocks stored, selections
    refreshed meanwhile): the session goes back to before that turn, store and
    selections too, and its next turn answers as a session that never saw it."""
    import queue
    import time

    from mlx_stream.serve.engine import Request

    model = loaded[0]
    e = make_engine(loaded, tmp_path / "state")
    first, other = text(300, 1), text(200, 5)
    try:
        messages, _ = chat(e, "a", first)
        tier = e.entries[("", "a")].session.caches[0].hooks
        before = (tier.stored, tier.selection)
        call, calls = type(model).__call__, []
        events: queue.Queue = queue.Queue()
        long = Request(emit=events.put, session_id="a",
                       messages=[*messages, {"role": "user", "content": text(3000, 2)}])  # fmt: skip

        def counting(self, inputs, *args, **kw):
            calls.append(int(inputs.size))
            if len(calls) == 12:  # well into the prompt: it stored and refreshed
                long.cancelled.set()
            return call(self, inputs, *args, **kw)

        monkeypatch.setattr(type(model), "__call__", counting)
        e.submit(long)
        deadline = time.monotonic() + 120
        while not (long.cancelled.is_set() and on_worker(e, lambda: not e.running)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert [type(ev) for ev in events.queue] == [Started]  # cut off before a token
        reply, _, err = ask(e, [*messages, {"role": "user", "content": other}], session_id="a")
        monkeypatch.setattr(type(model), "__call__", call)
        assert err is None and long.cancelled.is_set() and sum(calls[:12]) > 500
        _, replies = chat(e, "b", first, other)
        assert reply == replies[1]
        a, b = (e.entries[("", k)].session.caches[0].hooks for k in ("a", "b"))
        assert (a.stored, a.selection) == (b.stored, b.selection)
        assert before[0] > 0
    finally:
        e.stop()


def test_a_restart_with_recall_finds_no_session_saved_without_it(loaded, tmp_path):  # noqa: F811
    """Saved caches depend on the recall settings (the state folder's config names
    them): sessions saved without recall are not loaded into recall sessions."""
    from tests.support.engine import make_engine as plain_engine

    state = tmp_path / "state"
    e = plain_engine(loaded, state)
    try:
        ask(e, [{"role": "user", "content": text(40, 1)}], session_id="a")
    finally:
        e.stop()  # saves "a"
    again = plain_engine(loaded, state)
    try:
        assert ("", "a") in again.entries  # found by a run like the first
    finally:
        again.stop()
    recall = make_engine(loaded, state)
    try:
        assert recall.entries == {}
        assert recall.store_config()["recall"]["blocks"] == 2
    finally:
        recall.stop()
