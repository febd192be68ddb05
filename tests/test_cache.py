"""SinkCache: equivalence with mlx-lm before eviction, fixed memory, bounded positions,
batching invariance, rollback after wraps, save/load, and the mlx-lm protocol."""

import copy

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.rope_utils import initialize_rope

from mlx_stream.cache.positions import Move
from mlx_stream.cache.sink import (
    CacheSpec,
    SinkCache,
    load_cache,
    make_sink_cache,
    save_cache,
)
from mlx_stream.errors import Unsupported
from tests import tiny
from tests.support.cache import TOKENS, S, W, feed

ARCHS = ["llama", "qwen2", "gemma3_text"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny.make_model(request.param)


def sink_layers(cache):
    return [c for c in cache if isinstance(c, SinkCache)]


def test_logits_equal_kvcache_before_first_eviction(model):
    reference = mlx_cache.make_prompt_cache(model)
    ours = make_sink_cache(model, sinks=S, window=W)
    prompt = mx.array([TOKENS[:20]])
    assert mx.array_equal(model(prompt, cache=reference), model(prompt, cache=ours))
    for t in TOKENS[20 : S + W]:
        x = mx.array([[t]])
        assert mx.array_equal(model(x, cache=reference), model(x, cache=ours))


def test_bounded_buffer_and_offset_after_ten_windows(model):
    cache = make_sink_cache(model, sinks=S, window=W, slack=16, stride=16)
    feed(model, cache, TOKENS[: S + W + 16], chunk=16)
    sizes = [(c.keys.shape, c.nbytes) for c in sink_layers(cache)]
    feed(model, cache, TOKENS[S + W + 16 :], chunk=16)
    for c, (shape, nbytes) in zip(sink_layers(cache), sizes):
        # sinks + window + slack: a call crossing a stride gets its spare sink copies
        # as extra columns, not slots
        slots = S + W + 16
        assert c.keys.shape == shape == (1, c.keys.shape[1], slots, c.keys.shape[3])
        assert c.nbytes == nbytes > 0
        assert c.tokens_seen == len(TOKENS)
        assert 0 <= c.offset < c.max_offset <= 2 * (S + W + 16 + 16)
        assert c.size() == S + W


@pytest.mark.parametrize("chunk", [7, 64])
def test_batching_does_not_change_logits(model, chunk):
    one = feed(model, make_sink_cache(model, sinks=S, window=W, slack=64), TOKENS, 1)
    many = feed(model, make_sink_cache(model, sinks=S, window=W, slack=64), TOKENS, chunk)
    assert one.shape == many.shape == (len(TOKENS), tiny.vocab_size())
    # Float tolerance: a BLAS may use other kernels for 1-row and many-row matmuls.
    assert mx.abs(one - many).max().item() <= 1e-3 * mx.abs(one).max().item()
    assert mx.array_equal(one.argmax(axis=-1), many.argmax(axis=-1))


def test_sink_keys_are_first_keys_moved_by_a_rotation(tiny_llama):
    reference = mlx_cache.make_prompt_cache(tiny_llama)
    tiny_llama(mx.array([TOKENS[:S]]), cache=reference)
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=16, stride=16)
    feed(tiny_llama, cache, TOKENS, 16)
    for c, ref in zip(cache, reference):
        base, sink_start = c.ring.layout(c.tokens_seen)
        assert sink_start > 0  # the sinks did move
        first_keys = ref.keys[..., :S, :]
        assert mx.allclose(c.sink_copy, first_keys, atol=1e-5).item()  # first-written copy
        moved_back = c.move(c.keys[..., :S, :], -(sink_start - base))
        assert mx.allclose(moved_back, first_keys, atol=1e-4).item()


def test_one_layer_stream_equals_recomputation_oracle():
    # With one layer, a token's K/V depend only on the token and its position, so
    # in-cache positions must reproduce a fresh forward over sinks + window exactly.
    model = tiny.make_model("llama", num_hidden_layers=1)
    cache = make_sink_cache(model, sinks=S, window=W, slack=8, stride=1)
    q = 299
    for t in TOKENS[: q + 1]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    context = TOKENS[:S] + TOKENS[q - W + 1 : q + 1]
    oracle = model(mx.array([context]))[0, -1]
    assert mx.allclose(logits, oracle, atol=1e-3).item()


def test_absolute_positions_grow_like_mlx_lm(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, positions="absolute")
    feed(tiny_llama, cache, TOKENS[:200], 16)
    assert all(c.offset == c.tokens_seen == 200 for c in cache)


@pytest.mark.parametrize(
    "rope",
    [
        nn.RoPE(16, base=10000),
        nn.RoPE(16, traditional=True, base=10000),
        initialize_rope(
            16,
            500000.0,
            False,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            4096,
        ),
        initialize_rope(
            16,
            10000.0,
            False,
            {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            },
            4096,
        ),
    ],
    ids=["standard", "traditional", "llama3", "yarn"],
)
def test_shift_is_a_pure_rotation(rope):
    cache = SinkCache(CacheSpec(sinks=S, window=W), Move(0, rope))
    x = mx.random.normal((1, 2, 5, 16), key=mx.random.key(1))
    cache.keys = x
    at_100 = rope(x, offset=100)
    at_37 = rope(x, offset=37)
    assert mx.allclose(cache.move(at_100, -63), at_37, atol=1e-4).item()
    there_and_back = cache.move(cache.move(at_100, 1234), -1234)
    assert mx.allclose(there_and_back, at_100, atol=1e-4).item()


def test_rebasing_does_not_change_logits(tiny_llama):
    def run(rebase_every):
        cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=16, stride=16)
        for c in cache:
            c.rebase_every = rebase_every
        return feed(tiny_llama, cache, TOKENS, 16), cache

    rebased, cache = run(64)
    never, _ = run(10**9)
    assert cache[0].ring.layout(cache[0].tokens_seen)[0] > 0  # it did rebase
    # Rotations in float32 through two layers of a tiny random model with large logits.
    scale = mx.abs(never).max().item()
    assert mx.abs(rebased - never).max().item() <= 1e-3 * scale


def test_trim_after_wrap_restores_state(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=8)
    feed(tiny_llama, cache, TOKENS[:150], 8)
    assert cache[0].tokens_seen > cache[0].capacity  # the ring wrapped
    expected = copy.deepcopy(cache)
    for extra in (1, 5, 9):  # up to slack + 1
        tiny_llama(mx.array([TOKENS[150 : 150 + extra]]), cache=cache)
        assert mlx_cache.trim_prompt_cache(cache, extra) == extra
        assert cache[0].tokens_seen == 150
    nxt = mx.array([TOKENS[150:158]])
    assert mx.array_equal(tiny_llama(nxt, cache=cache), tiny_llama(nxt, cache=expected))


def test_trim_deeper_than_slack_is_refused(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=8)
    feed(tiny_llama, cache, TOKENS[:150], 8)
    with pytest.raises(ValueError, match="trim at most slack"):
        cache[0].trim(20)


def test_a_call_larger_than_the_slack_sees_what_single_tokens_see(tiny_llama):
    # A multi-token call attends over the buffer as it was, its later layouts' sinks
    # and its own tokens: with no slack at all, 30 tokens crossing three sink moves
    # (stride 8) give the logits of one token at a time.
    def run(chunk):
        cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=0, stride=8)
        feed(tiny_llama, cache, TOKENS[:100], 1)
        if chunk == 1:
            return feed(tiny_llama, cache, TOKENS[100:130], 1)
        assert len(cache[0].ring.sink_layouts(30)) == 5  # four spare sink copies
        return tiny_llama(mx.array([TOKENS[100:130]]), cache=cache)[0]

    one, many = run(1), run(30)
    assert mx.abs(one - many).max().item() <= 1e-3 * mx.abs(one).max().item()
    assert mx.array_equal(one.argmax(axis=-1), many.argmax(axis=-1))

    # Any number of layouts: a concatenating call appends one sink copy per layout.
    def run60(chunk):
        cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=0, stride=8)
        feed(tiny_llama, cache, TOKENS[:100], 8)
        if chunk == 1:
            return feed(tiny_llama, cache, TOKENS[100:160], 1)
        assert len(cache[0].ring.sink_layouts(60)) == 8
        return tiny_llama(mx.array([TOKENS[100:160]]), cache=cache)[0]

    one, many = run60(1), run60(60)
    assert mx.abs(one - many).max().item() <= 1e-3 * mx.abs(one).max().item()
    assert mx.array_equal(one.argmax(axis=-1), many.argmax(axis=-1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=0), "window must be at least 1"),
        (dict(sinks=-1), "sinks must be 0 or more"),
        (dict(slack=-1), "slack must be 0 or more"),
        (dict(positions="relative"), "positions must be one of"),
    ],
)
def test_impossible_sizes_are_refused(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_sink_cache(tiny_llama, **kwargs)


def test_bounded_layers_of_a_model_are_kept(tiny_gemma3):
    cache = make_sink_cache(tiny_gemma3, sinks=S, window=W)
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["RotatingKVCache", "RotatingKVCache", "SinkCache"]


def test_unknown_cache_layer_is_named(tiny_llama):
    class Strange(mlx_cache.ConcatenateKVCache):  # a cache class mlx-stream does not know
        pass

    class Wrapped:
        layers = tiny_llama.layers

        def make_cache(self):
            return [Strange() for _ in self.layers]

    with pytest.raises(Unsupported, match="Strange"):
        make_sink_cache(Wrapped())


def test_no_sinks_is_window_only(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=0, window=W, slack=16, stride=16)
    feed(tiny_llama, cache, TOKENS[:200], 16)
    mask = cache[0].make_mask(1, return_array=True)
    assert mask.sum().item() == W  # one query sees exactly the window, itself included


def test_mask_shows_sinks_and_window_per_row(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=16)
    feed(tiny_llama, cache, TOKENS[:160], 16)
    mask = cache[0].make_mask(16, return_array=True)
    # More tokens than slack + 1: the buffer as it was, then the call's own 16 tokens
    # (no stride crossed here).
    assert mask.dtype == mx.bool_ and mask.shape == (16, cache[0].capacity + 16)
    assert (mask.sum(axis=1) == S + W).all().item()
    # A model that only passes the mask to attention gets the additive form: 0 where
    # the boolean mask is True, -inf elsewhere, in the cache's dtype.
    additive = cache[0].make_mask(16)
    assert additive.dtype == cache[0].values.dtype
    assert mx.array_equal(additive, mx.where(mask, 0.0, -mx.inf).astype(additive.dtype)).item()


def test_a_call_within_the_slack_is_written_in_place(tiny_llama):
    # At most slack + 1 tokens (a verify block): written into the ring first, so each
    # row attends over the slots a decode step at its token does (bit for bit in
    # bfloat16: benchmarks/block_exactness.py), one column per slot.
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=16, stride=16)
    feed(tiny_llama, cache, TOKENS[:160], 16)
    mask = cache[0].make_mask(16, return_array=True)
    assert mask.shape == (16, cache[0].capacity)
    assert (mask.sum(axis=1) == S + W).all().item()
    B, H, _, D = cache[0].keys.shape
    k, _ = cache[0].update_and_fetch(*[mx.zeros((B, H, 16, D))] * 2)
    assert k.shape[2] == cache[0].capacity


def test_a_single_token_step_needs_no_mask_without_slack(tiny_llama):
    # Slack 0: every slot a step attends to is a sink or a window token, as in mlx-lm's
    # rotating cache, so no mask; with slack, the slack slots are masked out.
    bare = make_sink_cache(tiny_llama, sinks=S, window=W, slack=0, stride=16)
    slack = make_sink_cache(tiny_llama, sinks=S, window=W, slack=4, stride=16)
    for cache in (bare, slack):
        feed(tiny_llama, cache, TOKENS[:150], 16)
    assert bare[0].make_mask(1) is None
    assert bare[0].update_and_fetch(*[mx.zeros((1, 2, 1, 16))] * 2)[0].shape[2] == S + W
    mask = slack[0].make_mask(1, return_array=True)
    assert mask.shape == (1, S + W + 4) and mask.sum().item() == S + W
    assert bare[0].make_mask(1, window_size=8) is not None  # a model's own window


def test_a_state_saved_with_spare_sink_slots_loads(tiny_llama):
    # Caches saved before multi-token calls concatenated their spare sinks kept them as
    # slots after the ring: loaded, those slots are dropped and calls run as before.
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=8)
    feed(tiny_llama, cache, TOKENS[:100], 8)
    old = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=8)
    for c, o in zip(cache, old):
        o.meta_state = c.meta_state
        extra = mx.zeros((*c.keys.shape[:2], 2 * S, c.keys.shape[3]))
        o.state = [mx.concatenate([x, extra], axis=2) for x in c.state[:2]] + c.state[2:]
        assert o.keys.shape == c.keys.shape
    nxt = mx.array([TOKENS[100:120]])  # crosses stride multiples: spare sinks as columns
    assert mx.array_equal(tiny_llama(nxt, cache=old), tiny_llama(nxt, cache=cache)).item()


def test_save_load_round_trip_continues_identically(tmp_path, tiny_gemma3):
    model = tiny_gemma3
    cache = make_sink_cache(model, sinks=S, window=W, slack=16, stride=16)
    feed(model, cache, TOKENS[:150], 16)
    save_cache(tmp_path / "ckpt.bin", cache, {"note": "mid-stream"})  # any file name
    loaded, meta = load_cache(tmp_path / "ckpt.bin", model)
    assert meta["note"] == "mid-stream"
    assert [type(c) for c in loaded] == [type(c) for c in cache]

    def greedy(c, n=40):
        y, out = TOKENS[150], []
        for _ in range(n):
            y = model(mx.array([[y]]), cache=c)[0, -1].argmax().item()
            out.append(y)
        return out

    assert greedy(loaded) == greedy(cache)


def test_deepcopy_is_independent(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=16, stride=16)
    feed(tiny_llama, cache, TOKENS[:100], 16)
    clone = copy.deepcopy(cache)
    assert clone[0].rope is cache[0].rope
    feed(tiny_llama, clone, TOKENS[100:140], 16)
    assert cache[0].tokens_seen == 100 and clone[0].tokens_seen == 140


def test_mlx_lm_generate_step_accepts_sink_cache(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=16, stride=16)
    steps = generate_step(
        mx.array(TOKENS[:40]),
        tiny_llama,
        max_tokens=5 * W,
        prompt_cache=cache,
        prefill_step_size=16,
    )
    tokens = [t for t, _ in steps]
    assert len(tokens) == 5 * W
    assert cache[0].tokens_seen == 40 + 5 * W  # mlx-lm pipelines: every token fed


def test_mlx_lm_speculative_runs_past_wraps(tiny_llama, tiny_draft):
    target = make_sink_cache(tiny_llama, sinks=S, window=W, slack=16, stride=16)
    draft = make_sink_cache(tiny_draft, sinks=S, window=W, slack=16, stride=16)
    prompt = TOKENS[:12]
    n, accepted = 0, 0
    for _token, _, from_draft in speculative_generate_step(
        mx.array(prompt),
        tiny_llama,
        tiny_draft,
        num_draft_tokens=3,
        max_tokens=6 * W,
        prompt_cache=target + draft,
        prefill_step_size=16,
    ):
        n += 1
        accepted += from_draft
        # Mid-round the target holds at most the verify block beyond what was yielded.
        assert target[0].tokens_seen <= len(prompt) + n + 3
        assert target[0].offset < target[0].max_offset
    assert n == 6 * W
    assert target[0].tokens_seen == len(prompt) + n - 1
    assert target[0].tokens_seen > target[0].capacity  # wrapped several times
    assert all(c.tokens_seen == target[0].tokens_seen for c in target)


def test_load_cache_refuses_other_files(tmp_path, tiny_llama):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a cache at all")
    with pytest.raises(ValueError, match="not a readable cache file"):
        load_cache(garbage, tiny_llama)
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"x": mx.zeros(2)})
    with pytest.raises(ValueError, match="not an mlx-stream cache file"):
        load_cache(tmp_path / "other.safetensors", tiny_llama)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_trim_back_across_a_rebase_is_exact(bits):
    model = tiny.make_model("llama", num_attention_heads=2, num_key_value_heads=1, scale=1.0)
    kw = dict(sinks=S, window=W, slack=8, stride=8, kv_bits=bits, kv_group_size=32)
    cache = make_sink_cache(model, **kw)
    r = cache[0].rebase_every * 2  # a rebase point past the first eviction
    feed(model, cache, TOKENS[:9], 8)
    assert mlx_cache.trim_prompt_cache(cache, 1) == 1  # a cache that rolls back keeps...
    feed(model, cache, TOKENS[8 : r - 1], 8)  # ...what a rebase moved, for a while
    expected = copy.deepcopy(cache)
    model(mx.array([TOKENS[r - 1 : r]]), cache=cache)
    model(mx.array([TOKENS[r : r + 2]]), cache=cache)  # this call rebases the buffer
    assert cache[0].layout.base != expected[0].layout.base
    assert mlx_cache.trim_prompt_cache(cache, 3) == 3
    for c, e in zip(cache, expected):
        held = c.ring.slots >= 0  # slots the trimmed tokens wrote are masked out
        assert (c.ring.slots[held] == e.ring.slots[held]).all()
        held = mx.array(held)
        slotted = c.state[:2]
        if bits in (4, 8):  # per-channel keys: the quantized ring and float sinks, whole
            slotted = c.state[1:2]  # (token r - 1 fills no group: they equal the expected)
            for a, b in zip(tree_flatten(c.state[0]), tree_flatten(e.state[0])):
                assert a[0] == "recent" or mx.array_equal(a[1], b[1]).item()
        for a, b in zip(tree_flatten(slotted), tree_flatten(e.state[2 - len(slotted) : 2])):
            same = (a[1] == b[1])[..., : c.capacity, :].all(axis=(0, 1, 3))
            assert mx.all(same | ~held).item()  # bit for bit, not a rotation back
    nxt = mx.array([TOKENS[r - 1 : r + 3]])
    assert mx.array_equal(model(nxt, cache=cache), model(nxt, cache=expected)).item()


def test_trim_across_a_rebase_before_any_rollback_is_refused(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=8)
    r = cache[0].rebase_every * 2
    feed(tiny_llama, cache, TOKENS[: r + 2], 1)  # never trimmed: nothing kept (flat memory)
    with pytest.raises(Unsupported, match="crosses the rebase"):
        cache[0].trim(3)
    assert cache[0].tokens_seen == r + 2 and cache[0].trim(2) == 2  # not across: fine


def test_a_loaded_cache_refuses_a_trim_across_a_rebase_as_the_live_one(tmp_path, tiny_llama):
    """Issue 35 (4): a loaded cache knew its layout but not the stride it was set for,
    so it trimmed across a rebase and re-rotated the keys at the next call."""
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=8)
    r = cache[0].rebase_every * 2
    feed(tiny_llama, cache, TOKENS[: r + 2], 1)
    save_cache(tmp_path / "c.safetensors", cache)
    loaded, _ = load_cache(tmp_path / "c.safetensors", tiny_llama)
    old = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=8)
    for c, o in zip(loaded, old):  # a file saved before the stride was in it
        o.meta_state = {k: v for k, v in c.meta_state.items() if k != "layout_stride"}
        o.state = c.state
    for caches in (cache, loaded, old):
        for c in caches:
            with pytest.raises(Unsupported, match="crosses the rebase"):
                c.trim(3)
        assert mlx_cache.trim_prompt_cache(caches, 2) == 2  # not across: fine
    nxt = mx.array([TOKENS[r : r + 3]])
    want = tiny_llama(nxt, cache=cache)
    assert mx.array_equal(tiny_llama(nxt, cache=loaded), want).item()
    assert mx.array_equal(tiny_llama(nxt, cache=old), want).item()


def test_a_deepcopy_owns_its_rebase_undo(tiny_llama):
    """Issue 35 (7): a trim back across a rebase adopts the copy kept before it and
    writes it in place afterwards; a deep copy must not share that copy."""
    cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=8, stride=8)
    r = cache[0].rebase_every * 2
    feed(tiny_llama, cache, TOKENS[:9], 8)
    assert mlx_cache.trim_prompt_cache(cache, 1) == 1  # keeps what a rebase moves
    feed(tiny_llama, cache, TOKENS[8 : r - 1], 8)
    expected = copy.deepcopy(cache)
    feed(tiny_llama, cache, TOKENS[r - 1 : r + 2], 1)  # rebases at r, the undo kept
    clone = copy.deepcopy(cache)
    assert mlx_cache.trim_prompt_cache(clone, 3) == 3  # adopts its undo copy...
    feed(tiny_llama, clone, TOKENS[r - 1 : r + 2], 1)  # ...and rebases it in place again
    assert mlx_cache.trim_prompt_cache(cache, 3) == 3
    nxt = mx.array([TOKENS[r - 1 : r + 3]])
    assert mx.array_equal(tiny_llama(nxt, cache=cache), tiny_llama(nxt, cache=expected)).item()


def test_calls_crossing_strides_are_exact(tiny_llama):
    # mlx-lm's own loops ignore max_call_tokens: each row still sees its own sinks.
    kw = dict(sinks=S, window=W, slack=8, stride=4)
    one = feed(tiny_llama, make_sink_cache(tiny_llama, **kw), TOKENS, 1)
    cache = make_sink_cache(tiny_llama, **kw)
    out, i = [], 0
    while i < len(TOKENS):
        out.append(tiny_llama(mx.array([TOKENS[i : i + 7]]), cache=cache)[0])
        i += 7
    many = mx.concatenate(out)
    assert mx.abs(one - many).max().item() <= 1e-3 * mx.abs(one).max().item()


def test_a_call_spanning_more_sink_moves_than_spare_slots_is_exact(tiny_llama):
    # 20 tokens at stride 2 span 10 sink layouts: more than the spare slots an in-place
    # call has (4), served by concatenation with the logits of one token at a time.
    def run(chunk):
        cache = make_sink_cache(tiny_llama, sinks=S, window=W, slack=32, stride=2)
        feed(tiny_llama, cache, TOKENS[:100], 1)
        assert len(cache[0].ring.sink_layouts(20)) - 1 > cache[0].ring.spare_sets
        if chunk == 1:
            return feed(tiny_llama, cache, TOKENS[100:120], 1)
        return tiny_llama(mx.array([TOKENS[100:120]]), cache=cache)[0]  # one call

    one, many = run(1), run(20)
    assert mx.abs(one - many).max().item() <= 1e-3 * mx.abs(one).max().item()
    assert mx.array_equal(one.argmax(axis=-1), many.argmax(axis=-1))


def test_trim_back_across_a_rebase_is_exact_for_mla():
    # MLA keeps the roped part in the values slot: the undo copy must be of that slot.
    from tests import archs

    model, vocab = archs.build("deepseek_v3")
    tokens = [t % vocab for t in TOKENS]
    cache = make_sink_cache(model, sinks=S, window=W, slack=8, stride=8)
    assert cache[0].move.slot == 1
    r = cache[0].rebase_every * 2
    feed(model, cache, tokens[:9], 8)
    assert mlx_cache.trim_prompt_cache(cache, 1) == 1
    feed(model, cache, tokens[8 : r - 1], 8)
    expected = copy.deepcopy(cache)
    model(mx.array([tokens[r - 1 : r + 2]]), cache=cache)  # crosses into the rebase
    model(mx.array([tokens[r + 2 : r + 3]]), cache=cache)  # this call rebases
    assert cache[0].layout.base != expected[0].layout.base
    assert mlx_cache.trim_prompt_cache(cache, 4) == 4
    nxt = mx.array([tokens[r - 1 : r + 3]])
    assert mx.array_equal(model(nxt, cache=cache), model(nxt, cache=expected)).item()


@pytest.mark.parametrize("first", [0, 1])
def test_mlx_lms_default_prefill_gives_token_by_token_rows(first):
    """mlx-lm's prefill (2048-token steps) feeds a 300-token prompt through a 64-token
    window in one call. The rows past the first rebase (token 128) attend over copies of
    the sinks that very call writes: they were copied before it wrote them (zeros, 0.3
    off in the logits, silently). Every row must equal token by token."""
    import random

    model = tiny.make_model("llama", scale=1.0)  # logits of ~1: rounding stays < 1e-5
    rng = random.Random(1)
    prompt = [rng.randrange(3, 94) for _ in range(300)]

    def rows(chunks: list[int]) -> mx.array:
        cache = make_sink_cache(model, sinks=4, window=64)
        out, i = [], 0
        for n in chunks:
            out.append(model(mx.array(prompt[i : i + n])[None], cache=cache)[0])
            i += n
        return mx.concatenate(out, axis=0)

    ref = rows([1] * 300)
    got = rows([1] * first + [300 - first])
    assert float(mx.abs(got - ref).max()) < 1e-4
    cache = make_sink_cache(model, sinks=4, window=64)  # and mlx-lm's own loop
    step = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=1)
    (_, logprobs) = next(step)
    last = ref[-1] - mx.logsumexp(ref[-1])
    assert float(mx.abs(logprobs - last).max()) < 1e-4


def test_a_tail_reserved_after_allocation_pads_the_buffers_and_stays_out_of_state():
    """``storage.reserve_tail`` on buffers already allocated: the ring's slots keep their
    values, the tail is zeros, and ``state``/``nbytes`` (what is saved and counted) do
    not see it; a storage that keeps no tail refuses in one line."""
    model = tiny.make_model("llama", seed=1)
    cache = make_sink_cache(model, S, W)
    feed(model, cache, TOKENS[: W + 9], 1)
    c = cache[0]
    before, nbytes = [mx.array(x) for x in c.state], c.nbytes
    c.storage.reserve_tail(8)
    assert c.keys.shape[2] == before[0].shape[2] + 8 and c.storage.tail == 8
    assert all(mx.array_equal(a, b) for a, b in zip(c.state, before)) and c.nbytes == nbytes
    assert not mx.any(c.keys[:, :, -8:]).item()
    quantized = make_sink_cache(model, S, W, kv_bits=4, key_bits=8)[0]
    with pytest.raises(Unsupported, match="keeps no slots after its ring"):
        quantized.storage.reserve_tail(8)
