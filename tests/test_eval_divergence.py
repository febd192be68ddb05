"""Divergence from the full cache (``mlx_stream.eval.divergence``) on tiny models, against
values computed by hand: an identical policy, a policy that drops everything, the
recompute oracle of a one-layer model, and the free-generation bookkeeping."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_stream.eval.divergence import (
    Policy,
    compare_generations,
    divergence,
    greedy,
    median_first_divergence,
    sample_points,
)
from tests import tiny

TOKENS = tiny.random_tokens(160, seed=3)


@pytest.fixture(scope="module")
def model():
    """A tiny llama with unit-scale weights: logits soft enough that KL is not 0 by
    saturation."""
    return tiny.make_model("llama", scale=1.0)


@pytest.fixture(scope="module")
def one_layer():
    return tiny.make_model("llama", scale=1.0, num_hidden_layers=1)


def test_identical_policy_has_no_divergence(model):
    points = sample_points(len(TOKENS), 3, 6)
    (r,) = divergence(model, TOKENS, [Policy(4, 1000)], chunk=24, points=points, generate=6)
    s = r.summary(segment=50)
    assert s["kl"] == pytest.approx(0, abs=1e-6) and s["top1_agreement"] == 1.0
    assert s["perplexity"] == pytest.approx(s["reference_perplexity"], rel=1e-5)
    assert s["evicted_tokens"] == 0 and s["kl_evicted"] is None
    assert s["diverged"] == 0 and s["first_divergence_median"] is None
    assert s["mismatch_after_divergence"] is None
    assert [p["position"] for p in s["samples"]] == points
    assert [(g["start"], g["end"]) for g in s["segments"]] == [(0, 50), (50, 100), (100, 150),
                                                               (150, 160)]  # fmt: skip
    assert sum(g["tokens"] for g in s["segments"]) == s["tokens"] == len(TOKENS) - 1


@pytest.mark.parametrize(
    "policy",
    [Policy(0, 1), Policy(4, 32), Policy(2, 17, "absolute"), Policy(4, 32, "rotating")],
    ids=str,
)
def test_the_first_difference_is_the_first_evicted_position(model, policy):
    """Row j (the query at token j) differs from the full cache exactly from
    j = sinks + window on: the first query that has lost a token."""
    (r,) = divergence(model, TOKENS, [policy], chunk=16)
    first = policy.sinks + policy.window
    assert np.all(r.kl[:first] < 1e-6) and np.all(r.agree[:first] == 1)
    assert r.kl[first] > 1e-4
    assert r.summary()["evicted_tokens"] == len(TOKENS) - 1 - first


def test_dropping_everything_diverges_at_once(model):
    """Window 1, no sinks: every query after the first sees only itself."""
    points = [40, 90, 150]
    (r,) = divergence(model, TOKENS, [Policy(0, 1)], chunk=32, points=points, generate=8)
    assert r.kl[0] < 1e-6 and np.all(r.kl[1:] > 1e-4)
    assert r.agree[1:].mean() < 0.5
    s = r.summary()
    assert s["kl"] > 0.1 and s["perplexity"] != pytest.approx(s["reference_perplexity"])
    # The first greedy token from point p is the argmax of row p in both caches: it
    # differs exactly where teacher forcing's top-1 tokens disagree there.
    for sample in r.points:
        assert (sample["first_divergence"] == 0) == (not r.agree[sample["position"]])
    assert s["diverged"] >= 2 and s["first_divergence_median"] == 0


def test_kl_and_nll_match_the_recompute_oracle(one_layer):
    """One layer: the policy's logits at token j are the model's on the sinks plus the
    window ending at j, at positions 0.. (StreamingLLM positions) for a j where the
    sinks have just moved (a multiple of the cache's stride, 64); KL and NLL by hand."""
    sinks, window = 2, 20
    (r,) = divergence(one_layer, TOKENS, [Policy(sinks, window)], chunk=16)
    full = one_layer(mx.array(TOKENS)[None])[0].astype(mx.float32)
    ref = np.array(full - mx.logsumexp(full, axis=-1, keepdims=True))
    for j in (64, 128):
        context = TOKENS[:sinks] + TOKENS[j - window + 1 : j + 1]
        logits = one_layer(mx.array(context)[None])[0, -1].astype(mx.float32)
        mine = np.array(logits - mx.logsumexp(logits))
        kl = float(np.sum(np.exp(ref[j]) * (ref[j] - mine)))
        assert r.kl[j] == pytest.approx(kl, rel=1e-3, abs=1e-5)
        assert r.nll[j] == pytest.approx(-mine[TOKENS[j + 1]], rel=1e-4)
        assert r.reference_nll[j] == pytest.approx(-ref[j, TOKENS[j + 1]], rel=1e-4)
        assert r.agree[j] == (np.argmax(mine) == np.argmax(ref[j]))
    assert r.summary()["reference_perplexity"] == pytest.approx(
        float(np.exp(np.mean(-ref[np.arange(len(TOKENS) - 1), TOKENS[1:]]))), rel=1e-4
    )


def test_greedy_tokens_agree_until_the_window_evicts(model):
    """From a point 5 tokens before the first eviction, the first 5 greedy tokens come
    from queries that have lost nothing."""
    policy = Policy(0, 48)
    p = policy.sinks + policy.window - 5
    (r,) = divergence(model, TOKENS, [policy], chunk=16, points=[p], generate=12)
    first = r.points[0]["first_divergence"]
    assert first is None or first >= 5


def test_greedy_continues_the_text(model):
    """``greedy`` feeds the point's token then picks each argmax: by hand with one
    forward pass over the text and its continuation so far."""
    cache = make_prompt_cache(model)
    model(mx.array(TOKENS[:30])[None], cache=cache)
    got = greedy(model, cache, TOKENS[30], 4)
    seq = TOKENS[:31]
    for _ in range(4):
        seq.append(int(mx.argmax(model(mx.array(seq)[None])[0, -1]).item()))
    assert got == seq[31:]


def test_quantized_policies_differ_from_the_start():
    """8-bit keys and values change every row (not only evicted ones); float does not."""
    model = tiny.make_model("llama", scale=1.0, num_attention_heads=2, num_key_value_heads=1)
    eight, mixed, flt = Policy(4, 64, kv_bits=8, kv_group_size=32), Policy(
        4, 64, kv_bits=4, key_bits=8, kv_group_size=32
    ), Policy(4, 64)  # fmt: skip
    r8, r48, rf = divergence(model, TOKENS[:60], [eight, mixed, flt], chunk=16)
    assert r8.kl[1:].mean() > 1e-7 and np.all(rf.kl < 1e-6)
    assert r48.kl.mean() > r8.kl.mean()
    assert (eight.kv, mixed.kv, flt.kv) == ("8", "4k8", "float")


def test_policy_checks():
    with pytest.raises(ValueError, match="RotatingKVCache"):
        Policy(4, 32, "rotating", kv_bits=8)
    with pytest.raises(ValueError, match="window"):
        Policy(4, 0)
    with pytest.raises(ValueError, match="positions"):
        Policy(4, 8, "relative")


def test_generation_bookkeeping_by_hand():
    assert compare_generations([1, 2, 3, 4], [1, 2, 3, 4]) == {
        "first_divergence": None, "mismatch": 0.0}  # fmt: skip
    assert compare_generations([1, 2, 3, 4, 5], [1, 2, 9, 4, 6]) == {
        "first_divergence": 2, "mismatch": 2 / 3}  # fmt: skip
    assert compare_generations([7, 2], [1, 2]) == {"first_divergence": 0, "mismatch": 0.5}
    assert median_first_divergence([1, 3]) == 2.0
    assert median_first_divergence([None, 3, 5]) == 5.0
    assert median_first_divergence([None, None, 3]) is None
    assert median_first_divergence([]) is None
    assert sample_points(100, 3, 8) == [50, 70, 91]  # 91 + 1 + 8 tokens: the stream's end
    assert sample_points(100, 0, 8) == [] and sample_points(100, 3, 0) == []
    assert sample_points(10, 3, 9) == [] and sample_points(12, 5, 9) == [2]
