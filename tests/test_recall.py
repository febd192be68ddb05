"""The recall tier (``mlx_stream.recall``): evicted blocks stored, selected by the
queries and attended again in a fixed region.

Equivalences: with ``k`` covering every block, the logits equal a 1-layer oracle
built by hand from the documented layout; chunked == token by token; speculative ==
plain greedy; recall off leaves today's bits. Plus the store's round trips and the
refusals.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_stream.recall.tier as tier_module
from mlx_stream.cache import make_sink_cache
from mlx_stream.cache.positions import Probe
from mlx_stream.errors import Unsupported, UserError
from mlx_stream.generate.decode import generate_step
from mlx_stream.mlxlm import BaseCache
from mlx_stream.recall import RecallSpec, tier_of
from mlx_stream.recall.select import top_k
from mlx_stream.recall.store import BlockStore, bytes_per_token
from tests import tiny
from tests.support.recall import BLOCK, SINKS, WINDOW, feed, recall_cache, spec


@pytest.fixture(scope="module")
def one_layer():
    # Unscaled weights: the default x4 makes softmax so sharp that float rounding of
    # a rotation (1e-6) shows as 1e-3 in some logits.
    return tiny.make_model("llama", seed=2, num_hidden_layers=1, scale=1.0)


class Fixed(BaseCache):
    """Hands attention a fixed list of keys and values plus the new token's."""

    def __init__(self, keys, values, offset):
        self.k, self.v, self.offset = keys, values, offset

    def update_and_fetch(self, keys, values):
        return mx.concatenate([self.k, keys], axis=2), mx.concatenate([self.v, values], axis=2)

    def make_mask(self, N, window_size=None, return_array=False):
        return None


def oracle(model, tokens, q, placement, k_blocks, slack):
    """Logits of row ``q`` attending to what the documented layout holds: every block
    stored before the last stride boundary (wholly past the window at the one before),
    then the window; the sinks
    first and the blocks after them (``stream``), or the blocks right before the token
    the selection was refreshed at (``near``)."""
    from mlx_stream.cache.ring import Ring

    ring = Ring(SINKS, WINDOW, slack, BLOCK, "cache")
    b = q // BLOCK * BLOCK
    base, sink_start = ring.layout(b)
    anchor = sink_start - base
    blocks = max(0, (b - BLOCK - WINDOW + 1) // BLOCK)  # stored at earlier boundaries
    R = k_blocks * BLOCK
    lead = SINKS if placement == "stream" else 0  # stream: the sinks move back by R
    context = []  # (token, position)
    for r, j in enumerate(range(blocks), k_blocks - blocks):
        for i in range(max(0, SINKS - j * BLOCK), BLOCK):
            if placement == "near":  # the blocks end right before the refresh point
                at = b - base - R + r * BLOCK + i
            else:
                at = anchor - R + lead + r * BLOCK + i
            context.append((tokens[j * BLOCK + i], at))
    context += [(tokens[i], anchor + i - (R if lead else 0)) for i in range(SINKS)]
    context += [(tokens[t], t - base) for t in range(max(SINKS, q - WINDOW + 1), q)]
    shift = 10_000  # only distances matter: keep every position positive
    keys, values = [], []
    for token, at in context:
        probe = Probe(at + shift, False, mx.float32)
        model(mx.array([[token]]), cache=[probe])
        keys.append(probe.first[0])
        values.append(probe.first[1])
    cache = Fixed(mx.concatenate(keys, 2), mx.concatenate(values, 2), q - base + shift)
    return model(mx.array([[tokens[q]]]), cache=[cache])[0, -1]


@pytest.mark.parametrize("placement", ["stream", "near"])
def test_recall_of_every_block_equals_the_layout_oracle(one_layer, placement, monkeypatch):
    tokens = tiny.random_tokens(96, seed=5)
    k_blocks = 16  # more than the stream ever stores: every block comes back
    monkeypatch.setattr(
        tier_module, "PLACEMENT", placement
    )  # near: a prompt end's, here at every boundary
    cache = make_sink_cache(one_layer, SINKS, WINDOW, stride=BLOCK,
                            recall=spec(blocks=k_blocks))  # fmt: skip
    got = feed(one_layer, cache, tokens, 1)
    recall = cache[0].hooks
    assert recall.stored == (88 - WINDOW + 1) // BLOCK  # past the window at boundary 88
    checked = 0
    for q in range(WINDOW + 2 * BLOCK, 96, 5):
        want = oracle(one_layer, tokens, q, placement, k_blocks, cache[0].slack)
        err = mx.abs(got[q] - want).max().item() / mx.abs(want).max().item()
        assert err < 1e-4, (q, err)
        checked += 1
    assert checked >= 10
    # and recall changed something: the window alone gives other logits
    plain = feed(one_layer, make_sink_cache(one_layer, SINKS, WINDOW, stride=BLOCK), tokens, 1)
    assert mx.abs(plain[-1] - got[-1]).max().item() > 1e-2 * mx.abs(got[-1]).max().item()


def test_chunked_equals_token_by_token(tiny_llama):
    tokens = tiny.random_tokens(160, seed=7)
    one = recall_cache(tiny_llama)
    chunked = recall_cache(tiny_llama)
    a = feed(tiny_llama, one, tokens, 1)
    b = feed(tiny_llama, chunked, tokens, 64)
    assert one[0].hooks.history == chunked[0].hooks.history
    assert len(one[0].hooks.history) > 5  # selections were made and changed over time
    assert len({entry[1] for entry in one[0].hooks.history}) > 2
    assert mx.array_equal(a.argmax(-1), b.argmax(-1))
    assert mx.abs(a - b).max().item() < 1e-3 * mx.abs(a).max().item()


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 8}])
def test_the_region_in_the_rings_tail_equals_a_region_of_its_own(monkeypatch, kv):
    """Float and same-bits caches keep the region as slots after the ring, so a
    decode step attends one buffer (no copy); its logits, selections and bytes are
    those of a region in a buffer of its own (other caches' way)."""
    from mlx_stream.cache.sink import SinkCache

    model = tiny.make_model("llama", seed=3, hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1)  # head dim 64  # fmt: skip
    tokens = tiny.random_tokens(150, seed=31)
    seen, with_tail = [], SinkCache.with_tail
    monkeypatch.setattr(SinkCache, "with_tail", lambda c: seen.append(with_tail(c)) or seen[-1])
    tail = make_sink_cache(model, SINKS, WINDOW, stride=BLOCK, recall=spec(), **kv)
    a = feed(model, tail, tokens, 1)
    used, seen[:] = sum(x is not None for x in seen), []
    with monkeypatch.context() as m:
        m.setattr(type(tail[0].storage), "tails", False)
        own = make_sink_cache(model, SINKS, WINDOW, stride=BLOCK, recall=spec(), **kv)
    b = feed(model, own, tokens, 1)
    ta, tb = tail[0].hooks, own[0].hooks
    assert tail[0].storage.tail == ta.region.slots(tail[0]) > 0 and own[0].storage.tail == 0
    assert used > 10 and not any(x is not None for x in seen)  # one buffer, or joined
    assert ta.history == tb.history and ta.selection
    assert mx.array_equal(a.argmax(-1), b.argmax(-1))
    assert mx.abs(a - b).max().item() < 1e-5 * mx.abs(a).max().item()
    assert ta.device_nbytes == tb.device_nbytes > 0
    assert sum(c.nbytes for c in tail) == sum(c.nbytes for c in own)  # the tail: region's


def test_selection_is_deterministic(tiny_llama):
    tokens = tiny.random_tokens(120, seed=9)
    runs = []
    for _ in range(2):
        cache = recall_cache(tiny_llama)
        feed(tiny_llama, cache, tokens, 8)
        runs.append(cache[0].hooks.history)
    assert runs[0] == runs[1]
    # ties go to the earlier block, in stream order
    assert top_k(np.array([1.0, 3.0, 3.0, 0.5, 3.0]), 2) == (1, 2)
    assert top_k(np.array([1.0, 2.0, -np.inf]), 3) == (0, 1)


def greedy(model, cache, prompt, **kw):
    return [t for t, _, _ in generate_step(prompt, model, cache, max_tokens=48, **kw)]


@pytest.mark.parametrize("num_draft_tokens", [2, 3])
def test_speculative_greedy_equals_plain_greedy(tiny_llama, tiny_draft, num_draft_tokens):
    prompt = tiny.random_tokens(100, seed=11)
    plain = greedy(tiny_llama, recall_cache(tiny_llama), prompt)
    # The draft's cache rolls back a verify block: slack num_draft_tokens + 1 (default 0)
    draft = make_sink_cache(tiny_draft, SINKS, WINDOW, num_draft_tokens + 1, stride=BLOCK)
    cache = recall_cache(tiny_llama) + draft
    spec_tokens = greedy(tiny_llama, cache, prompt, draft_model=tiny_draft,
                         num_draft_tokens=num_draft_tokens)  # fmt: skip
    assert spec_tokens == plain
    assert cache[0].hooks.selection  # recall was in use


def test_prefill_chunking_does_not_change_generation(tiny_llama):
    prompt = tiny.random_tokens(130, seed=13)
    a = greedy(tiny_llama, recall_cache(tiny_llama), prompt, prefill_step_size=8)
    b = greedy(tiny_llama, recall_cache(tiny_llama), prompt, prefill_step_size=512)
    assert a == b


def test_recall_off_keeps_todays_bits():
    model = tiny.make_model("llama", seed=4)
    tokens = tiny.random_tokens(90, seed=3)
    before = feed(model, make_sink_cache(model, SINKS, WINDOW, stride=BLOCK), tokens, 8)
    recall_cache(model)  # installs the attention hook in the model's module
    after = feed(model, make_sink_cache(model, SINKS, WINDOW, stride=BLOCK), tokens, 8)
    assert mx.array_equal(before, after)


def test_rollback_restores_store_and_selection(tiny_llama):
    tokens = tiny.random_tokens(120, seed=17)
    cache = recall_cache(tiny_llama)
    feed(tiny_llama, cache, tokens[:100], 1)
    recall = cache[0].hooks
    state = (recall.history[:], recall.selection)
    feed(tiny_llama, cache, tokens[100:105], 1)  # crosses the boundary at 104
    assert recall.history != state[0]
    for c in cache:
        c.trim(5)
    assert (recall.history, recall.selection) == state
    a = feed(tiny_llama, cache, tokens[100:], 1)
    fresh = recall_cache(tiny_llama)
    b = feed(tiny_llama, fresh, tokens, 1)[100:]
    assert mx.array_equal(a.argmax(-1), b.argmax(-1))


# ----- refusals ----------------------------------------------------------------------


class _NoHookAttention(nn.Module):
    """A llama attention calling mx.fast directly (the recall hook never sees it)."""

    def __call__(self, x, mask=None, cache=None):
        inner = self.inner
        B, L, _ = x.shape
        q = inner.q_proj(x).reshape(B, L, inner.n_heads, -1).transpose(0, 2, 1, 3)
        k = inner.k_proj(x).reshape(B, L, inner.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = inner.v_proj(x).reshape(B, L, inner.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = inner.rope(q, offset=cache.offset), inner.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=inner.scale, mask=mask)
        return inner.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_an_architecture_the_hook_cannot_reach_is_refused():
    model = tiny.make_model("llama", seed=6)
    wrapper = _NoHookAttention()
    wrapper.inner = model.layers[1].self_attn
    model.layers[1].self_attn = wrapper
    with pytest.raises(Unsupported, match="cannot see the queries of layer 1"):
        recall_cache(model)


def test_impossible_settings_are_refused(tiny_llama):
    with pytest.raises(Unsupported, match="positions='cache'"):
        make_sink_cache(tiny_llama, SINKS, WINDOW, stride=BLOCK, positions="absolute",
                        recall=spec())  # fmt: skip
    with pytest.raises(Unsupported, match="must equal the cache stride"):
        make_sink_cache(tiny_llama, SINKS, WINDOW, stride=16, recall=spec())
    for bad in ({"blocks": 0}, {"bits": 3}):
        with pytest.raises(Unsupported):
            RecallSpec(**bad)


# ----- the store ---------------------------------------------------------------------


def _block(seed, dtype=mx.float32):
    k = mx.random.normal((1, 2, BLOCK, 64), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, 2, BLOCK, 64), key=mx.random.key(seed + 1)).astype(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_float_store_round_trips_exactly_in_ram_and_on_disk(tmp_path, dtype):
    ram = BlockStore(2, BLOCK)
    disk = BlockStore(2, BLOCK, ram_bytes=0, folder=str(tmp_path / "store"))
    blocks = [_block(s, dtype) for s in range(40)]  # more than one segment
    for store in (ram, disk):
        for j, (k, v) in enumerate(blocks):
            store.put(j % 2, j // 2, k, v)
    assert ram.disk_bytes == 0 and disk.host_bytes == 0 and disk.disk_bytes > 0
    assert len(list((tmp_path / "store").glob("*.npy"))) > 0
    for store in (ram, disk):
        for j, (k, v) in enumerate(blocks):
            gk, gv = store.get(j % 2, j // 2)
            assert gk.dtype == dtype and mx.array_equal(gk, k) and mx.array_equal(gv, v)
    disk.close()


def test_lazy_blocks_spill_and_read_back_exactly_with_delays_between_write_and_read(
    tmp_path, monkeypatch
):
    """MLX is lazy: a block handed to the store may be an unevaluated graph. The store
    writes its evaluated bits before ``put`` returns, so a slow disk (a delay injected
    before every write and every read) never yields a block other than the one put."""
    import os
    import time

    writes, reads = [], []
    pwrite, pread = os.pwrite, os.pread

    def slow_write(fd, data, offset):
        time.sleep(0.002)
        writes.append(offset)
        return pwrite(fd, data, offset)

    def slow_read(fd, n, offset):
        time.sleep(0.002)
        reads.append(offset)
        return pread(fd, n, offset)

    monkeypatch.setattr(os, "pwrite", slow_write)
    monkeypatch.setattr(os, "pread", slow_read)
    store = BlockStore(1, BLOCK, ram_bytes=0, folder=str(tmp_path))
    base = [_block(s, mx.bfloat16) for s in range(6)]
    for j, (k, v) in enumerate(base):  # lazy: nothing below is evaluated before put
        store.put(0, j, k * 2 + 1, mx.flip(v, axis=2))
    assert writes  # every block went through the slow disk
    for j, (k, v) in enumerate(base):
        gk, gv = store.get(0, j)
        assert mx.array_equal(gk, k * 2 + 1) and mx.array_equal(gv, mx.flip(v, axis=2))
    assert len(reads) >= 2 * len(base)
    store.close()


@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.3)])
def test_quantized_store_round_trips_within_quantization_error(tmp_path, bits, tol):
    store = BlockStore(1, BLOCK, bits=bits, ram_bytes=1 << 12, folder=str(tmp_path))
    blocks = [_block(s) for s in range(6)]
    for j, (k, v) in enumerate(blocks):
        store.put(0, j, k, v)
    assert store.disk_bytes > 0  # past the small budget: spilled
    for j, (k, v) in enumerate(blocks):
        gk, gv = store.get(0, j)
        want = mx.dequantize(*mx.quantize(k, group_size=64, bits=bits), group_size=64, bits=bits)
        assert mx.array_equal(gk, want)  # exactly mlx's own quantization of the block
        assert mx.abs(gv - v).max().item() < tol * mx.abs(v).max().item()
    per_token = bytes_per_token(1, 2, 64, 64, 4, bits)
    assert per_token == 2 * 2 * (64 * bits // 8 + 2 * 4)


def test_unwritable_store_folder_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot write the recall store"):
        BlockStore(1, BLOCK, folder=str(blocker / "store"))


def test_recall_cache_uses_the_disk_store_past_its_budget(tiny_llama, tmp_path):
    tokens = tiny.random_tokens(120, seed=21)
    ram = recall_cache(tiny_llama)
    disk = recall_cache(tiny_llama, ram_bytes=0, folder=str(tmp_path / "spill"))
    a = feed(tiny_llama, ram, tokens, 8)
    b = feed(tiny_llama, disk, tokens, 8)
    assert disk[0].hooks.store.disk_bytes > 0
    assert mx.array_equal(a, b)


def test_estimated_bytes_match_built_recall():
    from mlx_stream.cache.estimate import model_layout, recall_bytes

    model = tiny.make_model("llama", seed=3, hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1)  # head dim 64  # fmt: skip
    tokens = tiny.random_tokens(120, seed=23)
    for bits in (None, 8):
        cache = recall_cache(model, bits=bits, group_size=32)
        feed(model, cache, tokens, 8)
        recall = cache[0].hooks
        est = recall_bytes(model_layout(model), SINKS, 4, BLOCK, bits, 32)
        assert recall.device_nbytes == est["region_bytes"]
        layers, (H, kd, _), (_, vd, _) = len(recall.layers), *recall.store.shapes
        per_token = bytes_per_token(layers, H, kd, vd, 4, bits, 32)
        assert recall.store.nbytes == per_token * BLOCK * 32  # one segment of 32 blocks
        # the default selector's index: a minimum and a maximum per head and channel,
        # in the keys' dtype (float32 here), per block and layer
        index = layers * 2 * H * kd * 4 / BLOCK
        assert est["store_bytes_per_1k_tokens"] == int(1000 * (per_token + index))


def test_store_group_size_must_divide_the_head_dim(tiny_llama):
    with pytest.raises(Unsupported, match="does not divide the head dimension 16"):
        recall_cache(tiny_llama, bits=8, group_size=32)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_other_architectures_chunked_equals_token_by_token(arch):
    model = tiny.make_model(arch, seed=8)
    tokens = tiny.random_tokens(120, seed=25)
    one, chunked = recall_cache(model), recall_cache(model)
    a = feed(model, one, tokens, 1)
    b = feed(model, chunked, tokens, 64)
    recall, other = tier_of(one), tier_of(chunked)
    assert recall.history == other.history and recall.selection
    assert mx.array_equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("kv", [{"kv_bits": 8}, {"kv_bits": 4, "key_bits": 8}])
def test_quantized_window_with_recall(kv):
    model = tiny.make_model("llama", seed=3, hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1)  # head dim 64  # fmt: skip
    tokens = tiny.random_tokens(120, seed=27)
    caches = [make_sink_cache(model, SINKS, WINDOW, stride=BLOCK, recall=spec(), **kv)
              for _ in range(2)]  # fmt: skip
    a = feed(model, caches[0], tokens, 1)
    b = feed(model, caches[1], tokens, 64)
    assert caches[0][0].hooks.selection
    assert caches[0][0].hooks.history == caches[1][0].hooks.history
    assert mx.array_equal(a.argmax(-1), b.argmax(-1))
    plain = feed(model, make_sink_cache(model, SINKS, WINDOW, stride=BLOCK, **kv), tokens, 8)
    assert not mx.array_equal(plain, b)  # the region is attended


def test_prompt_end_refreshes_and_feeds_the_prompt_tail_again(tiny_llama):
    prompt = tiny.random_tokens(131, seed=29)
    cache = recall_cache(tiny_llama)
    seen = []
    cache[0].hooks.on_prompt_end = lambda tier, n: seen.append((n, tier.selection))
    list(generate_step(prompt, tiny_llama, cache, max_tokens=1))
    (n, chosen), = seen  # fmt: skip
    assert n == 130 and chosen  # all but the prompt's last token, then a selection
    # rolled back to the start of the last 2 blocks, held until the prompt's end
    assert (120, chosen, 130) in cache[0].hooks.history


def test_a_prompts_selection_sits_near_until_the_next_boundary(tiny_llama):
    """The blocks a prompt's end chooses go ``near`` (right before the re-fed tail),
    the next boundary's back in stream order."""
    prompt = tiny.random_tokens(131, seed=29)
    cache = recall_cache(tiny_llama)
    tier, placed = cache[0].hooks, []
    for _ in generate_step(prompt, tiny_llama, cache, max_tokens=12):
        placed.append((tier.layers[0].tokens_seen, tier.placement, tier.region.applied[0]))
    assert tier.history[-1][0] == 136 and tier.placement == "stream"
    near = [p for n, pl, p in placed if pl == "near"]  # held from the prompt's end to 136
    assert near and all(p[2] == "near" for p in near)
    base, _ = tier.layers[0].ring.layout(120)
    assert near[0][1] == 120 - base  # the region ends right before the re-fed tail
    later = [pl for n, pl, _ in placed if n > 137]
    assert later and set(later) == {"stream"}


def test_a_batch_of_several_sequences_is_refused_at_its_first_call(tiny_llama):
    """Before any token is written (not when the first block would be stored)."""
    cache = recall_cache(tiny_llama)
    with pytest.raises(Unsupported, match="batch 1"):
        tiny_llama(mx.array([[5, 6, 7], [8, 9, 10]]), cache=cache)
    assert all(c.ring.tokens_seen == 0 for c in cache)


@pytest.mark.parametrize("window", [16, 24])
def test_a_chat_with_recall_answers_turn_after_turn(tiny_model_dir, window):
    """Turns of a chat end prompts at every phase of the ring; each prompt's end
    refreshes and feeds its tail again, and no re-fed row attends a block twice (the
    candidates are the blocks none of them can see in its window)."""
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.session import ChatSession, Settings
    from mlx_stream.models.loader import load

    model, tokenizer = load(str(tiny_model_dir))
    cache = CacheSpec(sinks=SINKS, window=window, stride=BLOCK, recall=spec(blocks=2))
    session = ChatSession(model, tokenizer, Settings(cache, max_tokens=5))
    tier, selected = None, 0
    for turn in range(12):
        session.reply(f"turn {turn}: " + "tell me more " * (turn % 4), lambda _: None)
        tier = session.caches[0].hooks
        start, sel, _ = tier.history[-1]
        last_unseen = (start - window + 1) // BLOCK  # wholly before every re-fed row's window
        assert all(j < last_unseen for j in sel), (turn, start, sel)
        selected += bool(sel)
    assert tier.stored > 4 and selected > 4
