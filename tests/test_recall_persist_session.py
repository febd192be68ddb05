"""A chat with recall survives ``/save`` and ``/load`` (ChatSession and the ``chat``
command), and the server's state folder keeps a recall session's store across
eviction and restart, its checksums included (``serve.store.SessionStore``)."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from cli.main import app
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.errors import UserError
from mlx_stream.generate.session import ChatSession, Settings
from mlx_stream.recall import RecallSpec, tier_of
from tests import tiny as tiny_mod

runner = CliRunner()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(tiny_mod.VOCAB_WORDS) for _ in range(n))


LONG = words(330, 1)  # several blocks of 64 leave the window of 24


def session(loaded, recall: RecallSpec | None, **kw) -> ChatSession:
    model, tokenizer = loaded
    settings = Settings(CacheSpec(sinks=2, window=24, recall=recall), max_tokens=8)
    return ChatSession(model, tokenizer, settings, **kw)


def recall(tmp_path, **kw) -> RecallSpec:
    return RecallSpec(**{"blocks": 2, "ram_bytes": 0, "folder": str(tmp_path / "store"), **kw})


def text(s: ChatSession, message: str) -> str:
    return s.reply(message, lambda t: None).text


def test_save_load_continues_like_the_uninterrupted_chat(loaded, tmp_path):
    whole = session(loaded, recall(tmp_path))
    text(whole, LONG)
    want = [text(whole, "what was said first"), text(whole, words(80, 2))]
    first = session(loaded, recall(tmp_path))
    text(first, LONG)
    tier = tier_of(first.caches)
    assert tier.stored >= 3 and tier.selection  # the reply used recalled blocks
    cache_path, _ = first.save(tmp_path / "talk")
    assert (tmp_path / "talk.recall" / "manifest.json").is_file()
    second = session(loaded, recall(tmp_path))
    assert second.load(tmp_path / "talk") == cache_path
    restored = tier_of(second.caches)
    assert restored.history == tier.history and restored.store.count == tier.store.count
    assert [text(second, "what was said first"), text(second, words(80, 2))] == want
    assert restored.history == tier_of(whole.caches).history


def test_load_with_other_recall_settings_is_one_line(loaded, tmp_path):
    first = session(loaded, recall(tmp_path))
    text(first, LONG)
    first.save(tmp_path / "talk")
    with pytest.raises(UserError, match="--recall-blocks 2, this run has --recall-blocks 3"):
        session(loaded, recall(tmp_path, blocks=3)).load(tmp_path / "talk")
    with pytest.raises(UserError, match="this run has no --recall"):
        session(loaded, None).load(tmp_path / "talk")
    plain = session(loaded, None)
    text(plain, "hello")
    plain.save(tmp_path / "plain")
    with pytest.raises(UserError, match="saved without a recall store"):
        session(loaded, recall(tmp_path)).load(tmp_path / "plain")


def test_chat_save_and_load_with_recall(tiny_model_dir, tmp_path):
    args = ["chat", "-m", str(tiny_model_dir), "--sinks", "2", "--window", "24",
            "--max-tokens", "6", "--temp", "0", "--recall", "--recall-blocks", "2"]  # fmt: skip
    talk = tmp_path / "talk"  # greedy (chat samples by default): the replies must be equal
    whole = runner.invoke(app, args, input=f"{LONG}\nwhat was said\n")
    first = runner.invoke(app, args, input=f"{LONG}\n/save {talk}\n")
    assert whole.exit_code == 0 and first.exit_code == 0, first.stderr
    assert (tmp_path / "talk.recall" / "manifest.json").is_file()
    second = runner.invoke(app, args, input=f"/load {talk}\nwhat was said\n")
    assert second.exit_code == 0, second.stderr
    lines = [ln for ln in second.stdout.splitlines() if ln.strip()]
    assert lines[-1] == [ln for ln in whole.stdout.splitlines() if ln.strip()][-1]
    other = runner.invoke(app, [*args[:-1], "3"], input=f"/load {talk}\n")
    assert other.exit_code == 0  # the chat goes on; the refusal is one line
    assert "recall-blocks 2, this run has --recall-blocks 3" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1 and "Traceback" not in other.stderr


# ----- the server's state folder ------------------------------------------------------


def entry_of(s: ChatSession, sid: str = "a"):
    from mlx_stream.serve.matching import Entry

    return Entry(id=sid, system=None, messages=s.messages, session=s, owner="o")


def test_the_state_folder_keeps_a_recall_store_across_a_restart(loaded, tmp_path):
    from mlx_stream.serve.store import SessionStore

    state, config = tmp_path / "state", lambda: {"model": "tiny"}
    s = session(loaded, recall(tmp_path))
    text(s, LONG)
    store = SessionStore(state, config)
    path, record = store.save(entry_of(s))
    manifest = path.name + ".recall/manifest.json"
    assert manifest in record["sha256"] and record["bytes"][manifest] > 0
    (state / "session-stray.recall").mkdir()  # no record names it: removed at the restart
    restarted = SessionStore(state, config)  # a new server on the same folder
    (found,) = restarted.load()
    assert not (state / "session-stray.recall").exists()
    restarted.check(found)  # the manifest is what was saved
    again = session(loaded, recall(tmp_path))
    again.load(found.path)
    assert tier_of(again.caches).history == tier_of(s.caches).history
    assert text(again, "what was said") == text(s, "what was said")
    # a changed store file is found when the session loads; a changed manifest by check
    folder = state / (path.name + ".recall")
    victim = next(folder.glob("store.*"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        session(loaded, recall(tmp_path)).load(found.path)
    (folder / "manifest.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(UserError, match="changed since it was saved"):
        restarted.check(found)
    restarted.forget(found)
    assert not folder.exists() and not list(state.glob("session-*"))


def test_the_server_evicts_a_recall_session_and_restores_it_after_a_restart(loaded, tmp_path):
    """Evicted to the state folder, the server killed, a new one on the folder: the
    next turn restores the recall store and answers as the session that stayed."""
    import queue

    from mlx_stream.serve.engine import Engine, Request
    from mlx_stream.serve.event_types import Delta, End, Failed

    def engine(state):
        cache = CacheSpec(sinks=2, window=24, recall=recall(tmp_path))
        e = Engine(loaded[0], loaded[1], Settings(cache, max_tokens=6), "tiny",
                   state_dir=state, keep_system=False)  # fmt: skip
        e.start()
        return e

    def ask(e, messages):
        box: queue.Queue = queue.Queue()
        e.submit(Request(emit=box.put, messages=messages, session_id="s"))
        parts = []
        while not isinstance(event := box.get(timeout=120), (End, Failed)):
            if isinstance(event, Delta):
                parts.append(event.text)
        assert isinstance(event, End), event
        return "".join(parts), event.usage

    first = [{"role": "user", "content": LONG}]
    a, stayed = engine(tmp_path / "a"), engine(tmp_path / "b")
    try:
        reply, _ = ask(a, first)
        assert ask(stayed, first)[0] == reply
        follow = [*first, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "what was said first"}]  # fmt: skip
        want, _ = ask(stayed, follow)
        a.call(lambda: a.evict(a.entries[("", "s")])).result(timeout=120)
        assert list((tmp_path / "a").glob("session-*.recall/manifest.json"))
        b = engine(tmp_path / "a")  # no a.stop(): as after a kill -9
        try:
            got, usage = ask(b, follow)
            assert b.restores == 1 and usage["prompt_tokens_details"]["cached_tokens"] > 0
            assert got == want
            tier = tier_of(b.entries[("", "s")].session.caches)
            assert tier is not None and tier.stored >= 3
        finally:
            b.stop()
    finally:
        a.stop()
        stayed.stop()
