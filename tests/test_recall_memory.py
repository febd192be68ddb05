"""The recall tier's host memory is bounded and counted: the block summaries (the index)
live inside ``ram_bytes`` with the blocks and spill to files past their share, scoring
reads spilled segments and chooses exactly what it chose from memory, the index is
saved and restored with the store (an index saved before it was segmented is
upgraded, an unknown version refused in one line), and ``Recall.usage`` adds up
(tiny models)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_stream.cache.sink import load_cache, save_cache
from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.recall import persist, select, tier_of
from mlx_stream.recall.store import SEGMENT, FileArray, Spill
from mlx_stream.recall.tier import Recall
from tests import tiny
from tests.support.recall import feed, recall_cache, spec

SMALL = 4  # blocks per index segment here: several segments within a few hundred tokens


@pytest.fixture
def small_segments(monkeypatch):
    monkeypatch.setattr(select, "INDEX_SEGMENT", SMALL)


@pytest.fixture(scope="module")
def bf16_llama():
    return tiny.make_model("llama", seed=5, dtype=mx.bfloat16)


def recorded(model, tokens, chunk=8, **kw):
    """Feed ``tokens``; the logits, the cache and ``(point, selection)`` of every refresh."""
    cache = recall_cache(model, **kw)
    tier, chosen = tier_of(cache), []
    refresh = tier.refresh

    def record(*args, **kwargs):
        refresh(*args, **kwargs)
        chosen.append((tier.refreshed_at, tier.selection))

    tier.refresh = record
    return feed(model, cache, tokens, chunk), cache, chosen


def check_usage(tier: Recall) -> dict:
    """``usage()`` adds up; returns it."""
    u, store, index = tier.usage(), tier.store, tier.summaries
    assert u["ram_bytes"] + u["disk_bytes"] == u["block_bytes"] + u["index_bytes"]
    assert u["block_bytes"] == sum(store.used()) and u["index_bytes"] == sum(index.used())
    assert u["reserved_bytes"] == u["ram_reserved_bytes"] + u["disk_reserved_bytes"]
    assert u["ram_bytes"] <= u["ram_reserved_bytes"] <= tier.spec.ram_bytes
    assert u["disk_bytes"] <= u["disk_reserved_bytes"]
    assert u["stored_blocks"] == tier.stored and 0 <= u["scored_blocks"] <= tier.stored
    if index.shape is not None:
        H, D, dtype = index.shape
        per_block = sum(H * D * (4 if k == "mean" else dtype.size) for k in index.kinds)
        assert u["index_bytes"] == per_block * sum(index.count)
    return u


# ----- the budget -------------------------------------------------------------------------


def test_the_index_counts_inside_the_ram_budget_and_spills_past_its_share(
    tiny_llama, tmp_path, small_segments
):  # fmt: skip
    tokens = tiny.random_tokens(400, seed=11)
    cache = recall_cache(tiny_llama)
    feed(tiny_llama, cache, tokens[:200])
    index = tier_of(cache).summaries
    assert index.kinds == ("lo", "hi")  # quest reads the extremes only, float32 here
    H, D, _ = index.shape
    seg = SMALL * H * D * 4  # one table's segment, one layer
    budget = 10 * seg  # index share: 2.5 segments; the blocks take the rest
    cache = recall_cache(tiny_llama, ram_bytes=budget, folder=str(tmp_path))
    tier = tier_of(cache)
    for i in range(0, len(tokens), 8):
        feed(tiny_llama, cache, tokens[i : i + 8])
        u = check_usage(tier)
        assert u["ram_reserved_bytes"] <= budget  # never more than --recall-ram
        assert tier.summaries.host_bytes <= budget * select.INDEX_SHARE
    assert tier.summaries.host_bytes == 2 * seg and tier.summaries.disk_bytes > 0
    assert u["ram_bytes"] == 2 * seg  # filled: the blocks have no room in 7.5 segments
    assert u["disk_bytes"] > u["block_bytes"]  # the rest of the index is on disk
    spilled = [a for a in tier.summaries.arrays() if isinstance(a, FileArray)]
    assert spilled and all(str(tmp_path) in a.filename for a in spilled)
    assert {p.name for p in tmp_path.iterdir()} >= {a.filename.rsplit("/", 1)[1] for a in spilled}
    tier.close(remove_files=True)
    assert not any(tmp_path.iterdir())  # the index's files go with the store's


def test_the_index_keeps_only_the_summaries_its_selectors_read(tiny_llama):
    with pytest.raises(ValueError, match="keeps no 'mean'"):
        tier_of(recall_cache(tiny_llama)).summaries.table("mean", 0, 1)


# ----- the same choices from disk -----------------------------------------------------------


@pytest.mark.parametrize("model_name", ["tiny_llama", "bf16_llama"])
def test_the_same_blocks_are_chosen_with_the_index_in_ram_and_on_disk(
    request, tmp_path, small_segments, model_name
):  # fmt: skip
    model = request.getfixturevalue(model_name)
    tokens = tiny.random_tokens(300, seed=13)
    ram_logits, ram, ram_chosen = recorded(model, tokens)
    disk_logits, disk, disk_chosen = recorded(model, tokens, ram_bytes=0, folder=str(tmp_path))
    index = tier_of(disk).summaries
    assert tier_of(ram).summaries.disk_bytes == 0 and index.host_bytes == 0
    assert len(index.segments["lo"][0]) > 3  # several spilled segments read per refresh
    assert all(isinstance(a, FileArray) for a in index.arrays())
    assert disk_chosen == ram_chosen and len({c for _, c in ram_chosen}) > 2
    assert mx.array_equal(disk_logits, ram_logits)


def test_the_extremes_kept_in_the_keys_dtype_are_the_float32_extremes(bf16_llama, tmp_path,
                                                                     small_segments):  # fmt: skip
    """Scores read what float32 tables of the stored keys would hold (what the index
    kept before it was compact): a bfloat16 key's min and max are bfloat16 values."""
    cache = recall_cache(bf16_llama, ram_bytes=0, folder=str(tmp_path))
    feed(bf16_llama, cache, tiny.random_tokens(200, seed=17))
    tier = tier_of(cache)
    index, n = tier.summaries, tier.stored
    assert index.shape[2] == mx.bfloat16 and n > 2 * SMALL
    per_block = sum(a.nbytes for a in [np.zeros(index.shape[:2], np.uint16)] * 2)
    assert tier.usage()["index_bytes"] == per_block * sum(index.count)  # 2 bytes a number
    for layer in range(len(tier.layers)):
        keys = [np.asarray(tier.store.get(layer, j)[0][0].astype(mx.float32)) for j in range(n)]
        valid = [k[:, tier.first[j] :, :] for j, k in enumerate(keys)]
        lo = np.stack([v.min(1) if v.shape[1] else np.zeros_like(v[:, 0]) for v in valid])
        hi = np.stack([v.max(1) if v.shape[1] else np.zeros_like(v[:, 0]) for v in valid])
        assert np.array_equal(index.table("lo", layer, n), lo)
        assert np.array_equal(index.table("hi", layer, n), hi)


# ----- saving, restoring, upgrading ---------------------------------------------------------


def test_a_spilled_index_is_saved_checked_and_restored_to_disk(tiny_llama, tmp_path,
                                                               small_segments):  # fmt: skip
    tokens = tiny.random_tokens(300, seed=19)
    kw = {"ram_bytes": 0, "folder": str(tmp_path / "spill")}
    want, _, chosen = recorded(tiny_llama, tokens, **kw)
    part = recall_cache(tiny_llama, **kw)
    feed(tiny_llama, part, tokens[:168])  # the uninterrupted run's calls: any BLAS
    path = tmp_path / "c.safetensors"
    save_cache(path, part)
    manifest = json.loads((tmp_path / "c.recall" / "manifest.json").read_text())
    assert manifest["version"] == persist.VERSION == 2
    names = [n for layer in manifest["tier"]["index"]["segments"]["lo"] for n in layer]
    assert len(names) > 3 and all(n in manifest["files"] for n in names)
    kw2 = {"ram_bytes": 0, "folder": str(tmp_path / "elsewhere")}
    fresh, _ = load_cache(path, tiny_llama, spec(**kw2))
    restored = tier_of(fresh)
    assert restored.summaries.count == tier_of(part).summaries.count
    assert restored.summaries.host_bytes == 0 and restored.summaries.disk_bytes > 0
    assert all(str(tmp_path / "elsewhere") in a.filename for a in restored.summaries.arrays())
    got = feed(tiny_llama, fresh, tokens[168:])
    assert mx.array_equal(got, want[168:])
    assert restored.history[-1][:2] == chosen[-1]
    # a changed index file is one line
    victim = tmp_path / "c.recall" / names[1]
    victim.write_bytes(victim.read_bytes()[:-4] + b"\0\0\0\1")
    with pytest.raises(UserError, match="checksum mismatch") as bad:
        load_cache(path, tiny_llama, spec(**kw2))
    assert names[1] in str(bad.value) and "\n" not in str(bad.value)


def legacy_export(real):
    """``Recall.export`` as it was before the index: whole float32 tables of every
    summary (rows grown past the blocks), ``count`` 0, no ``index``."""

    def export(self, writer):
        data = real(self, writer)
        del data["index"]
        for name in [n for n in writer.files if n.startswith("index.")]:
            del writer.files[name]
            (writer.folder / name).unlink()
        old = select.Summaries(len(self.layers))  # float32, in memory, every kind
        for i in range(len(self.layers)):
            for j in range(self.store.count[i]):
                keys = np.asarray(self.store.get(i, j)[0][0].astype(mx.float32))
                valid = keys[:, self.first[j] :, :]
                old.add(i, j, valid if valid.shape[1] else np.zeros_like(keys[:, :1]))
        tables = {}
        for kind in select.KINDS:
            tables[kind] = []
            for i in range(len(self.layers)):
                n = self.store.count[i]
                t = old.table(kind, i, n)
                grown = np.concatenate([t, np.zeros((max(16, 2 * n) - n, *t.shape[1:]), t.dtype)])
                tables[kind].append(writer.array(f"summary.{kind}.layer{i}.npy", grown))
        data["summaries"] = {**tables, "count": 0}
        return data

    return export


@pytest.mark.parametrize("model_name", ["tiny_llama", "bf16_llama"])
def test_a_store_saved_before_the_index_is_upgraded(request, tmp_path, monkeypatch, model_name):
    model = request.getfixturevalue(model_name)
    tokens = tiny.random_tokens(200, seed=23)
    want, _, chosen = recorded(model, tokens)
    part = recall_cache(model)
    feed(model, part, tokens[:120])
    path = tmp_path / "c.safetensors"
    with monkeypatch.context() as m:
        m.setattr(persist, "VERSION", 1)
        m.setattr(Recall, "export", legacy_export(Recall.export))
        save_cache(path, part)
    manifest = json.loads((tmp_path / "c.recall" / "manifest.json").read_text())
    assert manifest["version"] == 1 and "index" not in manifest["tier"]
    assert not [n for n in manifest["files"] if n.startswith("index.")]
    fresh, _ = load_cache(path, model, spec(ram_bytes=0, folder=str(tmp_path / "spill")))
    index = tier_of(fresh).summaries
    assert index.count == tier_of(part).summaries.count and index.disk_bytes > 0
    for layer in range(len(index.count)):
        for kind in index.kinds:
            have = tier_of(part).summaries.table(kind, layer, index.count[layer])
            assert np.array_equal(index.table(kind, layer, index.count[layer]), have)
    got = feed(model, fresh, tokens[120:])
    assert mx.array_equal(got, want[120:]) and tier_of(fresh).history[-1][:2] == chosen[-1]
    # and saved again, it is a store of this version
    save_cache(path, fresh)
    assert json.loads((tmp_path / "c.recall" / "manifest.json").read_text())["version"] == 2


def test_an_old_index_that_is_not_of_the_keys_dtype_is_refused_in_one_line(
    bf16_llama, tmp_path, monkeypatch
):  # fmt: skip
    part = recall_cache(bf16_llama)
    feed(bf16_llama, part, tiny.random_tokens(120, seed=29))
    path = tmp_path / "c.safetensors"
    real = legacy_export(Recall.export)

    def nudged(self, writer):  # a maximum that no bfloat16 key has
        data = real(self, writer)
        name = data["summaries"]["hi"][0]
        table = np.load(writer.folder / name)
        table[0, 0, 0] += np.float32(1e-3)
        writer.array(name, table)
        return data

    with monkeypatch.context() as m:
        m.setattr(persist, "VERSION", 1)
        m.setattr(Recall, "export", nudged)
        save_cache(path, part)
    with pytest.raises(UserError) as refused:
        load_cache(path, bf16_llama, spec())
    assert str(refused.value) == (f"{tmp_path / 'c.recall'}: its block summaries are not "
                                  "bfloat16 values; it cannot be read here")  # fmt: skip


def test_a_store_of_an_unknown_version_is_refused_in_one_line(tiny_llama, tmp_path, monkeypatch):
    part = recall_cache(tiny_llama)
    feed(tiny_llama, part, tiny.random_tokens(120, seed=31))
    with monkeypatch.context() as m:
        m.setattr(persist, "VERSION", 3)
        save_cache(tmp_path / "c.safetensors", part)
    with pytest.raises(UserError) as refused:
        load_cache(tmp_path / "c.safetensors", tiny_llama, spec())
    assert str(refused.value) == (f"{tmp_path / 'c.recall'}: a recall store of version 3; "
                                  "this version reads 1 and 2")  # fmt: skip


# ----- a full disk ------------------------------------------------------------------------


def test_an_index_that_cannot_grow_stops_before_the_call_changes_anything(
    tiny_llama, tmp_path, monkeypatch, small_segments
):  # fmt: skip
    tokens = tiny.random_tokens(200, seed=37)
    folder = tmp_path / "spill"
    cache = recall_cache(tiny_llama, ram_bytes=0, folder=str(folder))
    real = Spill.open_file

    def full(self, path, np_dtype, shape):
        if ".index." in path.name and ".seg2." in path.name:
            raise self.failure(OSError(28, "No space left on device"))
        return real(self, path, np_dtype, shape)

    got, i = [], 0
    with monkeypatch.context() as m, pytest.raises(RuntimeFailure, match="No space left on"):
        m.setattr(Spill, "open_file", full)
        while i < len(tokens):
            got.append(feed(tiny_llama, cache, tokens[i : i + 8]))
            i += 8
    assert 0 < i < len(tokens) and all(c.tokens_seen == i for c in cache)
    assert tier_of(cache).summaries.count == tier_of(cache).store.count  # nothing half-stored
    got.append(feed(tiny_llama, cache, tokens[i:]))
    want, _, _ = recorded(tiny_llama, tokens, ram_bytes=0, folder=str(tmp_path / "b"))
    assert mx.array_equal(mx.concatenate(got, axis=0), want)
    assert SEGMENT > SMALL  # the store itself never needed a second segment here
