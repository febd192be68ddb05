"""Attention on the packed per-channel keys (mlx_stream.cache.qattend): the attention of
the float route over the same columns, a chunk's rows equal to token-by-token rows,
taken only where a probe proves the model hands the packed keys over, and 8-bit keys
kept per token where the recall tier reads them."""

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_stream.cache import (
    CacheSpec,
    SinkCache,
    kvquant,
    load_cache,
    make_sink_cache,
    qattend,
    save_cache,
)
from mlx_stream.cache.hooks import Hooks
from mlx_stream.cache.positions import Move
from mlx_stream.generate.decode import DecodeState, generate_step
from tests import tiny
from tests.support.cache import feed

S, W, G = 4, 40, 32
T, D = 300, 64
SCALE = D**-0.5
BITS = [(8, None), (4, None), (4, 8)]  # (kv_bits, key_bits)


def tensors(H: int, KVH: int):
    shapes = ((1, KVH, T, D), (1, KVH, T, D), (1, H, T, D))
    return [mx.random.normal(shape, key=mx.random.key(i)) for i, shape in enumerate(shapes)]


def run(bits, key_bits, chunk: int, packed: bool, H: int = 4, KVH: int = 2, additive=True):
    """Every row's attention output over ``T`` random tokens fed ``chunk`` at a time
    (crossing group ends, sink moves and rebases), through the packed route or not."""
    keys, values, queries = tensors(H, KVH)
    spec = CacheSpec(S, W, 8, 16, kv_bits=bits, kv_group_size=G, key_bits=key_bits)
    cache = SinkCache(spec, Move(0, nn.RoPE(D)))
    cache.fast_route = packed
    out, n = [], 0
    while n < T:
        N = min(chunk, cache.max_call_tokens(), T - n)
        mask = cache.make_mask(N, return_array=not additive)
        k, v = cache.update_and_fetch(keys[..., n : n + N, :], values[..., n : n + N, :])
        q = queries[..., n : n + N, :]
        if packed:
            assert isinstance(k, qattend.PackedKeys)
            got = qattend.attend(q, k, v, SCALE, mask)
            # The same columns dequantized, through mlx's fast float attention.
            fk, fv = qattend.unpack(k, v)
            ref = mx.fast.scaled_dot_product_attention(q, fk, fv, scale=SCALE, mask=mask)
            assert mx.abs(got - ref).max().item() < 1e-5
        else:
            assert not isinstance(k, qattend.PackedKeys)
            got = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
        out.append(got)
        n += N
    return mx.concatenate(out, axis=2)


@pytest.mark.parametrize(("bits", "key_bits"), BITS)
@pytest.mark.parametrize("chunk", [1, 5, 33])
def test_route_is_float_attention_over_the_same_columns(bits, key_bits, chunk):
    run(bits, key_bits, chunk, packed=True)  # asserts call by call


@pytest.mark.parametrize(("bits", "key_bits"), BITS)
def test_chunks_equal_token_by_token_and_the_dequantize_route(bits, key_bits):
    one = run(bits, key_bits, 1, packed=True)
    for chunk in (5, 16, 33):
        assert mx.abs(run(bits, key_bits, chunk, packed=True) - one).max().item() < 1e-5
    # the boolean mask, and the cache's dequantize route, see the same
    assert mx.abs(run(bits, key_bits, 1, packed=True, additive=False) - one).max().item() < 1e-5
    assert mx.abs(run(bits, key_bits, 1, packed=False) - one).max().item() < 1e-5
    # without GQA too
    a = run(bits, key_bits, 1, packed=True, H=2, KVH=2)
    b = run(bits, key_bits, 7, packed=True, H=2, KVH=2)
    assert mx.abs(a - b).max().item() < 1e-5


def test_a_decode_step_splices_the_residual_into_its_slots():
    cache = SinkCache(CacheSpec(S, W, 8, 16, kv_bits=8, kv_group_size=G), Move(0, nn.RoPE(D)))
    cache.fast_route = True
    keys, values, _ = tensors(2, 2)
    cache.update_and_fetch(keys[..., :50, :], values[..., :50, :])
    mask = cache.make_mask(1)
    k, _ = cache.update_and_fetch(keys[..., 50:51, :], values[..., 50:51, :])
    # token 50 is in group 1 (tokens 36-67): 15 float keys, spliced, one column per slot
    assert (k.splice, k.recent) == (cache.ring.slot(36), 15)
    assert mask.shape[-1] == cache.ring.slots_total
    chunk_mask = cache.make_mask(3)
    k, _ = cache.update_and_fetch(keys[..., 51:54, :], values[..., 51:54, :])
    assert k.splice is None and chunk_mask.shape[-1] == cache.ring.slots_total + k.recent


def test_a_decode_steps_mask_is_the_general_spliced_mask():
    # A decode step's mask takes a short path: the ring's own visibility. Check it
    # against the general form (the per-channel mask with the residual columns folded
    # into their tokens' slots) through group fills, sink moves and rebases.
    cache = SinkCache(CacheSpec(S, W, 8, 16, kv_bits=8, kv_group_size=G), Move(0, nn.RoPE(D)))
    cache.fast_route = True
    keys, values, _ = tensors(2, 2)
    ring, L = cache.ring, cache.ring.slots_total
    checked = 0
    for n in range(T):
        got = np.array(cache.make_mask(1, return_array=True))
        if n >= S + W:
            slots = ring.slots.copy()
            slots[ring.slot(n)] = n
            seen = (slots >= 0) & ((slots < S) | (slots > n - W))
            visible = np.zeros((1, L), dtype=bool)
            visible[0, : len(seen)] = seen
            general = kvquant.mask(visible, slots, n, S, W, None)
            lo, hi = kvquant.recent_range(n, 1, S)
            want = general[:, :L].copy()
            for j, tok in enumerate(kvquant.recent_tokens(n, 1, S)[lo:hi]):
                if tok >= S:
                    want[:, ring.slot(tok)] |= general[:, L + j]
            assert got.tolist() == want.tolist()
            checked += 1
        cache.update_and_fetch(keys[..., n : n + 1, :], values[..., n : n + 1, :])
    assert checked > 5 * G


@pytest.fixture(scope="module")
def model():
    # GQA: 4 query heads over 2 key/value heads, head dimension 64
    return tiny.make_model("llama", hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2, scale=1.0)  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4])
def test_the_model_is_proven_and_decodes_as_the_dequantize_route(model, bits):
    tokens = tiny.random_tokens(200, seed=4)
    routed = make_sink_cache(model, S, W, stride=16, kv_bits=bits, kv_group_size=G)
    assert all(c.fast_route for c in routed)
    floats = copy.deepcopy(routed)
    for c in floats:
        c.fast_route = False
    a, b = feed(model, routed, tokens, 1), feed(model, floats, tokens, 1)
    assert mx.abs(a - b).max().item() < 1e-4 * mx.abs(b).max().item()
    assert mx.array_equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("bits", [8, 4])
def test_checkpoint_round_trips_onto_the_same_route(tmp_path, model, bits):
    tokens = tiny.random_tokens(150, seed=6)
    cache = make_sink_cache(model, S, W, stride=16, kv_bits=bits, kv_group_size=G)
    feed(model, cache, tokens[:141], 7)  # mid-group
    save_cache(tmp_path / "c.safetensors", cache)
    loaded, _ = load_cache(tmp_path / "c.safetensors", model)
    assert all(c.fast_route for c in loaded)  # the model's layers were proven
    for t in tokens[141:]:
        x = mx.array([[t]])
        assert mx.array_equal(model(x, cache=loaded), model(x, cache=cache))


def test_speculative_greedy_equals_plain_greedy_with_eight_bit_keys(model):
    prompt = tiny.random_tokens(20, seed=9)
    kw = {"sinks": S, "window": W, "slack": 16, "stride": 16, "kv_bits": 8, "kv_group_size": G}
    plain = [t for t, _, _ in generate_step(prompt, model, make_sink_cache(model, **kw),
                                            max_tokens=4 * W)]  # fmt: skip
    draft = tiny.make_model("llama", seed=7, num_hidden_layers=1, hidden_size=256,
                            num_attention_heads=4, num_key_value_heads=2, scale=1.0)  # fmt: skip
    state = DecodeState()
    caches = make_sink_cache(model, **kw) + make_sink_cache(draft, **kw)
    out = generate_step(prompt, model, caches, max_tokens=4 * W, draft_model=draft,
                        num_draft_tokens=3, state=state)  # fmt: skip
    assert [t for t, _, _ in out] == plain
    assert state.drafted > state.accepted > 0  # rollbacks happened


@pytest.fixture(scope="module")
def bf16_model():
    # bfloat16 matmuls give a row the same bits in a block as alone on the CPU (float32
    # ones through OpenBLAS do not: there even mlx-lm's KVCache differs in the last bits)
    m = tiny.make_model("llama", hidden_size=256, num_attention_heads=4,
                        num_key_value_heads=2, scale=1.0)  # fmt: skip
    m.set_dtype(mx.bfloat16)
    return m


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("chunk", [3, 5, 33])
def test_a_chunks_logits_are_token_by_token_logits_bit_for_bit(bf16_model, bits, chunk):
    # Every row of a chunk (a speculative verify block) attends over the columns of a
    # decode step at its token, in the same order: the same bits, not just close ones.
    tokens = tiny.random_tokens(260, seed=12)
    kw = {"sinks": S, "window": W, "slack": 32, "stride": 16, "kv_bits": bits, "kv_group_size": G}
    one = feed(bf16_model, make_sink_cache(bf16_model, **kw), tokens, 1)
    chunked = feed(bf16_model, make_sink_cache(bf16_model, **kw), tokens, chunk)
    assert mx.array_equal(chunked, one)


class _Attention(nn.Module):
    def __init__(self, direct: bool):
        super().__init__()
        self.direct = direct
        self.proj = nn.Linear(16, 3 * D)

    def __call__(self, x, cache):
        B, L, _ = x.shape
        q, k, v = (
            t.reshape(B, L, 1, D).transpose(0, 2, 1, 3) for t in mx.split(self.proj(x), 3, -1)
        )
        mask = cache.make_mask(L)
        k, v = cache.update_and_fetch(k, v)
        if self.direct:  # a model that calls mlx's attention itself
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
        return scaled_dot_product_attention(q, k, v, cache=cache, scale=SCALE, mask=mask)


class _Toy(nn.Module):
    def __init__(self, direct: bool):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = [_Attention(direct)]

    def __call__(self, inputs, cache):
        return self.layers[0](self.embed(inputs), cache[0])


@pytest.mark.parametrize("direct", [False, True])
def test_the_route_is_taken_only_where_the_probe_reaches_it(direct):
    toy = _Toy(direct)
    caches = [SinkCache(CacheSpec(S, W, kv_bits=8, kv_group_size=G, positions="absolute"))]
    assert qattend.install(toy, caches) is not direct
    assert caches[0].fast_route is not direct
    assert caches[0].tokens_seen == 0  # the probe ran on a copy
    out = toy(mx.array([list(range(20))]), caches)  # either way, it runs
    assert out.shape == (1, 1, 20, D)


def test_attention_sinks_take_the_float_route():
    keys, values, queries = tensors(4, 2)
    cache = SinkCache(CacheSpec(S, W, kv_bits=8, kv_group_size=G, positions="absolute"))
    cache.fast_route = True
    cache.update_and_fetch(keys[..., :60, :], values[..., :60, :])
    mask = cache.make_mask(1)
    k, v = cache.update_and_fetch(keys[..., 60:61, :], values[..., 60:61, :])
    q, sinks = queries[..., 60:61, :], mx.array([0.5, -1.0, 2.0, 0.0])
    assert qattend.claims(cache, k)  # the wrapped attention hands the call to the route
    got = qattend.handle(q, k, v, cache, SCALE, mask, sinks, scaled_dot_product_attention)
    fk, fv = qattend.unpack(k, v)
    ref = mx.fast.scaled_dot_product_attention(q, fk, fv, scale=SCALE, mask=mask, sinks=sinks)
    assert mx.allclose(got, ref).item()


def test_eight_bit_keys_stay_per_token_for_recall_and_old_files():
    cache = SinkCache(
        CacheSpec(S, W, kv_bits=8, kv_group_size=G, positions="absolute"), token_keys=True
    )
    assert not cache.channel_keys and cache.bits == 8  # mlx-lm's quantized kernel
    keys, values, _ = tensors(2, 2)
    cache.update_and_fetch(keys[..., :70, :], values[..., :70, :])
    meta = cache.meta_state
    assert meta["token_keys"] is True
    del meta["token_keys"]  # a file from before 8-bit keys went per channel
    old = SinkCache()
    old.meta_state = meta
    old.state = cache.state
    assert not old.channel_keys and isinstance(old.keys, tuple)
    a = old.update_and_fetch(keys[..., 70:71, :], values[..., 70:71, :])
    b = cache.update_and_fetch(keys[..., 70:71, :], values[..., 70:71, :])
    assert all(mx.array_equal(x, y).item() for x, y in zip(a[0], b[0]))


def test_a_cache_feeding_the_recall_tier_returns_floats():
    # The recall tier attends on floats: a proven per-channel cache it is attached to
    # does not hand over packed keys, and its mask has the unspliced columns.
    keys, values, _ = tensors(2, 2)
    cache = SinkCache(CacheSpec(S, W, kv_bits=4, kv_group_size=G, positions="absolute"))
    cache.fast_route = True
    cache.attach(type("Tier", (Hooks,), {"attends": True})(), 0)  # a client taking attention
    cache.update_and_fetch(keys[..., :50, :], values[..., :50, :])
    mask = cache.make_mask(1)
    k, v = cache.update_and_fetch(keys[..., 50:51, :], values[..., 50:51, :])
    assert isinstance(k, mx.array) and k.shape[-2] == v.shape[-2] == mask.shape[-1]
    assert mask.shape[-1] > cache.ring.slots_total  # the residual as extra columns
