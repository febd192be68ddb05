"""Where positions live: the ring layout without a model, the per-layer moves the
self-check finds, and refusals of layers no move fits."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from typer.testing import CliRunner

from mlx_stream.cache.positions import Move
from mlx_stream.cache.ring import InPlaceRing, Ring
from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.errors import Unsupported, UserError
from tests import tiny
from tests.support.cli import assert_one_line_error


@pytest.mark.parametrize("in_place", [False, True])
def test_ring_rows_see_sinks_and_their_window_without_a_model(in_place):
    ring = (InPlaceRing if in_place else Ring)(
        sinks=2, window=4, slack=2, stride=1, positions="cache"
    )
    ring.write(20)
    seen = ring.visible(3)
    # In place: the slots (spare sink copies after the ring). Otherwise the buffer as it
    # was (8 slots), the two spare sink copies as columns, then the call's 3 tokens.
    assert seen.shape == (3, ring.slots_total if in_place else 8 + 2 * 2 + 3)
    assert (seen.sum(axis=1) == 2 + 4).all()
    if not in_place:
        assert seen[:, -3:].tolist() == [[True, False, False], [True, True, False], [True] * 3]
    # A 3-row call crosses two sink moves: later rows see the sinks in a spare copy.
    assert seen[0, :2].all() and not seen[1, :2].any() and not seen[2, :2].any()
    assert seen[1, 8:10].all() and seen[2, 10:12].all()


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("window_size", [None, 5])
def test_a_decode_steps_mask_is_the_definition_after_writes_and_rollbacks(in_place, window_size):
    # visible(1) takes a short path past the first eviction: check it against the
    # definition (a slot is seen if its token is a sink or in the row's window) while
    # the ring fills, wraps and rolls back.
    ring = (InPlaceRing if in_place else Ring)(
        sinks=3, window=8, slack=4, stride=2, positions="cache"
    )
    rng = np.random.default_rng(0)
    for _ in range(120):
        if ring.tokens_seen > 20 and rng.random() < 0.2:
            ring.forget(int(rng.integers(1, ring.slack + 2)))
        ring.write(1)
        n = ring.tokens_seen
        t = ring.slots.copy()
        t[ring.slot(n)] = n
        want = (t >= 0) & (t <= n) & ((t < 3) | (t > n - 8))
        if window_size is not None:
            want &= t > n - window_size
        got = ring.visible(1, window_size)
        assert got.shape == (1, ring.fetched(1))
        assert got[0].tolist() == want[: ring.fetched(1)].tolist()


def test_ring_positions_stay_bounded():
    ring = Ring(sinks=4, window=32, slack=8, stride=8, positions="cache")
    for _ in range(100):
        ring.write(ring.max_call_tokens())
        assert 0 <= ring.offset < ring.max_offset
    assert ring.tokens_seen > 10 * ring.capacity


def test_unsupported_is_a_user_error_and_a_value_error():
    assert issubclass(Unsupported, UserError) and issubclass(Unsupported, ValueError)
    assert Unsupported.exit_code == 2


def test_self_check_finds_keys_moved_by_the_rope():
    model = tiny.make_model("llama", num_hidden_layers=1)
    (cache,) = make_sink_cache(model, sinks=4, window=16)
    assert cache.move.slot == 0 and cache.move.rope is model.layers[0].self_attn.rope


def test_tail_move_turns_only_the_roped_dims():
    rope = nn.RoPE(8, base=10000)
    x = mx.random.normal((1, 2, 3, 24), key=mx.random.key(0))
    moved = Move(0, rope, "tail")(x, 5)
    assert mx.array_equal(moved[..., :16], x[..., :16]).item()
    assert mx.allclose(moved[..., 16:], rope(x[..., 16:].reshape(6, 1, 1, 8), 5).reshape(
        1, 2, 3, 8), atol=1e-6).item()  # fmt: skip


class DriftingRope(nn.Module):
    """A rope that also scales with the absolute position: not a rotation."""

    def __init__(self, rope):
        super().__init__()
        self.inner = rope

    def __call__(self, x, offset=0):
        return self.inner(x, offset=offset) * (1.0 + 0.01 * offset)


def test_a_layer_no_move_fits_is_refused_in_one_line():
    model = tiny.make_model("llama", num_hidden_layers=1)
    attn = model.layers[0].self_attn
    attn.rope = DriftingRope(attn.rope)
    with pytest.raises(Unsupported, match=r"^llama: layer 0: .*keys change with position"):
        make_sink_cache(model, sinks=4, window=16)
    # mlx-lm's absolute positions never move anything: still served.
    assert make_sink_cache(model, sinks=4, window=16, positions="absolute")


def read_offset(layer, scale: float) -> None:
    """Make ``layer`` add ``scale`` x its cache offset to its output. As the last layer
    its caches do not change with position (nothing after it caches): only the logits."""
    base = type(layer)

    class OffsetReader(base):
        def __call__(self, x, mask=None, cache=None):
            return base.__call__(self, x, mask, cache) + scale * (cache.offset if cache else 0)

    layer.__class__ = OffsetReader


@pytest.mark.parametrize("scale", [1.0, 1e-2])
def test_logits_that_read_the_offset_are_refused_even_weakly(scale):
    """The offset a cache hands the model cycles over about a window and a rebase
    (1,027-2,051 at window 1024): a dependence too weak to show over a few positions
    must still be refused (a 1e-2 scale changes the logits 0.2% over 37 positions,
    under the check's tolerance, and by several percent over a thousand)."""
    model = tiny.make_model("llama", num_hidden_layers=2)
    read_offset(model.layers[-1], scale)
    with pytest.raises(Unsupported, match=r"^llama: its logits depend on absolute positions"):
        make_sink_cache(model, sinks=4, window=16)
    assert make_sink_cache(model, sinks=4, window=16, positions="absolute")


def test_models_check_prints_the_verdict_per_layer_type(tiny_model_dir):
    from cli.main import app

    result = CliRunner().invoke(app, ["models", "check", str(tiny_model_dir)])
    assert result.exit_code == 0, result.stderr
    assert "layers 0..1 (2): SinkCache: keys, all dims, RoPE" in result.stdout
    assert "verdict: exact" in result.stdout


def test_models_check_refuses_in_one_line(tiny_model_dir, monkeypatch):
    from cli.main import app
    from mlx_stream.cache import positions

    monkeypatch.setattr(positions, "rope_modules", lambda module: [])  # nothing to move with
    result = CliRunner().invoke(app, ["models", "check", str(tiny_model_dir)])  # a new model
    assert_one_line_error(result, 2, "layer 0", "no rope module")


def test_spare_sink_columns_are_ordered():
    ring = Ring(sinks=1, window=2, slack=3, stride=1, positions="cache")
    ring.write(10)
    seen = ring.visible(2)
    spares = seen[1, ring.capacity : ring.fetched(2) - 2]  # before the call's own columns
    assert np.flatnonzero(spares).tolist() == [0]


def test_spare_sinks_respect_a_layer_window():
    ring = Ring(sinks=2, window=4, slack=4, stride=1, positions="cache")
    ring.write(20)
    seen = ring.visible(3, window_size=3)  # a sliding layer narrower than the window
    assert seen.shape == (3, ring.fetched(3))
    assert not seen[:, :2].any() and not seen[:, ring.capacity : ring.fetched(3) - 3].any()


def test_llama4_query_scaling_is_served_only_below_its_limit():
    from tests import archs

    model, _ = archs.build("ministral3")  # original_max_position_embeddings 8192
    assert make_sink_cache(model, sinks=4, window=1024)
    with pytest.raises(Unsupported, match="llama-4 query scaling .* below 8192"):
        make_sink_cache(model, sinks=4, window=8000)
    assert make_sink_cache(model, sinks=4, window=8000, positions="absolute")


def test_cache_list_layers_are_refused_with_their_kind():
    from tests import archs

    model, _ = archs.build("deepseek_v32")
    with pytest.raises(Unsupported, match=r"^deepseek_v32: layer 0 uses a CacheList"):
        make_sink_cache(model, sinks=4, window=16)


def test_keys_and_values_return_what_the_last_update_returned(tiny_llama):
    from tests.support.cache import TOKENS, feed

    cache = make_sink_cache(tiny_llama, sinks=4, window=16, slack=8, stride=4)
    feed(tiny_llama, cache, TOKENS[:50], 1)
    cache[0].keys_and_values()  # a sharing layer reads it at every call from the first
    k = mx.random.normal((1, 2, 3, 16), key=mx.random.key(2))
    fetched = cache[0].update_and_fetch(k, k)  # 3 tokens crossing a stride: spare sinks
    again = cache[0].keys_and_values()
    assert fetched[0].shape == again[0].shape and mx.array_equal(fetched[1], again[1]).item()


@pytest.mark.real_model
def test_the_default_model_passes_the_self_check(real_model_path):
    from cli.main import app

    result = CliRunner().invoke(app, ["models", "check", str(real_model_path)])
    assert result.exit_code == 0, result.stderr
    assert "SinkCache: keys, all dims, RoPE" in result.stdout
    assert "mask:   additive" in result.stdout and "verdict: exact" in result.stdout


def test_a_shared_read_after_a_first_call_past_the_window_is_refused(tiny_llama):
    cache = make_sink_cache(tiny_llama, sinks=4, window=16, stride=64)
    assert cache[0].max_call_tokens() == 20  # our loops end the first call at the window
    k = mx.random.normal((1, 2, 30, 16), key=mx.random.key(3))
    cache[0].update_and_fetch(k, k)  # a foreign loop's first call past the window
    with pytest.raises(Unsupported, match="feed at most max_call_tokens"):
        cache[0].keys_and_values()
