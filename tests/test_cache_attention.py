"""The one patch of mlx-lm's attention function (mlx_stream.cache.attention): wrapped once
per module whatever handlers use it, left as it was by a probe that fails, put back by
restore, and the packed-keys route and the recall tier served by the same wrapper."""

import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import scaled_dot_product_attention

import mlx_stream.recall.hook as hook
from mlx_stream.cache import CacheSpec, SinkCache, attention, qattend
from mlx_stream.cache.hooks import Hooks
from mlx_stream.cache.positions import Move
from mlx_stream.errors import Unsupported

D, SCALE = 32, 32**-0.5
HERE = sys.modules[__name__]  # the module of the toy models below


class _Attention(nn.Module):
    def __init__(self, direct: bool = False, fails: bool = False):
        super().__init__()
        self.direct, self.fails = direct, fails
        self.proj = nn.Linear(16, 3 * D)

    def __call__(self, x, cache):
        if self.fails:
            raise RuntimeError("no such layer")
        B, L, _ = x.shape
        q, k, v = (
            t.reshape(B, L, 1, D).transpose(0, 2, 1, 3) for t in mx.split(self.proj(x), 3, -1)
        )
        mask = cache.make_mask(L, return_array=False, window_size=None)
        k, v = cache.update_and_fetch(k, v)
        if self.direct:  # a model that calls mlx's attention itself
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)
        return scaled_dot_product_attention(q, k, v, cache=cache, scale=SCALE, mask=mask)


class _Toy(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = [_Attention(**kwargs)]

    def __call__(self, inputs, cache):
        return self.layers[0](self.embed(inputs), cache[0])


def channel_caches(rope=None):
    return [SinkCache(CacheSpec(4, 40, kv_bits=8, kv_group_size=32, positions="absolute"), Move(0, rope))]


@pytest.fixture(autouse=True)
def unwrapped():
    attention.restore([HERE])
    yield
    attention.restore([HERE])


def original() -> bool:
    return HERE.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_one_wrapper_however_many_handlers():
    toy = _Toy()
    assert attention.modules(toy) == [HERE]
    assert qattend.install(toy, channel_caches())
    wrapper = HERE.scaled_dot_product_attention
    hook.install(toy, [0], "toy")
    qattend.install(toy, channel_caches())
    assert HERE.scaled_dot_product_attention is wrapper and attention.patched(HERE)
    attention.restore([HERE])  # one step back: mlx-lm's own function, not a wrapper
    assert original()


@pytest.mark.parametrize("kind", [{"direct": True}, {"fails": True}])
def test_a_failed_probe_leaves_the_function_as_it_was(kind):
    toy = _Toy(**kind)
    assert not qattend.install(toy, channel_caches())
    assert original() and not attention.patched(HERE)
    with pytest.raises(Unsupported, match="cannot see the queries|probe pass failed"):
        hook.install(toy, [0], "toy")
    assert original()


def test_a_failed_probe_keeps_a_wrapper_another_handler_was_proven_on():
    toy = _Toy()
    hook.install(toy, [0], "toy")
    wrapper = HERE.scaled_dot_product_attention
    attention.prove(toy, mlx_cache.make_prompt_cache(toy), "qattend", [0])  # not reached
    assert HERE.scaled_dot_product_attention is wrapper


def test_restore_puts_the_original_back_and_ends_the_route():
    toy, rope = _Toy(), nn.RoPE(D)
    caches = channel_caches(rope)
    assert qattend.install(toy, caches)
    assert SinkCache(CacheSpec(4, 40, kv_bits=8, kv_group_size=32), caches[0].move).fast_route
    attention.restore()
    assert original()
    # a cache made later for the same layer no longer takes the route
    assert not SinkCache(CacheSpec(4, 40, kv_bits=8, kv_group_size=32), caches[0].move).fast_route


class _Tier(Hooks):
    """A client (like the recall tier) that records the attention calls it is handed."""

    attends = True

    def __init__(self):
        self.calls = 0

    def attend(self, cache, queries, keys, values, scale, mask, sinks, original):
        self.calls += 1
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def test_packed_keys_and_recall_share_the_wrapper():
    toy = _Toy()
    routed = channel_caches()
    assert qattend.install(toy, routed)
    hook.install(toy, [0], "toy")
    tokens = mx.array([list(range(12))])
    floats = channel_caches()  # the dequantize route, through the same wrapper
    assert mx.allclose(toy(tokens, routed), toy(tokens, floats), atol=1e-4).item()
    tier, plain = _Tier(), mlx_cache.make_prompt_cache(toy)
    plain[0].hooks = tier
    recalled = toy(tokens, plain)
    assert tier.calls == 1
    assert mx.array_equal(recalled, toy(tokens, mlx_cache.make_prompt_cache(toy)))
