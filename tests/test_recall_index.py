"""The recall tier's sublinear index (``mlx_stream.recall.index``): superblock bounds
bound their children, branch and bound finds the flat scan's shortlist exactly, a
refresh scores fewer blocks than stored, a restored tier selects as before."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_stream.cache.sink import load_cache, save_cache
from mlx_stream.errors import Unsupported
from mlx_stream.recall import RecallSpec, select, tier_of
from mlx_stream.recall.index import FANOUT, Indexed
from tests import tiny
from tests.support.recall import feed, recall_cache, spec

H, D, T = 2, 8, 4  # KV heads, channels, tokens per block


def filled(blocks: int, seed: int, layers: int = 2, levels: int = 0, **kw) -> Indexed:
    """An index of ``blocks`` random blocks (``levels``: keys drawn from that many
    values, so that many blocks tie)."""
    rng = np.random.default_rng(seed)
    index = Indexed(layers, ("lo", "hi"), **kw)
    for layer in range(layers):
        for j in range(blocks):
            keys = rng.standard_normal((H, T, D)).astype(np.float32)
            if levels:
                keys = np.round(keys * levels / 2) / levels
            index.add(layer, j, keys)
    return index


def queries(seed: int, layers: int = 2, hq: int = 4, rows: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((hq, rows, D)).astype(np.float32) for _ in range(layers)]


def grouped(qs):
    return [q.reshape(H, -1, D) for q in qs]  # query heads grouped by KV head


def test_a_superblocks_bound_is_at_least_each_of_its_childrens():
    index = filled(3 * FANOUT + 17, seed=1)
    for seed in range(10):
        g = grouped(queries(seed))
        U, offsets = index.upper(g, 0.3, 4)
        S, _ = index.raw(g, 0.3, 0, 3 * FANOUT + 17, offsets)
        for s in range(4):
            assert (S[s * FANOUT : (s + 1) * FANOUT] <= U[s]).all()


@pytest.mark.parametrize("levels", [0, 2])  # 2: many blocks tie
@pytest.mark.parametrize("shortlist", [1, 5, 64, 130])
@pytest.mark.parametrize("fanout", [FANOUT, 3])
def test_branch_and_bound_finds_the_flat_shortlist_exactly(levels, shortlist, fanout):
    for seed in range(6):
        nb = [70, 200, 333, 640, 129, 1000][seed]
        index = filled(nb, seed=seed, levels=levels, shortlist=shortlist, fanout=fanout)
        empty = np.zeros(nb, bool)
        empty[0] = True  # a block of sinks only
        for qseed in range(3):
            qs = queries(100 * seed + qseed)
            scored = np.flatnonzero(np.isfinite(index.search(qs, nb, empty, 0.5)))
            assert index.found.tolist() == index.top(qs, nb, empty, 0.5).tolist()
            assert set(index.found) <= set(scored)
        assert index.capped == 0


def test_spilled_summaries_search_as_in_memory(tmp_path):
    ram = filled(600, seed=3, shortlist=16)
    disk = filled(600, seed=3, shortlist=16, ram_bytes=0, folder=str(tmp_path))
    assert disk.disk_bytes > 0
    empty = np.zeros(600, bool)
    for seed in range(3):
        qs = queries(seed)
        assert np.array_equal(ram.search(qs, 600, empty, 1.0), disk.search(qs, 600, empty, 1.0))


def test_a_shortlist_of_every_block_selects_as_the_flat_scan():
    index = filled(300, seed=5, shortlist=300)
    empty = np.zeros(300, bool)
    empty[:2] = True
    for seed in range(5):
        qs = queries(seed)
        flat = sum(select.layer_scores_summary(q, index, i, 300, "quest", 0.5, empty)
                   for i, q in enumerate(qs))  # fmt: skip
        flat = np.where(empty, -np.inf, flat)
        tree = index.search(qs, 300, empty, 0.5)
        assert np.allclose(tree, flat, rtol=1e-5) and np.isinf(tree[:2]).all()
        assert select.top_k(tree, 8) == select.top_k(flat, 8)


def test_the_cap_stops_the_search_and_is_counted():
    index = filled(640, seed=2, shortlist=64, cap=1)
    qs = queries(0)
    index.search(qs, 640, np.zeros(640, bool), 1.0)
    assert index.capped == 1 and index.scored == 10 + FANOUT


def test_a_rollback_rebuilds_the_superblock_it_cuts():
    index = filled(200, seed=4, layers=1)
    index.forget(0, 150)
    rng = np.random.default_rng(9)
    for j in range(150, 180):
        index.add(0, j, rng.standard_normal((H, T, D)).astype(np.float32))
    fresh = Indexed(1, ("lo", "hi"))
    for j in range(180):
        lo, hi = index.table("lo", 0, j + 1, j)[0], index.table("hi", 0, j + 1, j)[0]
        fresh.add(0, j, np.stack([lo, hi], 1))
    assert np.array_equal(index.bounds[0][:3], fresh.bounds[0][:3])


def test_bounds_that_separate_prune_the_search_to_the_same_shortlist():
    rng = np.random.default_rng(8)
    index = Indexed(1, ("lo", "hi"), shortlist=8)
    for j in range(10 * FANOUT):  # superblock s's keys near s * e0: far apart
        keys = 0.1 * rng.standard_normal((H, T, D)).astype(np.float32)
        keys[..., 0] += j // FANOUT
        index.add(0, j, keys)
    q = np.abs(rng.standard_normal((4, 3, D))).astype(np.float32)
    q[..., 0] += 3.0
    empty = np.zeros(10 * FANOUT, bool)
    index.search([q], 10 * FANOUT, empty, 1.0)
    assert index.found.tolist() == index.top([q], 10 * FANOUT, empty, 1.0).tolist()
    assert index.scored == 10 + FANOUT  # the best superblock only


def test_a_capped_refresh_scores_fewer_blocks_than_stored(tiny_llama):
    tokens = tiny.random_tokens(8 * 200, seed=11)
    tree = recall_cache(tiny_llama, index="tree", shortlist=8, expand=1)
    feed(tiny_llama, tree, tokens, chunk=8)
    t = tier_of(tree)
    assert t.stored > 2 * FANOUT and t.scored_blocks == -(-t.stored // FANOUT) + FANOUT
    assert t.summaries.searches == t.refreshes and 0 < t.summaries.capped <= t.refreshes
    flat = recall_cache(tiny_llama, index="flat")
    feed(tiny_llama, flat, tokens, chunk=8)
    u, v = t.usage(), tier_of(flat).usage()
    assert u["index_bytes"] > v["index_bytes"]  # the superblocks count
    assert u["ram_bytes"] + u["disk_bytes"] == u["block_bytes"] + u["index_bytes"]
    assert (u["index_searches"], u["index_capped"]) == (t.summaries.searches, t.summaries.capped)
    assert "index_searches" not in v and "index_capped" not in v  # the flat scan has none


def test_a_shortlist_of_every_block_keeps_the_flat_selections(tiny_llama):
    tokens = tiny.random_tokens(8 * 160, seed=12)
    tree = recall_cache(tiny_llama, index="tree", shortlist=10_000)
    flat = recall_cache(tiny_llama, index="flat")
    feed(tiny_llama, tree, tokens)
    feed(tiny_llama, flat, tokens)
    assert tier_of(tree).history == tier_of(flat).history
    assert len({h[1] for h in tier_of(tree).history}) > 1


def test_a_restored_tree_selects_as_an_uninterrupted_run(tiny_llama, tmp_path):
    kw = {"index": "tree", "shortlist": 6}
    tokens = tiny.random_tokens(8 * 150, seed=13)
    cut = 8 * 90  # the uninterrupted run's calls: bit for bit under any BLAS
    whole = recall_cache(tiny_llama, **kw)
    want = feed(tiny_llama, whole, tokens)
    part = recall_cache(tiny_llama, **kw)
    feed(tiny_llama, part, tokens[:cut])
    save_cache(tmp_path / "c.safetensors", part)
    fresh, _ = load_cache(tmp_path / "c.safetensors", tiny_llama, spec(**kw))
    restored = tier_of(fresh)
    n = -(-restored.summaries.count[0] // FANOUT)  # rebuilt from the summaries
    assert np.array_equal(restored.summaries.bounds[0][:n], tier_of(part).summaries.bounds[0][:n])
    got = feed(tiny_llama, fresh, tokens[cut:])
    assert mx.array_equal(got, want[cut:])
    assert restored.history == tier_of(whole).history


def test_other_index_settings_are_refused():
    with pytest.raises(Unsupported):
        RecallSpec(index="hnsw")
    with pytest.raises(Unsupported):
        RecallSpec(shortlist=-1)
