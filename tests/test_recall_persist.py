"""The recall tier survives a save: ``save_cache``/``load_cache`` carry the store, the
summaries, the selections and the recent queries (``mlx_stream.recall.persist``).

The proof is equivalence: feed, save, load into a fresh cache, go on feeding, and the
logits and the selections are bit-identical to a run that never stopped (float, 4-bit
and all-on-disk stores). Plus: a changed, missing or foreign file is one line; other
recall settings are refused naming the setting; a failed save leaves the earlier one;
rollback works after a restore; a store that cannot grow fails before anything changes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_stream.cache import make_sink_cache, max_call_tokens
from mlx_stream.cache.sink import load_cache, save_cache
from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.recall import persist, tier_of
from mlx_stream.recall.store import SEGMENT, BlockStore, FileArray
from tests import tiny
from tests.support.paths import REPO
from tests.support.recall import BLOCK, SINKS, WINDOW, feed, full_disk, recall_cache, spec


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def head64():
    """A tiny llama whose head dimension (64) a quantized store's groups divide."""
    return tiny.make_model("llama", seed=3, hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1)  # fmt: skip


CASES = {
    "float-ram": ({}, 200, 100),
    "4bit": ({"bits": 4, "group_size": 32}, 200, 101),
    # past one segment of SEGMENT blocks, everything in memory-mapped files
    "all-spilled": ({"ram_bytes": 0}, BLOCK * SEGMENT + 120, BLOCK * SEGMENT + 37),
}


@pytest.mark.parametrize("case", list(CASES))
def test_save_load_continue_equals_an_uninterrupted_run(tiny_llama, head64, tmp_path, case):
    kw, total, cut = CASES[case]
    model = head64 if "bits" in kw else tiny_llama
    if "ram_bytes" in kw:
        kw = {**kw, "folder": str(tmp_path / "spill")}
    tokens = tiny.random_tokens(total, seed=7)
    whole = recall_cache(model, **kw)  # the same calls, no stop between them
    want = mx.concatenate([feed(model, whole, tokens[:cut]), feed(model, whole, tokens[cut:])])
    part = recall_cache(model, **kw)
    feed(model, part, tokens[:cut])
    save_cache(tmp_path / "c.safetensors", part)
    saved = tier_of(part)
    assert saved.stored > 4 and saved.selection  # a store and a selection to carry
    fresh, _ = load_cache(tmp_path / "c.safetensors", model, spec(**kw))
    restored = tier_of(fresh)
    assert restored is not saved and restored.store is not saved.store
    assert restored.history == saved.history and restored.first == saved.first
    assert restored.store.count == saved.store.count
    got = feed(model, fresh, tokens[cut:])
    assert mx.array_equal(got, want[cut:])  # bit-identical logits
    assert restored.history == tier_of(whole).history  # and the same selections
    assert len({h[1] for h in restored.history}) > 1  # which changed after the restore
    if "ram_bytes" in kw:  # the restored store is on disk again, not in memory
        assert restored.store.host_bytes == 0 and restored.store.disk_bytes > 0
        segs = restored.store.segments[0]
        assert len(segs) >= 2 and all(isinstance(p, FileArray) for p in segs[0][0])
        assert all(str(tmp_path / "spill") in str(p.filename) for p in segs[0][0])


def test_the_sidecar_lists_every_file_with_its_checksum(tiny_llama, tmp_path):
    cache = recall_cache(tiny_llama)
    feed(tiny_llama, cache, tiny.random_tokens(120, seed=3))
    old = os.umask(0o022)
    try:
        save_cache(tmp_path / "c.safetensors", cache)
    finally:
        os.umask(old)
    folder = tmp_path / "c.recall"
    assert folder.stat().st_mode & 0o777 == 0o755  # what the umask gives, not private
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in folder.iterdir())
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = {p.name for p in folder.iterdir()} - {"manifest.json"}
    assert on_disk == set(manifest["files"])
    assert manifest["spec"]["blocks"] == 4 and manifest["tier"]["history"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries


def saved_cache(model, tmp_path, tokens=120, **kw):
    cache = recall_cache(model, **kw)
    feed(model, cache, tiny.random_tokens(tokens, seed=5))
    path = tmp_path / "c.safetensors"
    save_cache(path, cache)
    return path, cache


def test_a_tier_is_never_dropped_when_recall_was_not_imported(tiny_llama, tmp_path):
    """A process that never imported mlx_stream.recall cannot restore a saved tier: the
    load refuses in one line instead of giving the caches without it."""
    path, _ = saved_cache(tiny_llama, tmp_path)
    code = (
        "import sys\n"
        "from mlx_stream.cache.sink import load_cache\n"
        "assert 'mlx_stream.recall' not in sys.modules\n"
        f"load_cache({str(path)!r})\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)  # fmt: skip
    assert run.returncode != 0
    assert "import mlx_stream.recall before loading it" in run.stderr.splitlines()[-1]


def test_a_changed_or_missing_file_is_one_line(tiny_llama, tmp_path):
    path, _ = saved_cache(tiny_llama, tmp_path)
    folder = tmp_path / "c.recall"
    victim = next(p for p in folder.iterdir() if p.name.startswith("store."))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch") as e:
        load_cache(path, tiny_llama, spec())
    assert victim.name in str(e.value) and "\n" not in str(e.value)
    victim.unlink()
    with pytest.raises(UserError, match="missing"):
        load_cache(path, tiny_llama, spec())
    (folder / "manifest.json").write_text("{}")
    with pytest.raises(UserError, match="does not belong to c.safetensors"):
        load_cache(path, tiny_llama, spec())
    shutil.rmtree(folder)
    with pytest.raises(UserError, match="missing; c.safetensors was saved with its recall"):
        load_cache(path, tiny_llama, spec())


def test_other_recall_settings_are_refused_naming_the_setting(tiny_llama, tmp_path):
    path, _ = saved_cache(tiny_llama, tmp_path)
    with pytest.raises(
        UserError, match="made with --recall-blocks 4, this run has --recall-blocks 6"
    ):
        load_cache(path, tiny_llama, spec(blocks=6))
    with pytest.raises(UserError, match="this run has no --recall"):
        load_cache(path, tiny_llama, None)
    # where the store lives and its RAM budget are the run's own
    cache, _ = load_cache(path, tiny_llama, spec(ram_bytes=0, folder=str(tmp_path / "elsewhere")))
    assert tier_of(cache).store.disk_bytes > 0 and any((tmp_path / "elsewhere").iterdir())
    plain = make_sink_cache(tiny_llama, SINKS, WINDOW, stride=BLOCK)
    save_cache(tmp_path / "plain.safetensors", plain)
    with pytest.raises(UserError, match="saved without a recall store"):
        load_cache(tmp_path / "plain.safetensors", tiny_llama, spec())


def test_a_failed_save_leaves_the_earlier_one(tiny_llama, tmp_path, monkeypatch):
    tokens = tiny.random_tokens(200, seed=9)
    cache = recall_cache(tiny_llama)
    feed(tiny_llama, cache, tokens[:100])
    path = tmp_path / "c.safetensors"
    save_cache(path, cache)
    history = tier_of(cache).history[:]
    feed(tiny_llama, cache, tokens[100:150])
    calls = []

    def fail_late(self, name, array):
        calls.append(name)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return real(self, name, array)

    real = persist.Writer.array
    monkeypatch.setattr(persist.Writer, "array", fail_late)
    with pytest.raises(OSError):
        save_cache(path, cache)
    monkeypatch.undo()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing half-written
    restored, _ = load_cache(path, tiny_llama, spec())
    assert tier_of(restored).history == history  # the earlier save, whole
    whole = recall_cache(tiny_llama)
    feed(tiny_llama, whole, tokens[:100])
    want = feed(tiny_llama, whole, tokens[100:])
    assert mx.array_equal(feed(tiny_llama, restored, tokens[100:]), want)


def test_a_save_killed_between_its_renames_loads_the_earlier_store(tiny_llama, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    tokens = tiny.random_tokens(160, seed=9)
    cache = recall_cache(tiny_llama)
    feed(tiny_llama, cache, tokens[:100])
    path = tmp_path / "c.safetensors"
    save_cache(path, cache)
    history = tier_of(cache).history[:]
    feed(tiny_llama, cache, tokens[100:140])
    staged = persist.stage(path, tier_of(cache))
    staged.commit()  # the new sidecar is in place, the cache file is still the old one
    restored, _ = load_cache(path, tiny_llama, spec())
    assert tier_of(restored).history == history
    (aside,) = tmp_path.glob(".c.recall.old-*")
    aside.rename(tmp_path / f".c.recall.old-{dead_pid()}-x")  # its process is gone

    def full(self, name, array):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist.Writer, "array", full)
    with pytest.raises(OSError):
        save_cache(path, cache)  # a save that fails keeps what the cache file names
    monkeypatch.undo()
    assert tier_of(load_cache(path, tiny_llama, spec())[0]).history == history
    save_cache(path, cache)  # the next save that succeeds clears what was left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.recall", "c.safetensors"]
    assert tier_of(load_cache(path, tiny_llama, spec())[0]).history == tier_of(cache).history


def test_rollback_after_a_restore(tiny_llama, tmp_path):
    tokens = tiny.random_tokens(150, seed=17)
    cache = recall_cache(tiny_llama)
    feed(tiny_llama, cache, tokens[:100], 1)
    path = tmp_path / "c.safetensors"
    save_cache(path, cache)
    restored, _ = load_cache(path, tiny_llama, spec())
    recall = tier_of(restored)
    state = (recall.history[:], recall.selection)
    feed(tiny_llama, restored, tokens[100:105], 1)  # crosses the boundary at 104
    assert recall.history != state[0]
    for c in restored:
        c.trim(5)
    assert (recall.history, recall.selection) == state
    got = feed(tiny_llama, restored, tokens[100:], 1)
    want = feed(tiny_llama, recall_cache(tiny_llama), tokens, 1)[100:]
    assert mx.array_equal(got.argmax(-1), want.argmax(-1))
    assert mx.abs(got - want).max().item() < 1e-4 * mx.abs(want).max().item()


def test_resaving_without_recall_drops_the_old_store(tiny_llama, tmp_path):
    path, _ = saved_cache(tiny_llama, tmp_path)
    save_cache(path, make_sink_cache(tiny_llama, SINKS, WINDOW, stride=BLOCK))
    assert not (tmp_path / "c.recall").exists()
    load_cache(path, tiny_llama, None)


# ----- a store that cannot grow --------------------------------------------------------


def test_a_full_disk_stops_before_the_call_changes_anything(tiny_llama, tmp_path, monkeypatch):
    """The store's file allocation fails at a call: a ``RuntimeFailure`` naming the
    folder, and the caches are as before that call (going on once there is room gives
    the uninterrupted run's logits)."""
    tokens = tiny.random_tokens(BLOCK * SEGMENT + 120, seed=31)
    folder = tmp_path / "spill"
    cache = recall_cache(tiny_llama, ram_bytes=0, folder=str(folder))
    opened = full_disk(monkeypatch, ".seg1.")  # the second segment finds the disk full
    got, i = [], 0
    with pytest.raises(RuntimeFailure) as e:
        while i < len(tokens):
            n = min(8, max_call_tokens(cache), len(tokens) - i)
            logits = model_call(tiny_llama, cache, tokens[i : i + n])
            got.append(logits)
            i += n
    assert str(e.value) == f"cannot write the recall store in {folder} (No space left on device)"
    assert opened and i < len(tokens)
    assert cache[0].tokens_seen == i  # the failed call stored nothing, fed nothing
    assert all(c.tokens_seen == i for c in cache)
    monkeypatch.undo()  # room again: the same call goes through
    got.append(feed(tiny_llama, cache, tokens[i:]))
    whole = recall_cache(tiny_llama, ram_bytes=0, folder=str(folder))  # the same calls
    want = mx.concatenate(
        [feed(tiny_llama, whole, tokens[:i]), feed(tiny_llama, whole, tokens[i:])]
    )
    assert mx.array_equal(mx.concatenate(got, axis=0), want)


def model_call(model, cache, tokens):
    logits = model(mx.array([tokens]), cache=cache)[0]
    mx.eval(logits)
    return logits


def test_spilled_files_are_allocated_on_the_disk(tmp_path):
    store = BlockStore(1, BLOCK, ram_bytes=0, folder=str(tmp_path))
    k = mx.ones((1, 2, BLOCK, 64))
    store.put(0, 0, k, k)
    files = list(tmp_path.glob("*.npy"))
    assert files and all(f.name.startswith(store.tag) for f in files)
    assert all(f.stat().st_blocks * 512 >= f.stat().st_size for f in files)  # not sparse


def test_two_stores_share_a_folder_without_clashing(tmp_path):
    a = BlockStore(1, BLOCK, ram_bytes=0, folder=str(tmp_path))
    b = BlockStore(1, BLOCK, ram_bytes=0, folder=str(tmp_path))
    one, two = mx.ones((1, 2, BLOCK, 64)), 2 * mx.ones((1, 2, BLOCK, 64))
    a.put(0, 0, one, one)
    b.put(0, 0, two, two)
    assert mx.array_equal(a.get(0, 0)[0], one) and mx.array_equal(b.get(0, 0)[0], two)


def test_a_quantized_window_with_recall_restores_bit_for_bit(head64, tmp_path):
    tokens = tiny.random_tokens(200, seed=41)

    def cache():
        return make_sink_cache(head64, SINKS, WINDOW, stride=BLOCK, kv_bits=8, recall=spec())

    whole = cache()
    want = mx.concatenate([feed(head64, whole, tokens[:90]), feed(head64, whole, tokens[90:])])
    part = cache()
    feed(head64, part, tokens[:90])
    save_cache(tmp_path / "c.safetensors", part)
    fresh, _ = load_cache(tmp_path / "c.safetensors", head64, spec())
    assert tier_of(fresh).selection and fresh[0].key_bits == 8
    assert mx.array_equal(feed(head64, fresh, tokens[90:]), want[90:])
    assert tier_of(fresh).history == tier_of(whole).history


def test_recall_with_4bit_keys_is_refused_before_the_first_token(head64):
    from mlx_stream.errors import Unsupported

    with pytest.raises(Unsupported, match="does not serve 4-bit keys"):
        make_sink_cache(head64, SINKS, WINDOW, stride=BLOCK, kv_bits=4, recall=spec())
    cache = make_sink_cache(head64, SINKS, WINDOW, stride=BLOCK, kv_bits=4, key_bits=8,
                            recall=spec())  # fmt: skip
    feed(head64, cache, tiny.random_tokens(80, seed=2))  # 8-bit keys, 4-bit values: served
    assert tier_of(cache).stored
