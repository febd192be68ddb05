"""The prefix store on disk (mlx_stream.prefix_store): a restored prefix equals the
computed one bit for bit; entries are never read across models, dtypes or cache
policies; writers race and readers interleave without a torn or wrong state; corrupt
entries are dropped and recomputed; a store that cannot be written turns off with one
log line while the request is served; chat and serve share it across processes."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from mlx_stream import prefix_store as ps
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.generate.session import ChatSession, Settings
from tests import tiny
from tests.support.cli import assert_one_line_error
from tests.support.engine import ask_turn
from tests.support.paths import REPO

# A system prompt of ~120 tokens of the tiny vocabulary (over ps.MIN_TOKENS).
SYSTEM = " ".join(["the old captain said the sea was long and the whale was great"] * 9)


def make_session(model, tokenizer, store=None, window=96, sinks=4, **kw) -> ChatSession:
    settings = Settings(CacheSpec(sinks=sinks, window=window, **kw), max_tokens=10)
    return ChatSession(model, tokenizer, settings, system=SYSTEM, prefix_store=store)


def prefilled(model, tokenizer, store, **kw) -> ChatSession:
    """A session whose caches hold the rendered system prompt, via ``store``."""
    s = make_session(model, tokenizer, **kw)
    for _ in s.prefill_stored(s.system_text(), store):
        pass
    return s


def arrays(caches) -> list:
    from mlx.utils import tree_flatten

    return [v for c in caches for _, v in tree_flatten(list(c.state))]


def next_logits(session: ChatSession, text: str = "hello captain") -> mx.array:
    tokens = session.encode(text)
    logits = session.model(mx.array(tokens)[None], cache=session.caches)
    mx.eval(logits)
    return logits


def key_of(session: ChatSession) -> ps.PrefixKey:
    return session.prefix_key(session.system_text())


# ----------------------------------------------------------------- exactness


def test_a_restored_prefix_gives_the_same_logits_and_reply_bit_for_bit(loaded, tmp_path):
    model, tokenizer = loaded
    store = ps.PrefixStore(tmp_path / "store")
    computed = prefilled(model, tokenizer, store)  # a miss: prefilled, then put
    assert (store.hits, store.misses, store.writes) == (0, 1, 1)
    restored = prefilled(model, tokenizer, store)  # a hit
    assert (store.hits, store.writes) == (1, 1)
    plain = make_session(model, tokenizer)
    plain.prefill(plain.system_text())  # no store at all
    assert restored.fed_text == computed.fed_text == plain.fed_text
    for a, b in zip(arrays(restored.caches), arrays(plain.caches), strict=True):
        assert mx.array_equal(a, b).item()
    want = next_logits(plain)
    assert mx.array_equal(next_logits(restored), want).item()
    assert mx.array_equal(next_logits(computed), want).item()


def test_a_second_chat_session_starts_from_the_store_with_the_same_greedy_reply(loaded, tmp_path):
    model, tokenizer = loaded
    replies = []
    for _ in range(2):
        store = ps.PrefixStore(tmp_path / "store")
        s = make_session(model, tokenizer, store)
        replies.append((s.reply("hello captain", lambda t: None).text, store.hits))
        assert s.fed_text.startswith(s.system_text())
        assert s.reply("the sea", lambda t: None).tokens > 0  # the turn after goes on
    assert replies[0][1] == 0 and replies[1][1] == 1
    assert replies[0][0] == replies[1][0] and replies[0][0]
    s = make_session(model, tokenizer, ps.PrefixStore(tmp_path / "store"))
    s.reply("hello captain", lambda t: None)
    s.reset()  # a reset starts from the store again
    assert s.prefix_store.hits == 1
    assert s.reply("hello captain", lambda t: None).text == replies[0][0]
    assert s.prefix_store.hits == 2


def test_short_prefixes_drafts_and_recall_are_not_stored(loaded, tmp_path):
    model, tokenizer = loaded
    s = make_session(model, tokenizer)
    assert s.prefix_key("hello") is None  # under MIN_TOKENS
    s.draft_model = model
    assert s.prefix_key(s.system_text()) is None


# ----------------------------------------------------------------- identity


def test_an_entry_is_never_read_by_another_model_dtype_or_policy(loaded, tiny_model_dir, tmp_path):
    from mlx_stream.models.loader import load

    model, tokenizer = loaded
    store = ps.PrefixStore(tmp_path / "store")
    base = prefilled(model, tokenizer, store)
    assert store.writes == 1
    other_weights = tiny.make_model("llama", seed=1)
    half, _ = load(str(tiny_model_dir), dtype="float16")
    others = {
        "weights": make_session(other_weights, tokenizer),
        "dtype": make_session(half, tokenizer),
        "window": make_session(model, tokenizer, window=80),
        "sinks": make_session(model, tokenizer, sinks=8),
        "stride": make_session(model, tokenizer, stride=32),
        "positions": make_session(model, tokenizer, positions="absolute"),
    }
    base_key = key_of(base)
    for what, s in others.items():
        key = key_of(s)
        field = dict.fromkeys(("window", "sinks", "stride", "positions"), "cache")
        assert getattr(key, field.get(what, what)) != getattr(base_key, field.get(what, what))
        assert key.name != base_key.name, what
        assert store.lookup(key, s.model) is None, what
        # Even under the other key's file name, the entry is refused (its stored key
        # differs) and removed; the original stays.
        data = store.path(base_key).read_bytes()
        store.path(key).write_bytes(data)
        assert store.lookup(key, s.model) is None, what
        assert not store.path(key).exists(), what
    assert store.lookup(base_key, model) is not None
    assert store.rejected == len(others)


def test_a_bound_stores_digest_follows_the_weight_files(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, folder)
    first = ps.source_digest(folder)
    assert ps.source_digest(folder) == first  # stable
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(1, 1))
    assert ps.source_digest(folder) != first  # a replaced file is another model
    from mlx_stream.models.loader import load

    model, tokenizer = load(str(folder))
    store = ps.PrefixStore(tmp_path / "store").bind(folder)  # as chat and serve do
    assert store.weights == ps.source_digest(folder)
    assert key_of(make_session(model, tokenizer, store)).weights == store.weights
    assert key_of(make_session(model, tokenizer)).weights.startswith("content:")  # no store
    built = tiny.make_model("llama")
    assert ps.weights_digest(built).startswith("content:")
    assert ps.weights_digest(built) == ps.weights_digest(tiny.make_model("llama"))
    assert ps.weights_digest(built) != ps.weights_digest(tiny.make_model("llama", seed=1))


# ----------------------------------------------------------------- concurrency

RACER = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {repo!r})
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_stream import prefix_store as ps
    from tests.test_prefix_store import make_session
    from tests import tiny

    role, folder, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, tokenizer = tiny.make_model("llama"), tiny.make_tokenizer()
    s = make_session(model, tokenizer)
    head = s.system_text()
    s.prefill(head)
    want = [v for c in s.caches for _, v in tree_flatten(list(c.state))]
    key = s.prefix_key(head)
    store = ps.PrefixStore(folder)
    seen = {{"hits": 0, "wrong": 0, "writes": 0}}
    print("ready", flush=True)
    sys.stdin.readline()  # every process starts together
    end = time.monotonic() + rounds
    while time.monotonic() < end:
        if role == "writer":
            seen["writes"] += store.put(key, s.caches)
        got = store.lookup(key, model)
        if got is not None:
            seen["hits"] += 1
            have = [v for c in got for _, v in tree_flatten(list(c.state))]
            same = len(have) == len(want) and all(
                mx.array_equal(a, b).item() for a, b in zip(have, want))
            seen["wrong"] += not same
    seen["rejected"] = store.rejected
    print(json.dumps(seen), flush=True)
    """
)


def test_two_writer_processes_and_a_reader_race_without_a_torn_entry(tmp_path):
    script = tmp_path / "racer.py"
    script.write_text(RACER.format(repo=str(REPO)))
    folder = tmp_path / "store"
    env = {**os.environ, "MLX_STREAM_BLAS": "off"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), role, str(folder), "4"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for role in ("writer", "writer", "reader")
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    writers, reader = results[:2], results[2]
    assert all(w["writes"] >= 2 for w in writers), results  # they did race
    assert reader["hits"] >= 1, results
    assert all(r["wrong"] == 0 and r["rejected"] == 0 for r in results), results
    names = sorted(p.name for p in folder.iterdir())
    assert len(names) == 1 and not names[0].startswith("."), names  # no temporaries left


def test_a_reader_during_a_writers_delay_sees_nothing_then_the_whole_entry(
    loaded, tmp_path, monkeypatch
):
    """Delays injected between the write and the rename, and between a reader's look
    at the file and its read, never give a wrong state."""
    model, tokenizer = loaded
    store = ps.PrefixStore(tmp_path / "store")
    s = make_session(model, tokenizer)
    head = s.system_text()
    s.prefill(head)
    key = s.prefix_key(head)
    during = []
    real_replace = os.replace

    def delayed_replace(src, dst):  # the writer's temporary is complete, not renamed
        during.append((store.lookup(key, model), sorted(p.name for p in store.root.iterdir())))
        real_replace(src, dst)

    monkeypatch.setattr(ps.os, "replace", delayed_replace)
    assert store.put(key, s.caches)
    monkeypatch.setattr(ps.os, "replace", real_replace)
    assert during[0][0] is None  # nothing yet: a temporary is never read
    assert any(name.startswith(".") for name in during[0][1])
    assert store.lookup(key, model) is not None

    # A reader delayed after it found the entry, while a writer puts another prefix's
    # state (another policy) under the same name: refused, never used.
    other = make_session(model, tokenizer, window=80)
    other.prefill(head)
    other_key = other.prefix_key(head)
    store.put(other_key, other.caches)
    real_read = ps.PrefixStore.read

    def delayed_read(self, path, k, m):
        real_replace(self.path(other_key), path)  # swapped in during the delay
        return real_read(self, path, k, m)

    monkeypatch.setattr(ps.PrefixStore, "read", delayed_read)
    assert store.lookup(key, model) is None
    monkeypatch.setattr(ps.PrefixStore, "read", real_read)
    # It was replaced after the reader looked: the reader leaves it for the next one.
    assert store.path(key).exists()
    assert store.lookup(key, model) is None and not store.path(key).exists()


# ----------------------------------------------------------------- damage


@pytest.mark.parametrize("damage", ["truncate", "flip_array", "flip_header", "garbage", "empty"])
def test_a_corrupt_entry_is_ignored_removed_and_recomputed(loaded, tmp_path, damage):
    model, tokenizer = loaded
    store = ps.PrefixStore(tmp_path / "store")
    first = make_session(model, tokenizer, store)
    want = first.reply("hello captain", lambda t: None).text
    (path,) = [p for p in store.root.iterdir()]
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little") + 8
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip_array":
        data[header + (len(data) - header) // 2] ^= 0x40
    elif damage == "flip_header":  # a digit of the cache's counters
        at = data.index(b'tokens_seen\\": ') + len(b'tokens_seen\\": ')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    again = make_session(model, tokenizer, store)
    assert again.reply("hello captain", lambda t: None).text == want
    assert store.rejected == 1 and store.hits == 0
    assert store.writes == 2  # recomputed and put again
    assert ps.PrefixStore(store.root).lookup(key_of(again), model) is not None


# ----------------------------------------------------------------- full disk


def test_a_full_disk_turns_the_store_off_with_one_log_line(loaded, tmp_path, monkeypatch, caplog):
    model, tokenizer = loaded
    want = make_session(model, tokenizer).reply("hello captain", lambda t: None).text

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    import mlx_stream.cache.sink as sink

    monkeypatch.setattr(sink, "save_cache", full)
    store = ps.PrefixStore(tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="mlx_stream"):
        for _ in range(3):
            s = make_session(model, tokenizer, store)
            assert s.reply("hello captain", lambda t: None).text == want  # still served
            s.set_system(SYSTEM + " and the sea")
            s.reply("hello", lambda t: None)
    lines = [r.getMessage() for r in caplog.records if "prefix store" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "No space left on device" in lines[0] and str(store.root) in lines[0]
    assert not store.enabled and store.writes == 0
    assert list(store.root.iterdir()) == []  # no temporary left behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_store_folder_is_no_store(loaded, tmp_path, caplog):
    model, tokenizer = loaded
    folder = tmp_path / "store"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        store = ps.PrefixStore(folder)
        with caplog.at_level(logging.WARNING, logger="mlx_stream"):
            text = make_session(model, tokenizer, store).reply("hello", lambda t: None).text
        assert text and not store.enabled
        assert sum("prefix store" in r.getMessage() for r in caplog.records) == 1
    finally:
        folder.chmod(0o700)


# ----------------------------------------------------------------- bound


def test_least_recently_used_entries_go_first(loaded, tmp_path):
    model, tokenizer = loaded
    store = ps.PrefixStore(tmp_path / "store")
    sessions = [make_session(model, tokenizer, window=w) for w in (80, 88, 96)]
    keys = []
    for s in sessions:
        s.prefill(s.system_text())
        keys.append(key_of(s))
    assert store.put(keys[0], sessions[0].caches)
    size = store.size()
    store.max_bytes = int(size * 2.5)  # room for two entries
    assert store.put(keys[1], sessions[1].caches)
    os.utime(store.path(keys[0]), ns=(1, 1))
    os.utime(store.path(keys[1]), ns=(2, 2))
    assert store.lookup(keys[0], model) is not None  # now the most recently used
    assert store.put(keys[2], sessions[2].caches)
    assert store.path(keys[0]).exists() and store.path(keys[2]).exists()
    assert not store.path(keys[1]).exists()
    assert store.size() <= store.max_bytes
    store.max_bytes = size // 2  # an entry larger than the whole bound is not stored
    store.evict()
    assert store.size() == 0
    assert not store.put(keys[0], sessions[0].caches) and store.size() == 0


def test_a_killed_writers_temporary_is_removed(tmp_path):
    store = ps.PrefixStore(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    leftover = tmp_path / f".x.safetensors.partial-{dead}-abc.safetensors"
    mine = tmp_path / f".y.safetensors.partial-{os.getpid()}-abc.safetensors"
    leftover.write_bytes(b"x")
    mine.write_bytes(b"x")
    store.evict()
    assert not leftover.exists() and mine.exists()


# ----------------------------------------------------------------- serve


@pytest.mark.parametrize("window, pin", [(160, None), (48, 32)])
def test_a_restarted_server_takes_its_system_prompt_from_the_store(loaded, tmp_path, window, pin):
    """(160: the prompt is pinned whole and prefilled at admission; 48/32: longer than
    the pin, fed a chunk per round before the turn.)"""
    from mlx_stream.serve.engine import Engine

    model, tokenizer = loaded
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    replies, usages = [], []
    for run in range(2):
        store = ps.PrefixStore(tmp_path / "prefixes")
        settings = Settings(CacheSpec(sinks=4, window=window), max_tokens=8)
        e = Engine(model, tokenizer, settings, "tiny", state_dir=tmp_path / f"state{run}",
                   prefix_store=store, pin=pin)  # fmt: skip
        e.start()
        try:
            reply, usage = ask_turn(e, messages)
            replies.append(reply)
            usages.append(usage)
            stats = e.call(lambda e=e: (e.publish(), e.stats)[1]).result()
        finally:
            e.stop()
        assert stats["prefix_store"]["hits"] == run
        assert stats["prefix_store"]["writes"] == 1 - run
    assert replies[0] == replies[1] and replies[0]
    # read from the store, not computed: the restarted server reports them cached
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[1] >= len(tokenizer.encode(SYSTEM)), usages
    assert usages[0]["prompt_tokens"] == usages[1]["prompt_tokens"]


# ----------------------------------------------------------------- CLI


def run_chat(tiny_model_dir, *flags, lines="hello captain\n"):
    from typer.testing import CliRunner

    from cli.main import app

    return CliRunner().invoke(
        app, ["chat", "--model", str(tiny_model_dir), "--system", SYSTEM, "--temp", "0",
              "--max-tokens", "8", *flags], input=lines,
    )  # fmt: skip


def test_chat_flags_second_process_reads_the_store(tiny_model_dir, tmp_path):
    folder = tmp_path / "prefixes"
    first = run_chat(tiny_model_dir, "--prefix-store", str(folder))
    assert first.exit_code == 0, first.output
    entries = list(folder.glob("*.safetensors"))
    assert len(entries) == 1
    stamp = entries[0].stat().st_mtime_ns
    os.utime(entries[0], ns=(1, 1))
    second = run_chat(tiny_model_dir, "--prefix-store", str(folder), "--prefix-store-mb", "64")
    assert second.exit_code == 0, second.output
    assert second.stdout == first.stdout and first.stdout.strip()
    assert entries[0].stat().st_mtime_ns > 1  # read (and touched), not rewritten
    assert stamp > 0


def test_chat_uses_the_user_cache_by_default_and_nothing_when_off(tiny_model_dir, tmp_path):
    home = tmp_path / "home"  # MLX_STREAM_HOME (conftest)
    off = run_chat(tiny_model_dir, "--no-prefix-store")
    assert off.exit_code == 0, off.output
    assert not (home / ps.FOLDER).exists()
    on = run_chat(tiny_model_dir)
    assert on.exit_code == 0, on.output
    assert len(list((home / ps.FOLDER).glob("*.safetensors"))) == 1
    assert on.stdout == off.stdout


def test_bad_prefix_store_flags_are_one_line_errors(tiny_model_dir, tmp_path):
    result = run_chat(tiny_model_dir, "--prefix-store-mb", "0")
    assert_one_line_error(result, 2, "--prefix-store-mb")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    result = run_chat(tiny_model_dir, "--prefix-store", str(a_file))
    assert_one_line_error(result, 2, "--prefix-store", "not a folder")


def test_the_benchmark_runs_three_processes_on_the_tiny_model(
    tiny_model_dir, tmp_path, monkeypatch
):
    from tests.support.bench import run

    monkeypatch.setenv("MLX_STREAM_BLAS", "off")
    (line,) = run("prefix_store", monkeypatch, tmp_path, tiny_model_dir)
    assert line["bench"] == "prefix-store" and line["system_tokens"] >= ps.MIN_TOKENS
    assert line["identical"] is True
    assert line["ttft_first_s"] > 0 and line["ttft_second_s"] > 0 and line["store_bytes"] > 0
