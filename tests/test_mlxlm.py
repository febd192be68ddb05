"""Each assumption ``mlx_stream.mlxlm`` makes about mlx-lm's private and undocumented
names, checked against the installed mlx-lm: an upgrade that breaks one fails here."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_stream import mlxlm
from tests import tiny


def test_every_name_resolves():
    for name in mlxlm.__all__:
        assert getattr(mlxlm, name) is not None, name
    assert set(mlxlm.__all__) <= set(dir(mlxlm))
    with pytest.raises(AttributeError, match="no_such_name"):
        mlxlm.no_such_name  # noqa: B018


def test_base_cache_is_the_base_of_mlx_lms_caches_with_its_defaults():
    from mlx_lm.models import cache

    for kind in (cache.KVCache, cache.RotatingKVCache, cache.QuantizedKVCache, cache.ArraysCache):
        assert mlxlm.BaseCache in kind.__mro__, kind

    class Bare(mlxlm.BaseCache):
        pass

    bare = Bare()
    assert (bare.state, bare.is_trimmable(), bare.size()) == ([], False, 0)
    assert cache.can_trim_prompt_cache([bare]) is False


def test_model_classes_are_the_model_and_its_args_with_mlx_lms_remapping():
    from mlx_lm.models import llama

    config, want = tiny.make_config("llama"), (llama.Model, llama.ModelArgs)
    assert mlxlm.model_classes(config) == want
    assert mlxlm.model_classes({**config, "model_type": "mistral"}) == want
    with pytest.raises(ValueError, match="not supported"):
        mlxlm.model_classes({**config, "model_type": "no_such_model"})


def test_hf_tokenizer_is_the_tokenizer_the_wrapper_holds():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = tiny.make_hf_tokenizer()
    assert mlxlm.hf_tokenizer(TokenizerWrapper(hf)) is hf
    plain = SimpleNamespace(encode=hf.encode)
    assert mlxlm.hf_tokenizer(plain) is plain


def test_byte_decoder_maps_gpt2_characters_to_all_256_bytes():
    table = mlxlm.byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert (table["Ġ"], table["Ċ"], table["a"]) == (32, 10, ord("a"))


LONGROPE = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "longrope", "original_max_position_embeddings": 1024, **LONGROPE},
        {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    ],
    ids=lambda s: s["rope_type"],
)
def test_mlx_lms_ropes_keep_their_frequencies_under_a_known_name(scaling):
    from mlx_lm.models.rope_utils import initialize_rope

    rope = initialize_rope(16, 10000.0, False, scaling, max_position_embeddings=8192)
    freqs = mlxlm.rope_freqs(rope)
    assert freqs is not None and freqs.shape == (8,), type(rope).__name__


def test_the_text_state_machine_holds_back_a_stop_string_and_ends_on_it():
    machine = mlxlm.TextStateMachine({"normal": [("STOP", None)]})
    state = machine.make_state("normal")
    state, text, name = machine.step(state, "say ST")
    assert (text, name) == ("say ", "normal")  # "ST" may begin the stop string
    _, text, name = machine.step(state, "OP and more")
    assert (text, name) == ("", None)
    state = machine.make_state("normal")
    state, text, _ = machine.step(state, "almost ST")
    _, tail, name = machine.flush(state)
    assert (text, tail, name) == ("almost ", "ST", "normal")
    plain = mlxlm.TextStateMachine(None)
    assert plain.step(plain.make_state("normal"), "STOP it")[1:] == ("STOP it", "normal")


def test_generation_stream_is_the_one_mlx_lms_decoding_runs_on():
    from mlx_lm.generate import generate_step, speculative_generate_step

    for step in (generate_step, speculative_generate_step):
        assert inspect.signature(step).parameters["stream"].default is mlxlm.generation_stream
    mx.synchronize(mlxlm.generation_stream)


def wrapped(fn) -> list:
    """``fn`` and the functions it wraps: each wrapper closes over the one it wraps."""
    chain = [fn]
    while chain[-1].__closure__:
        inner = [c.cell_contents for c in chain[-1].__closure__]
        inner = [f for f in inner if inspect.isfunction(f)]
        if not inner:
            break
        chain.append(inner[0])
    return chain


def parameters_of(fn) -> list[tuple]:
    """Each parameter's name, kind and default (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_attention_wrappers_take_mlx_lms_parameters():
    from mlx_lm.models import base, llama

    from mlx_stream.cache import attention
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.recall import hook

    parameters = inspect.signature(base.scaled_dot_product_attention).parameters
    assert tuple(parameters) == mlxlm.ATTENTION_PARAMETERS
    assert parameters["sinks"].default is None
    assert getattr(llama, mlxlm.ATTENTION_NAME) is not None  # a model module imports it
    model = tiny.make_model("llama")
    CacheSpec(sinks=2, window=16, kv_bits=4).build(model, check_memory=False)  # qattend's
    hook.install(model, [0, 1], "tiny")  # recall's
    chain = wrapped(getattr(llama, mlxlm.ATTENTION_NAME))
    assert chain[-1] is base.scaled_dot_product_attention
    assert attention.patched(llama) and len(chain) == 2  # one wrapper serves both
    for f in chain:
        assert parameters_of(f) == parameters_of(base.scaled_dot_product_attention)


def test_a_cache_with_bits_gets_mlx_lms_quantized_attention():
    from mlx_lm.models.base import scaled_dot_product_attention as attention

    q = mx.random.normal((1, 4, 3, 64), key=mx.random.key(0))
    k, v = (mx.random.normal((1, 2, 5, 64), key=mx.random.key(i)) for i in (1, 2))
    packed = [mx.quantize(x, group_size=32, bits=8) for x in (k, v)]
    cache, float_cache = SimpleNamespace(), SimpleNamespace()
    mlxlm.use_quantized_attention(cache, 8, 32)
    assert mlxlm.takes_quantized_attention(cache)
    assert not mlxlm.takes_quantized_attention(float_cache)
    # (mlx-lm's quantized route scales its queries in place: a copy each call)
    got = attention(mx.array(q), *packed, cache=cache, scale=0.125, mask=None)
    keys, values = (mx.dequantize(*p, group_size=32, bits=8) for p in packed)
    want = attention(mx.array(q), keys, values, cache=float_cache, scale=0.125, mask=None)
    assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4).item()
    with pytest.raises((TypeError, ValueError)):  # packed tuples on the float route
        attention(mx.array(q), *packed, cache=float_cache, scale=0.125, mask=None)


def test_batch_caches_are_the_batch_generators_per_layer_caches(tiny_llama):
    from mlx_lm.generate import BatchGenerator

    prompts = [tiny.random_tokens(6, seed=1), tiny.random_tokens(9, seed=2)]
    gen = BatchGenerator(tiny_llama, max_tokens=4, completion_batch_size=2, prefill_batch_size=2)
    try:
        gen.insert(prompts)
        while not gen.next_generated():
            pass
        caches = mlxlm.batch_caches(gen)
        assert len(caches) == len(tiny_llama.layers)
        assert all(c.state[0].shape[0] == 2 for c in caches)  # one row per prompt
    finally:
        gen.close()
