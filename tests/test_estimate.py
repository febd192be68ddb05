"""The memory estimate is exact: it equals what built caches and loaded weights hold."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_stream.cache.estimate import (
    cache_bytes,
    check_fits,
    config_layout,
    folder_estimate,
    model_layout,
    weights_bytes,
)
from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.cache.spec import make_checked_sink_cache
from mlx_stream.errors import UserError
from tests import tiny

CASES = [
    ("llama", {}),
    ("llama", {"positions": "absolute"}),
    ("llama", {"kv_bits": 4, "kv_group_size": 32}),
    # 4-bit keys are per channel (kvquant): window 40 + slack 16 rounds up to 64 slots.
    ("llama", {"kv_bits": 4, "kv_group_size": 32, "positions": "absolute"}),
    ("llama", {"kv_bits": 8, "kv_group_size": 32}),
    ("llama", {"kv_bits": 4, "key_bits": 8, "kv_group_size": 32}),
    ("qwen2", {}),
    ("gemma3_text", {}),  # sliding layers keep their own caches: only the global one counts
]


@pytest.mark.parametrize("arch, options", CASES)
def test_cache_estimate_equals_nbytes(arch, options):
    extra = {"num_attention_heads": 2, "num_key_value_heads": 1} if arch == "llama" else {}
    model = tiny.make_model(arch, **extra)
    sinks, window, slack = 4, 40, 16
    layout = model_layout(model)
    expected = cache_bytes(layout, sinks, window, slack, **options)
    caches = make_sink_cache(model, sinks, window, slack, **options)
    model(mx.array([tiny.random_tokens(8)]), cache=caches)
    mx.eval([c.state for c in caches])
    assert sum(c.nbytes for c in caches if hasattr(c, "sinks")) == expected
    if arch != "gemma3_text":  # the config counts every layer
        assert config_layout(tiny.make_config(arch, **extra), 4) == layout


def test_weights_estimate_equals_the_loaded_model(tiny_model_dir):
    from mlx_stream.models import loader

    model, _ = loader.load(str(tiny_model_dir))
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert weights_bytes(tiny_model_dir, "float32") == loaded
    assert folder_estimate(tiny_model_dir, "float32", 4, 32)["weights_bytes"] == loaded


def test_too_large_is_refused_with_both_figures(tiny_llama):
    with pytest.raises(UserError, match=r"needs 2\.00 GB but only 1\.0 MB"):
        check_fits(2 * 10**9, "the cache", available=10**6)
    check_fits(10**6, "the cache", available=10**6)
    with pytest.raises(UserError, match="needs .* TB"):
        make_checked_sink_cache(tiny_llama, 4, 10**12)
    with pytest.raises(UserError, match="window must be at least 1"):
        make_checked_sink_cache(tiny_llama, 4, 0)


@pytest.mark.real_model
def test_real_model_estimate_is_exact(real_model_path):
    """The default model is stored 4-bit and dequantized to float32 on CPU: the estimate
    from its files equals what loading it takes, and its full cache at window 1024."""
    from mlx_stream.models import loader

    model, _ = loader.load(str(real_model_path))
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    estimate = folder_estimate(real_model_path, "float32", 4, 1024)
    assert estimate["weights_bytes"] == loaded
    assert estimate["kv_cache_bytes"] == cache_bytes(model_layout(model), 4, 1024)
    slots = 4 + 1024  # slack 0 by default; spare sinks are columns of a call, not slots
    assert estimate["kv_cache_bytes"] == 30 * (2 * 3 * 64 * 4 * slots + 3 * 4 * 64 * 4)


def test_engine_entry_points_check_before_allocating(tiny_llama, tokenizer):
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.eval.perplexity import stream_perplexity
    from mlx_stream.generate.decode import stream_generate

    with pytest.raises(UserError, match="needs"):
        next(
            stream_generate(tiny_llama, tokenizer, [1, 2, 3], prompt_cache=CacheSpec(window=10**12))
        )
    with pytest.raises(UserError, match="needs"):
        stream_perplexity(tiny_llama, [1, 2, 3], window=10**12)


def test_a_group_size_that_cannot_quantize_is_a_user_error(tiny_llama):
    with pytest.raises(UserError, match="--kv-group-size 32 does not divide .* 16"):
        make_checked_sink_cache(tiny_llama, 4, 32, kv_bits=4, kv_group_size=32)
