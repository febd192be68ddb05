"""The ``token`` selector (``mlx_stream.recall.score``): a block holding one key the
query picks out is chosen where its summary hides it; a prompt's end chooses with
it; the needle benchmark's shared prefix answers as a fresh cache."""

from __future__ import annotations

import numpy as np

from mlx_stream.cache import make_sink_cache
from mlx_stream.eval.needle import build, needle_eval
from mlx_stream.eval.passkey import answer
from mlx_stream.generate.decode import generate_step
from mlx_stream.recall import RecallSpec, select
from mlx_stream.recall.score import block_scores, layer_mass, layer_peaks
from mlx_stream.recall.spec import PROMPT_SELECTOR, REFEED
from tests import tiny
from tests.support.recall import BLOCK, SINKS, WINDOW, recall_cache


def one_key_against_many():
    """Block 0: 16 keys the query likes a little; block 1: one key it likes a lot,
    15 it dislikes. Queries ``(2, 3, 8)``, keys ``(2, 1, 16, 8)``."""
    rng = np.random.default_rng(0)
    d = np.zeros(8, np.float32)
    d[0] = 1.0
    q = np.tile(d, (2, 3, 1)) + 0.01 * rng.standard_normal((2, 3, 8)).astype(np.float32)
    keys = np.zeros((2, 1, 16, 8), np.float32)
    keys[0, 0] = 0.5 * d
    keys[1, 0] = -1.5 * d
    keys[1, 0, 7] = 3.0 * d
    return q, keys


def test_one_aligned_key_wins_where_the_block_mean_and_mass_do_not_see_it():
    q, keys = one_key_against_many()
    valid = np.ones((2, 16), bool)
    assert np.argmax(layer_peaks(q, keys, valid, 1.0)) == 1
    assert np.argmax(layer_mass(q, keys, valid, 1.0)) == 0  # 16 lukewarm keys outweigh it
    s = select.Summaries(1)
    for j in range(2):
        s.add(0, j, keys[j, 0][None])
    mean = select.layer_scores_summary(q, s, 0, 2, "mean", 1.0, np.zeros(2, bool))
    assert np.argmax(mean) == 0  # the block mean: the needle averaged away


def test_the_scan_a_chunk_at_a_time_gives_the_softmax_over_every_stored_token(monkeypatch):
    """Blocks scored a few at a time (``CHUNK``) get the probabilities of one softmax
    over every candidate token: peak and mass, blocks whose first tokens are not theirs."""
    import mlx.core as mx

    import mlx_stream.recall.score as score

    rng = np.random.default_rng(3)
    nb, H, bs, D = 7, 2, 16, 8
    keys = rng.standard_normal((nb, H, bs, D)).astype(np.float32)
    queries = [rng.standard_normal((4, 5, D)).astype(np.float32) for _ in range(2)]
    first = [3, 0, 0, 9, 0, 0, 15]

    class Store:
        def get(self, layer, j):
            return mx.array(keys[j] * (layer + 1))[None], None

    def direct(selector):
        total = np.zeros(nb)
        for i, q in enumerate(queries):
            g = q.reshape(H, -1, D)  # 2 query heads per KV head, 5 tokens each
            k = (keys * (i + 1)).transpose(1, 0, 2, 3)  # (H, nb, bs, D)
            logits = np.einsum("hrd,hbtd->hrbt", g, k) * 0.5
            valid = np.arange(bs)[None, :] >= np.array(first)[:, None]
            logits = np.where(valid[None, None], logits, -np.inf)
            p = np.exp(logits - logits.max(axis=(2, 3), keepdims=True))
            p /= p.sum(axis=(2, 3), keepdims=True)
            total += (p.max(-1) if selector == "token" else p.sum(-1)).max(axis=(0, 1))
        return total

    for chunk in (2, 3, 64):
        monkeypatch.setattr(score, "CHUNK", chunk)
        for selector in ("token", "exact"):
            got = block_scores(selector, queries, Store(), None, first, bs, 0.5)
            assert np.allclose(got, direct(selector), rtol=1e-5, atol=1e-7)


def test_block_scores_leave_out_blocks_with_no_token_of_their_own():
    q, keys = one_key_against_many()

    class Store:
        def get(self, layer, j):
            import mlx.core as mx

            return mx.array(keys[j])[None], None

    total = block_scores("token", [q], Store(), None, [0, 16], 16, 1.0)
    assert np.isinf(total[1]) and np.isfinite(total[0])


def test_a_prompts_end_chooses_with_the_prompt_selector(tiny_llama):
    prompt = tiny.random_tokens(131, seed=29)
    cache = recall_cache(tiny_llama)
    seen = []

    def check(tier, n):
        start = (n - 1) // BLOCK * BLOCK - (REFEED - 1) * BLOCK
        scores = tier.scores(n, PROMPT_SELECTOR, candidates_at=start)
        seen.append(tier.selection == select.with_neighbours(scores, tier.spec.blocks))
        seen.append(tier.scored_blocks == int(np.isfinite(scores).sum()))

    cache[0].hooks.on_prompt_end = check
    list(generate_step(prompt, tiny_llama, cache, max_tokens=1))
    assert seen == [True, True]
    assert cache[0].hooks.usage()["refresh_seconds"] > 0


def test_blocks_chosen_in_pairs_keep_both_halves_of_a_split_fact():
    scores = np.array([5.0, 4.0, 0.1, 0.2, 3.0, 0.0, 2.9, 1.0, -np.inf, 2.8])
    # ranked: 0, 1, 4, 6, 9, 7, 3, 2, 5; block 7 holds the fact's second half
    assert select.top_k(scores, 4) == (0, 1, 4, 6)
    assert select.with_neighbours(scores, 4) == (0, 1, 3, 4)  # 0 brings 1; 4 its better one
    assert select.with_neighbours(scores, 6) == (0, 1, 3, 4, 6, 7)  # 6 brings 7, not 5
    assert select.with_neighbours(scores, 5) == (0, 1, 3, 4, 6)  # no room left for 7
    # a neighbour is a candidate (8 is not: -inf); ties go to the earlier block
    assert select.with_neighbours(scores, 2) == (0, 1)
    assert select.with_neighbours(np.array([0.0, 1.0, 0.0]), 2) == (0, 1)
    assert select.with_neighbours(np.array([1.0, -np.inf, 0.5]), 2) == (0, 2)  # no neighbour
    assert select.with_neighbours(np.array([1.0, 2.0]), 5) == (0, 1)  # fewer candidates


def test_a_question_asked_of_the_shared_prefix_answers_as_a_fresh_cache(tiny_llama):
    tokenizer = tiny.make_tokenizer()
    hay = tiny.random_tokens(900, seed=4)
    recall = RecallSpec(blocks=2)  # blocks of 64, the cache's default stride
    rows = needle_eval(tiny_llama, tokenizer, hay, [700], [0.3], ["fact"], ["recall"], SINKS,
                       WINDOW, recall, answer_tokens=4, questions=["q0", "q1"])  # fmt: skip
    assert [(r["question"], r["prompt_selector"]) for r in rows] == [
        ("q0", "token"),
        ("q1", "token"),
    ]
    for r in rows[1:]:  # each as a fresh cache fed the whole prompt answers
        p = build(tokenizer, hay, "fact", 700, 0.3, r["value"], 1, r["question"], ["q0", "q1"])
        cache = make_sink_cache(tiny_llama, SINKS, WINDOW, recall=recall)
        seen = []
        cache[0].hooks.on_prompt_end = lambda t, n, seen=seen: seen.append(t.selection)
        assert answer(tiny_llama, tokenizer, cache, p.tokens, 4) == r["answer"]
        assert list(seen[0]) == r["selection"]
