"""Per-channel 4-bit keys (mlx_stream.cache.kvquant): outliers cost little, a chunk and a
speculative verify block see exactly what token-by-token decoding sees, rollback and
checkpoints restore the quantized state bit for bit, and refusals come before a write."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache import CacheSpec, SinkCache, kvquant, load_cache, make_sink_cache, save_cache
from mlx_stream.cache.positions import Move
from mlx_stream.errors import Unsupported
from mlx_stream.generate.decode import DecodeState, generate_step
from tests import tiny
from tests.support.cache import feed

S, W, G = 4, 40, 32
TOKENS = tiny.random_tokens(12 * W, seed=11)


@pytest.fixture(scope="module")
def model():
    return tiny.make_model("llama", num_attention_heads=2, num_key_value_heads=1, scale=1.0)


def four_bit(model, **kwargs):
    kwargs = {"sinks": S, "window": W, "slack": 16, "stride": 16, **kwargs}
    return make_sink_cache(model, kv_bits=4, kv_group_size=G, **kwargs)


def arrays(cache) -> list:
    return [a for c in cache for _, a in tree_flatten(c.state)]


def same_state(a, b) -> bool:
    xs, ys = arrays(a), arrays(b)
    return len(xs) == len(ys) and all(mx.array_equal(x, y).item() for x, y in zip(xs, ys))


def test_outlier_channels_cost_little_per_channel():
    # Keys with two outlier channels (x40 and an offset): per-token groups along the head
    # dimension (mx.quantize) give every channel the outliers' step; per-channel groups
    # along the tokens do not.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 2 * G, 64)).astype(np.float32)
    x[..., 5] = 40 * x[..., 5] + 30
    x[..., 37] *= 25
    keys = mx.array(x)
    store = kvquant.ChannelKeys.zeros(1, 2, 2 * G + S, 2 * G, 64, mx.float32, S, 4)
    store.write(mx.zeros((1, 2, S, 64)), 0)
    store.write(keys, S)  # two whole groups: both quantized into the ring
    ring = store.fetch()[..., S : S + 2 * G, :]
    per_token = mx.dequantize(*mx.quantize(keys, group_size=G, bits=4), group_size=G, bits=4)
    small = [c for c in range(64) if c not in (5, 37)]
    ours = mx.abs(ring - keys)[..., small].mean().item()
    theirs = mx.abs(per_token - keys)[..., small].mean().item()
    assert ours < theirs / 5
    # The residual holds the floats (float16 for float32 keys) until their group is full.
    partial = kvquant.ChannelKeys.zeros(1, 2, 2 * G + S, 2 * G, 64, mx.float32, S, 4)
    partial.write(keys[..., : G - 1, :], S)
    held = partial.fetch()[..., -kvquant.RECENT :, :][..., : G - 1, :]
    assert mx.array_equal(held, keys[..., : G - 1, :].astype(mx.float16).astype(mx.float32))


def test_slack_rounds_up_to_whole_groups(model):
    cache = four_bit(model)[0]
    assert (cache.window + cache.slack) % kvquant.GROUP == 0
    assert cache.slack == 56  # at least 32 (calls are written in place), 40 + 32 -> 96
    # 8-bit keys are per channel too; kept per token (for the recall tier) they need none.
    assert make_sink_cache(model, S, W, 16, kv_bits=4, key_bits=8)[0].slack == 56
    assert SinkCache(CacheSpec(S, W, 16, kv_bits=8), token_keys=True).slack == 16


@pytest.mark.parametrize("chunk", [5, 16, 33])
def test_chunks_see_what_token_by_token_sees(model, chunk):
    # Chunks cross group boundaries: rows before a group fills must read its floats,
    # rows after it the quantized group, exactly as one token at a time does.
    one = feed(model, four_bit(model), TOKENS, 1)
    many = feed(model, four_bit(model), TOKENS, chunk)
    scale = mx.abs(one).max().item()
    # Float tolerance: a BLAS may round 1-row and many-row matmuls differently, and a
    # key that lands on the other side of a 4-bit step moves later logits by up to
    # ~1e-3 of the largest (test_cache_semantics_do_not_depend_on_the_chunk, same keys).
    assert mx.abs(one - many).max().item() <= 5e-3 * scale
    assert mx.array_equal(one.argmax(axis=-1), many.argmax(axis=-1))
    # ... and that choice matters: reading the quantized keys of an open group would
    # cost what quantization costs against float keys.
    floats = feed(model, make_sink_cache(model, sinks=S, window=W, slack=24, stride=16), TOKENS, 1)
    assert mx.abs(one - floats).max().item() > 20e-3 * scale


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_cache_semantics_do_not_depend_on_the_chunk(bits):
    # The same keys, values and queries fed one token at a time or in chunks crossing
    # group ends, sink moves and rebases: every row's attention output is the same (the
    # model's own matmuls, which a BLAS may round by batch, are left out).
    import mlx.nn as nn

    from mlx_stream.cache import SinkCache

    T, D = 400, 32
    keys, values, queries = (mx.random.normal((1, 1, T, D), key=mx.random.key(i)) for i in range(3))
    rope = nn.RoPE(D)

    def run(chunk):
        cache = SinkCache(CacheSpec(S, W, 8, 16, kv_bits=bits, kv_group_size=G), Move(0, rope))
        out, n = [], 0
        while n < T:
            N = min(chunk, cache.max_call_tokens(), T - n)
            mask = cache.make_mask(N, return_array=True)
            k, v = cache.update_and_fetch(keys[:, :, n : n + N], values[:, :, n : n + N])
            if isinstance(k, tuple):  # 8-bit: what mlx-lm's quantized kernel would read
                k, v = (mx.dequantize(*x, group_size=G, bits=bits) for x in (k, v))
            if isinstance(mask, str) or mask is None:
                mask = None if mask is None else "causal"
            q = queries[:, :, n : n + N]
            out.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask))
            n += N
        return mx.concatenate(out, axis=2)

    one = run(1)
    for chunk in (5, 16, 33):
        assert mx.abs(run(chunk) - one).max().item() < 1e-5


def test_speculative_greedy_equals_plain_greedy(model):
    prompt, n = TOKENS[:20], 6 * W
    plain = [t for t, _, _ in generate_step(prompt, model, four_bit(model), max_tokens=n)]
    # A different one-layer draft: rejections (and rollbacks) happen.
    draft = tiny.make_model(
        "llama", seed=7, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        scale=1.0,
    )  # fmt: skip
    state = DecodeState()
    spec_cache = four_bit(model) + four_bit(draft)
    out = generate_step(
        prompt, model, spec_cache, max_tokens=n, draft_model=draft, num_draft_tokens=3,
        state=state,
    )  # fmt: skip
    assert [t for t, _, _ in out] == plain
    assert state.drafted > state.accepted > 0  # rollbacks happened, across group fills


def test_rollback_across_a_filled_group_is_bit_exact(model):
    cache = four_bit(model)
    feed(model, cache, TOKENS[:150], 16)
    # Token 150 is 146 past the sinks: the next 10 tokens fill a group (4 + 5 * 32 = 164
    # ends at 163), and a rebase or sink move may fall inside too.
    start = cache[0].tokens_seen
    end = kvquant.group_start(start, S) + kvquant.GROUP
    n = end - start + 3
    for c in cache:  # as after a first rollback: a rebase's moved tensors are kept
        c.rolls_back = True
    expected = copy.deepcopy(cache)
    block = mx.array([TOKENS[start : start + n]])
    first = model(block, cache=cache)
    after = copy.deepcopy(cache)
    assert not same_state(cache, expected)
    assert mlx_cache.trim_prompt_cache(cache, n) == n
    assert cache[0].tokens_seen == expected[0].tokens_seen
    # The rolled-back cache answers as the one never fed; fed again, it is bit for bit
    # the cache that was fed once.
    nxt = mx.array([TOKENS[start + 5 : start + 13]])
    probe, reference = copy.deepcopy(cache), copy.deepcopy(expected)
    assert mx.array_equal(model(nxt, cache=probe), model(nxt, cache=reference))
    assert mx.array_equal(model(block, cache=cache), first)
    assert same_state(cache, after)


def test_rollback_past_the_residual_is_refused(model):
    cache = four_bit(model, slack=120)
    feed(model, cache, TOKENS[:300], 16)
    before = cache[0].tokens_seen
    deepest = max(m for m in range(1, 122) if kvquant.trim_limit(before, S, m))
    with pytest.raises(Unsupported, match="4-bit keys keep the floats"):
        cache[0].trim(deepest + 1)
    assert cache[0].tokens_seen == before
    assert cache[0].trim(deepest) == deepest


def test_a_call_past_the_residual_is_refused_before_writing(model):
    cache = four_bit(model, slack=120, stride=1024)
    feed(model, cache, TOKENS[:50], 16)
    limit = cache[0].max_call_tokens()
    assert limit == kvquant.call_limit(50, S) < cache[0].ring.max_call_tokens()
    state = copy.deepcopy(cache)
    with pytest.raises(Unsupported, match="feed at most"):
        model(mx.array([TOKENS[50 : 51 + limit]]), cache=cache)
    assert same_state(cache, state)
    model(mx.array([TOKENS[50 : 50 + limit]]), cache=cache)  # the limit itself is served


def test_checkpoint_round_trips_bit_for_bit(tmp_path, model):
    cache = four_bit(model)
    feed(model, cache, TOKENS[:157], 16)  # mid-group: the residual holds live floats
    save_cache(tmp_path / "k4.safetensors", cache)
    loaded, _ = load_cache(tmp_path / "k4.safetensors", model)
    assert isinstance(loaded[0].keys, kvquant.ChannelKeys)
    # What is saved comes back bit for bit: the written slots (spare sink slots past
    # the ring are scratch, rewritten by every call that reads them, and load as zeros).
    saved = [a for c in cache for _, a in tree_flatten(c.used_state)]
    back = [a for c in loaded for _, a in tree_flatten(c.used_state)]
    assert len(saved) == len(back) and all(mx.array_equal(x, y).item() for x, y in zip(saved, back))
    assert loaded[0].meta_state == cache[0].meta_state
    nxt = mx.array([TOKENS[157:170]])
    assert mx.array_equal(model(nxt, cache=loaded), model(nxt, cache=cache))


def test_a_per_token_four_bit_checkpoint_is_refused(model):
    cache = four_bit(model)
    feed(model, cache, TOKENS[:40], 16)
    old = [tuple(mx.quantize(mx.zeros((1, 1, 8, 32)), group_size=32, bits=4))] * 2
    with pytest.raises(Unsupported, match="per-token 4-bit keys"):
        cache[0].state = old


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_four_bit_draft_rolls_a_float_target_back_exactly(real_model):
    # The default model drafts for itself on 4-bit caches: it disagrees with the float
    # target now and then, so the target rolls back (slack 4: no masked slot but the
    # verify block's) past a 64-token window, and still yields plain greedy's tokens.
    from tests.support.paths import DATA

    model, tokenizer, _ = real_model
    N_NEW = 40  # noqa: N806  (rollbacks come within the first dozen drafts)
    with open(DATA / "botchan.txt", encoding="utf-8") as f:
        prompt = tokenizer.encode(f.read(4000))[:72]  # with the reply, past the window
    plain = [
        t
        for t, _, _ in generate_step(prompt, model, make_sink_cache(model, 4, 64), max_tokens=N_NEW)
    ]
    state = DecodeState()
    caches = make_sink_cache(model, 4, 64, slack=4) + make_sink_cache(model, 4, 64, 4, kv_bits=4)
    out = generate_step(
        prompt, model, caches, max_tokens=N_NEW, draft_model=model, num_draft_tokens=3, state=state
    )
    assert [t for t, _, _ in out] == plain
    assert state.drafted > state.accepted  # rollbacks happened


@pytest.mark.real_model
def test_real_model_chunks_give_token_by_token_logits_bit_for_bit(real_model_path):
    # A verify block of 4 rows on 4-bit keys gives the logits of 4 decode steps, bit
    # for bit, past many group fills (the figures: benchmarks/README.md "A block's
    # logits"). bfloat16: its matmuls give a row the same bits in a block as alone on
    # the CPU.
    from mlx_stream.models import loader
    from tests.support.paths import DATA

    model, tokenizer = loader.load(real_model_path, dtype="bfloat16")
    with open(DATA / "botchan.txt", encoding="utf-8") as f:
        tokens = tokenizer.encode(f.read(2000))[:100]  # three group fills past the sinks
    kw = {"sinks": 4, "window": 32, "slack": 16, "kv_bits": 4, "positions": "absolute"}
    one = feed(model, make_sink_cache(model, **kw), tokens, 1)
    assert mx.array_equal(feed(model, make_sink_cache(model, **kw), tokens, 4), one)


def test_a_call_attends_only_the_residual_slots_of_its_open_groups():
    # The residual columns of a call: the floats of [group_start(n), n + N), contiguous
    # unless they wrap around the residual (then all of it); none before the first
    # ring token.
    assert kvquant.recent_range(2, 1, S) == (0, 0)  # a sink
    assert kvquant.recent_range(S, 1, S) == (0, 1)
    assert kvquant.recent_range(S + 40, 1, S) == (32, 41)  # group 1: slots 32..63
    assert kvquant.recent_range(S + 63, 1, S) == (32, 64)
    assert kvquant.recent_range(S + 64, 1, S) == (0, 1)  # group 2 reuses slots 0..31
    assert kvquant.recent_range(S + 40, 30, S) == (0, kvquant.RECENT)  # 32..69 wraps
    assert kvquant.recent_range(S + 10, 30, S) == (0, 40)
    for n, N in ((S + 40, 1), (S + 10, 30), (S + 40, 30), (1, 8)):
        tokens = kvquant.recent_tokens(n, N, S)
        lo, hi = kvquant.recent_range(n, N, S)
        # every float a row of the call may read is inside the range
        assert set(tokens[tokens >= 0]) <= set(tokens[lo:hi])
