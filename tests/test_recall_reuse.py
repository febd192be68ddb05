"""The ``reuse`` index (``mlx_stream.recall.reuse``): a full scan once per ``rescan``
refreshes, its shortlist and the blocks stored since in between; the softmax over
the candidates alone; its state rolled back, saved and restored with the tier."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_stream.cache.sink import load_cache, save_cache
from mlx_stream.generate.decode import generate_step
from mlx_stream.recall import select, tier_of
from mlx_stream.recall.reuse import Shortlist
from mlx_stream.recall.score import block_scores
from tests import tiny
from tests.support.recall import feed, recall_cache, reindex, spec

H, D, T = 2, 8, 4  # KV heads, channels, tokens per block


def summaries(blocks: int, seed: int, layers: int = 2, **kw) -> select.Summaries:
    rng = np.random.default_rng(seed)
    s = select.Summaries(layers, ("lo", "hi", "mean"), **kw)
    for layer in range(layers):
        for j in range(blocks):
            s.add(layer, j, rng.standard_normal((H, T, D)).astype(np.float32))
    return s


def queries(seed: int, layers: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((4, 3, D)).astype(np.float32) for _ in range(layers)]


def test_the_shortlist_scans_once_per_rescan_and_reads_its_best_and_the_new_between():
    short = Shortlist(size=3, rescan=3)
    assert short.candidates(10) is None  # nothing scanned yet
    total = np.array([0.1, 0.9, -np.inf, 0.5, 0.2, 0.8, 0.0, 0.3, 0.4, 0.05])
    short.scored(total, full=True)
    assert short.candidates(10).tolist() == [1, 3, 5]  # its best 3, in stream order
    short.scored(np.zeros(10), full=False)
    assert short.candidates(12).tolist() == [1, 3, 5, 10, 11]  # and the blocks since
    short.scored(np.zeros(12), full=False)
    assert short.candidates(12) is None  # the third refresh scans
    short.scored(np.arange(12.0), full=True)
    assert short.candidates(12).tolist() == [9, 10, 11]
    short.forget(11)  # a rollback behind the scan
    assert short.candidates(11) is None
    assert (short.scans, short.reuses) == (2, 2)


def test_blocks_another_selector_chose_join_the_shortlist_until_the_next_scan():
    short = Shortlist(size=2, rescan=4)
    short.include([3])  # nothing scanned yet: nothing to join
    assert short.state is None
    short.scored(np.array([0.0, 1.0, 0.5, 0.2, 0.9]), full=True)
    short.include([0, 1, 6])  # a block past the scan is a candidate already
    assert short.candidates(7).tolist() == [0, 1, 4, 5, 6]


def test_a_shortlist_never_keeps_a_block_that_had_no_score():
    short = Shortlist(size=4, rescan=8)
    short.scored(np.array([-np.inf, 1.0, -np.inf]), full=True)
    assert short.candidates(3).tolist() == [1]


@pytest.mark.parametrize("ram_bytes", [1 << 40, 0])
def test_rows_read_any_blocks_as_the_table_holds_them(tmp_path, ram_bytes):
    s = summaries(700, seed=1, ram_bytes=ram_bytes, folder=str(tmp_path))  # > one segment
    ids = np.array([0, 1, 2, 9, 511, 512, 513, 600, 699])
    for kind in ("lo", "hi", "mean"):
        assert np.array_equal(s.rows(kind, 1, ids), s.table(kind, 1, 700)[ids])
    assert s.rows("lo", 0, np.array([], np.int64)).shape == (0, H, D)


@pytest.mark.parametrize("selector", ["quest", "mean"])
def test_candidates_are_scored_with_the_softmax_over_them_alone(selector):
    s, qs, first = summaries(40, seed=2), queries(3), [0] * 40
    flat = block_scores(selector, qs, None, s, first, T, 0.5)
    every = block_scores(selector, qs, None, s, first, T, 0.5, candidates=np.arange(40))
    np.testing.assert_allclose(every, flat, rtol=1e-5)
    ids = np.array([3, 4, 17, 30])
    part = block_scores(selector, qs, None, s, first, T, 0.5, candidates=ids)
    assert np.isneginf(np.delete(part, ids)).all()
    want = np.zeros(len(ids))  # the vote by hand: softmax over the four, per row
    for i, q in enumerate(qs):
        g = q.reshape(H, -1, D)
        if selector == "quest":
            lo, hi = s.table("lo", i, 40)[ids], s.table("hi", i, 40)[ids]
            logits = np.einsum("hrd,bhd->hrb", np.maximum(g, 0), hi) + np.einsum(
                "hrd,bhd->hrb", np.minimum(g, 0), lo)  # fmt: skip
        else:
            logits = np.einsum("hrd,bhd->hrb", g, s.table("mean", i, 40)[ids])
        p = np.exp(0.5 * logits - (0.5 * logits).max(-1, keepdims=True))
        want += (p / p.sum(-1, keepdims=True)).max(axis=(0, 1))
    np.testing.assert_allclose(part[ids], want, rtol=1e-5)


def test_rescan_1_and_a_shortlist_of_every_block_keep_the_flat_selections(tiny_llama):
    tokens = tiny.random_tokens(8 * 160, seed=12)
    flat = recall_cache(tiny_llama, index="flat")
    feed(tiny_llama, flat, tokens)
    for kw in ({"rescan": 1}, {"rescan": 4, "shortlist": 10_000}):
        reuse = recall_cache(tiny_llama, index="reuse", **kw)
        feed(tiny_llama, reuse, tokens)
        assert tier_of(reuse).history == tier_of(flat).history, kw
    assert len({h[1] for h in tier_of(flat).history}) > 1


def test_refreshes_between_scans_score_the_shortlist_and_the_new_blocks(tiny_llama):
    tokens = tiny.random_tokens(8 * 122, seed=14)  # the last refresh reads the shortlist
    cache = recall_cache(tiny_llama, index="reuse", shortlist=6, rescan=5)
    feed(tiny_llama, cache, tokens)
    t = tier_of(cache)
    short = t.shortlist
    assert short.scans + short.reuses == t.refreshes
    assert short.scans == -(-t.refreshes // 5)  # every fifth refresh, the first included
    assert (t.usage()["index_scans"], t.usage()["index_reuses"]) == (short.scans, short.reuses)
    s = short.state  # the last refresh read the scan's best and the blocks since
    assert s.since > 0 and len(s.ids) < t.scored_blocks <= len(s.ids) + t.stored - s.at
    assert t.scored_blocks < t.stored - 50


def test_a_restored_shortlist_selects_as_an_uninterrupted_run(tiny_llama, tmp_path):
    kw = {"index": "reuse", "shortlist": 6, "rescan": 7}
    tokens = tiny.random_tokens(8 * 150, seed=13)
    cut = 8 * 90  # mid-way between two scans
    whole = recall_cache(tiny_llama, **kw)
    want = feed(tiny_llama, whole, tokens)
    part = recall_cache(tiny_llama, **kw)
    feed(tiny_llama, part, tokens[:cut])
    assert tier_of(part).shortlist.state.since > 0
    save_cache(tmp_path / "c.safetensors", part)
    fresh, _ = load_cache(tmp_path / "c.safetensors", tiny_llama, spec())
    restored = tier_of(reindex(fresh, **kw))
    assert restored.shortlist.state == tier_of(part).shortlist.state
    got = feed(tiny_llama, fresh, tokens[cut:])
    assert mx.array_equal(got, want[cut:])
    assert restored.history == tier_of(whole).history


def test_a_rewind_to_a_mark_brings_the_shortlist_back(tiny_llama):
    import copy

    tokens = tiny.random_tokens(8 * 100, seed=15)
    cache = recall_cache(tiny_llama, index="reuse", shortlist=6, rescan=4)
    feed(tiny_llama, cache, tokens[: 8 * 60])
    t = tier_of(cache)
    mark, saved, state = t.mark(), copy.deepcopy(cache), t.shortlist.state
    feed(tiny_llama, cache, tokens[8 * 60 :])
    assert t.shortlist.state != state
    t.rewind(saved, mark)
    assert t.shortlist.state == state


def test_the_blocks_a_prompts_end_chose_stay_candidates(tiny_llama):
    cache = recall_cache(tiny_llama, index="reuse", shortlist=1, rescan=3)
    seen = []

    def check(tier, n):
        seen.append((tier.selection, tier.shortlist.state, tier.stored))

    cache[0].hooks.on_prompt_end = check
    list(generate_step(tiny.random_tokens(8 * 40 + 3, seed=16), tiny_llama, cache, max_tokens=1))
    ((chosen, state, stored),) = seen
    assert len(chosen) == 4 and min(chosen) < state.at  # chosen from before the last scan
    assert set(chosen) <= set(Shortlist(1, 3, state).candidates(stored).tolist())
    assert len(state.ids) > 1  # its own best and the question's
