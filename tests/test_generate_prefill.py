"""The shared prompt feeding (generate.prefill) and sampler (generate.sampler)."""

import mlx.core as mx

from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.generate.model_config import Sampling
from mlx_stream.generate.prefill import feed_prompt, feed_steps
from mlx_stream.generate.sampler import make_sampling
from tests import tiny

TOKENS = tiny.random_tokens(100, seed=5)


def test_feed_steps_reports_each_call_and_matches_one_step_at_a_time(tiny_llama):
    chunked = make_sink_cache(tiny_llama, 4, 32, 8)
    fed = list(feed_steps([(tiny_llama, chunked)], TOKENS, step=16))
    assert fed[-1] == len(TOKENS) and fed == sorted(set(fed))
    assert all(b - a <= 16 for a, b in zip([0, *fed], fed, strict=False))
    single = make_sink_cache(tiny_llama, 4, 32, 8)
    seen = []
    feed_prompt(tiny_llama, single, TOKENS, step=1, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (len(TOKENS), len(TOKENS)) and len(seen) == len(TOKENS)
    x = mx.array([[7]])
    a, b = tiny_llama(x, cache=chunked), tiny_llama(x, cache=single)
    assert mx.argmax(a[0, -1]).item() == mx.argmax(b[0, -1]).item()


def test_make_sampling_is_greedy_at_zero_and_repeatable_with_a_seed():
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 50), key=mx.random.key(0)), axis=-1))
    greedy, processors = make_sampling(Sampling())
    assert greedy(logprobs).item() == mx.argmax(logprobs, axis=-1).item() and processors == []
    sample = Sampling(temp=1.0, repetition_penalty=1.1)
    draws = []
    for _ in range(2):
        sampler, processors = make_sampling(sample, seed=3)
        draws.append([sampler(logprobs).item() for _ in range(8)])
    assert draws[0] == draws[1] and len(processors) == 1
