"""Stream-run checkpoints (issue 13): they know what they belong to, prove their arrays
intact, are saved on a cadence and when a run is stopped, and leave nothing behind."""

import os
import subprocess
import sys

import pytest

from mlx_stream import checkpoint as ckpt
from mlx_stream.errors import UserError
from mlx_stream.eval.perplexity import stream_perplexity
from mlx_stream.files import file_mode, remove_stale
from tests import tiny

SINKS, WINDOW = 4, 32
TOKENS = tiny.random_tokens(400, seed=1)
OTHER = tiny.random_tokens(400, seed=2)
IDENTITY = {"model": "tiny", "sinks": SINKS, "window": WINDOW, "positions": "cache"}


def run(model, tokens, path, **kwargs):
    kwargs = {"segment": 100, "checkpoint": path, "identity": IDENTITY, **kwargs}
    return stream_perplexity(model, tokens, SINKS, WINDOW, **kwargs)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_resume_refuses_another_text(tiny_llama, tmp_path):
    path = tmp_path / "c.safetensors"
    run(tiny_llama, TOKENS, path, limit_tokens=150)
    with pytest.raises(UserError, match="made from another text"):
        run(tiny_llama, OTHER, path, resume=True)
    # The same text resumes, and a text shorter than what was consumed is another text.
    assert run(tiny_llama, TOKENS, path, resume=True).tokens == len(TOKENS) - 1
    with pytest.raises(UserError, match="another text"):
        run(tiny_llama, TOKENS[:100], path, resume=True)


@pytest.mark.parametrize(
    "field, value",
    [("positions", "absolute"), ("kv-bits", 4), ("model", "other"), ("window", 64)],
)
def test_resume_refuses_other_settings_naming_the_field(tiny_llama, tmp_path, field, value):
    path = tmp_path / "c.safetensors"
    run(tiny_llama, TOKENS, path, limit_tokens=150)
    with pytest.raises(UserError, match=f"made with {field} .*this run has {field} {value}"):
        run(tiny_llama, TOKENS, path, resume=True, identity={**IDENTITY, field: value})
    with pytest.raises(UserError, match="segment 100, this run has segment 50"):
        run(tiny_llama, TOKENS, path, resume=True, segment=50)


def test_corrupted_arrays_fail_their_checksum(tiny_llama, tmp_path):
    path = tmp_path / "c.safetensors"
    run(tiny_llama, TOKENS, path, limit_tokens=150)
    data = bytearray(path.read_bytes())
    data[-200:-100] = b"\xff" * 100  # tensor data (NaN-like floats), header intact
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        run(tiny_llama, TOKENS, path, resume=True)


def test_checkpoints_follow_the_cadence(tiny_llama, tmp_path, monkeypatch):
    saved = []
    real = ckpt.save
    monkeypatch.setattr(ckpt, "save", lambda p, c, state, i: (saved.append(state["position"]), real(p, c, state, i)))  # fmt: skip
    run(tiny_llama, TOKENS, tmp_path / "c.safetensors", limit_tokens=350, checkpoint_every=100)
    # One save per crossed multiple of 100 (chunks are 64 tokens), and one at the end.
    assert len(saved) == 4 and saved[-1] == 350
    assert [p // 100 for p in saved[:3]] == [1, 2, 3]


def test_a_stopped_run_saves_and_resumes_exactly(tiny_llama, tmp_path):
    whole = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, segment=100)
    path = tmp_path / "c.safetensors"
    calls = []
    stopped = run(tiny_llama, TOKENS, path, should_stop=lambda: len(calls.append(0) or calls) > 3)
    assert stopped.interrupted and 100 < stopped.position < len(TOKENS)
    assert ckpt.read_metadata(path)["state"]["position"] == stopped.position
    rest = run(tiny_llama, TOKENS, path, resume=True)
    assert not rest.interrupted and rest.tokens == whole.tokens
    assert rest.nll == pytest.approx(whole.nll, abs=1e-4)


def test_a_failed_save_does_not_end_the_run(tiny_llama, tmp_path):
    missing = tmp_path / "gone" / "c.safetensors"  # its folder does not exist
    r = run(tiny_llama, TOKENS, missing, checkpoint_every=100)
    assert r.tokens == len(TOKENS) - 1
    assert r.checkpoint_error and "cannot save checkpoint" in r.checkpoint_error


def test_save_removes_a_killed_saves_leftover_and_follows_the_umask(tiny_llama, tmp_path):
    path = tmp_path / "c.safetensors"
    leftover = tmp_path / f".c.safetensors.partial-{dead_pid()}-.safetensors"
    leftover.write_bytes(b"half a checkpoint")
    old = os.umask(0o022)
    try:
        run(tiny_llama, TOKENS, path, limit_tokens=100)
        assert path.stat().st_mode & 0o777 == 0o644 == file_mode()
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


def test_remove_stale_keeps_live_processes_work(tmp_path):
    target = tmp_path / "m"
    dead = tmp_path / f".m.partial-{dead_pid()}-x"
    dead.mkdir()
    live = tmp_path / ".m.partial-1-x"  # pid 1 is always alive
    live.write_text("")
    unrelated = tmp_path / ".m.partial-notapid"
    unrelated.write_text("")
    assert remove_stale(target) == [dead]
    assert live.exists() and unrelated.exists()


def test_not_a_checkpoint(tmp_path):
    old_format = tmp_path / "old.safetensors"
    import mlx.core as mx

    mx.save_safetensors(str(old_format), {"a": mx.zeros(2)}, {"mlx_stream": "{}"})
    with pytest.raises(UserError, match="not a stream-run checkpoint"):
        ckpt.read_metadata(old_format)
    with pytest.raises(UserError, match="no such checkpoint"):
        ckpt.read_metadata(tmp_path / "none.safetensors")


# ----- chat /save: the written slots only, private files (issue 37, item 10) --------


def chat_session(loaded, **cache):
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.session import ChatSession, Settings

    model, tokenizer = loaded
    spec = CacheSpec(**{"sinks": 2, "window": 512, **cache})
    return ChatSession(model, tokenizer, Settings(spec, max_tokens=8))


def next_logits(session, token: int = 5):
    import copy

    import mlx.core as mx

    caches = copy.deepcopy(session.caches)
    return session.model(mx.array([[token]]), cache=caches)[0, -1]


@pytest.mark.parametrize(
    "cache, turns",
    [
        ({}, 1),  # 40-odd tokens in a 512 window: most of the buffer unwritten
        ({"window": 24}, 4),  # past the first eviction: every ring slot written
    ],
)
def test_save_writes_the_used_slots_and_load_continues_identically(loaded, tmp_path, cache, turns):
    import mlx.core as mx

    from mlx_stream.generate.session import cache_count

    said = ["hello", "the sea", "what ship", "a long voyage"]
    s = chat_session(loaded, **cache)
    for text in said[:turns]:
        s.reply(text, lambda t: None)
    cache_file, transcript = s.save(tmp_path / "talk")
    used = sum(c.nbytes for c in s.caches)
    written = cache_file.stat().st_size
    if not cache:
        seen = cache_count(s.caches)
        assert seen < 100 and written < used * 0.2  # ~seen / (sinks + window + slack)
    else:
        assert written < used + 8192  # the arrays and a header, nothing twice
    # Both files of a conversation are the user's own, whatever the umask.
    assert cache_file.stat().st_mode & 0o777 == 0o600 == transcript.stat().st_mode & 0o777
    assert sorted(p.name for p in tmp_path.iterdir()) == ["talk.json", "talk.safetensors"]

    back = chat_session(loaded, **cache)
    back.load(tmp_path / "talk")
    assert mx.array_equal(next_logits(back), next_logits(s))
    assert back.reply("and then", lambda t: None).text == s.reply("and then", lambda t: None).text
    assert mx.array_equal(next_logits(back), next_logits(s))


def test_a_checkpoint_saved_with_whole_buffers_still_loads(tiny_llama, tmp_path, monkeypatch):
    import mlx.core as mx

    from mlx_stream.cache.sink import SinkCache, make_sink_cache

    caches = make_sink_cache(tiny_llama, sinks=SINKS, window=256)
    tiny_llama(mx.array([TOKENS[:50]]), cache=caches)
    assert ckpt.checksum(caches) != ckpt.checksum(caches, used=False)  # 50 of 260 slots
    path = tmp_path / "c.safetensors"
    with monkeypatch.context() as m:  # as versions before saved: every slot
        m.setattr(SinkCache, "used_state", property(lambda c: list(c.state)))
        ckpt.save(path, caches, {"position": 50}, IDENTITY)
    assert ckpt.read_metadata(path)["checksum"] == ckpt.checksum(caches, used=False)
    back, _, _ = ckpt.load(path, tiny_llama)
    assert ckpt.checksum(back) == ckpt.checksum(caches)
    # and one saved now holds the written slots, its checksum theirs
    ckpt.save(path, caches, {"position": 50}, IDENTITY)
    assert ckpt.read_metadata(path)["checksum"] == ckpt.checksum(caches)
    assert {a.shape[-2] for a in mx.load(str(path)).values() if a.ndim == 4} == {50, SINKS}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fed", [40, 300])  # within the window; past its first eviction
def test_quantized_caches_save_their_used_slots_and_continue_identically(tmp_path, bits, fed):
    import mlx.core as mx

    from mlx_stream.cache.sink import load_cache, make_sink_cache, save_cache

    model = tiny.make_model("llama", num_attention_heads=2, num_key_value_heads=1, scale=1.0)
    caches = make_sink_cache(model, sinks=SINKS, window=256, kv_bits=bits, kv_group_size=32)
    tokens = tiny.random_tokens(fed + 8, seed=3)
    for i in range(0, fed, 20):  # in chunks a per-channel key cache takes
        model(mx.array([tokens[i : min(i + 20, fed)]]), cache=caches)
    save_cache(tmp_path / "q.safetensors", caches)
    back, _ = load_cache(tmp_path / "q.safetensors", model)
    for t in tokens[fed:]:  # token by token: the decode path, across a 64-token layout
        a = model(mx.array([[t]]), cache=caches)
        b = model(mx.array([[t]]), cache=back)
        assert mx.array_equal(a, b)
    # Per-channel keys are saved whole; the values only in their written slots.
    arrays = mx.load(str(tmp_path / "q.safetensors"))
    slots = {a.shape[-2] for k, a in arrays.items() if k.split(".")[1] == "1"}
    assert slots == ({fed} if fed == 40 else {caches[0].ring.capacity})
