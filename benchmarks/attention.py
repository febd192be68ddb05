"""Decode attention per cache: what the sink cache's design costs per token.

One decode step's attention for every layer of the model and nothing else: the first
layer's cache builds the mask for one token (``make_mask``, once per token as mlx-lm
models do), then each layer's cache takes the token's keys and values
(``update_and_fetch``) and feeds ``mx.fast.scaled_dot_product_attention``, on caches
already past their first eviction. Keys, values and queries are random in the
model's shapes; the model's matmuls are left out, so the figures isolate the cache.
Contenders, timed round-robin:

- ``rotating``: mlx-lm's ``RotatingKVCache(max_size=sinks+window, keep=sinks)``:
  ``sinks + window`` keys, no mask;
- ``sink``: mlx-stream's SinkCache as an mlx-lm model gets it: ``sinks + window +
  slack`` keys (the slack keeps speculative rollback exact) and the additive mask;
- ``sink-bool``: the same cache with the boolean mask that models asking for an array
  get (``return_array=True``), which every model got before the additive form.

One JSON line per contender: median milliseconds per token over all layers and the
ratio to ``rotating``.

    python benchmarks/attention.py                     # default model's shapes, < 1 min
    python benchmarks/attention.py --window 4096
"""

from __future__ import annotations

import time

import common

CONTENDERS = ("rotating", "sink", "sink-bool")


def shapes(model) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of the model's attention."""
    args = model.args
    heads = args.num_attention_heads
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    return heads, kv_heads, head_dim


def make_caches(model, sinks: int, window: int) -> dict[str, list]:
    from mlx_lm.models.cache import RotatingKVCache

    from mlx_stream.cache.sink import make_sink_cache

    return {
        "rotating": [RotatingKVCache(max_size=sinks + window, keep=sinks) for _ in model.layers],
        "sink": make_sink_cache(model, sinks, window),
        "sink-bool": make_sink_cache(model, sinks, window),
    }


def fill(caches: list, kv_heads: int, head_dim: int, tokens: int, chunk: int, dtype) -> None:
    """Feed ``tokens`` random keys/values to every layer's cache, ``chunk`` at a time
    (within what a SinkCache admits per call)."""
    import mlx.core as mx

    from mlx_stream.cache.sink import max_call_tokens

    done = 0
    while done < tokens:
        n = min(chunk, tokens - done, max_call_tokens(caches) or chunk)
        kv = mx.random.normal((2, 1, kv_heads, n, head_dim), key=mx.random.key(done)).astype(dtype)
        mx.eval([c.update_and_fetch(kv[0], kv[1]) for c in caches])
        done += n


def step(caches: list, q, k, v, scale: float, boolean: bool) -> tuple[list, int]:
    """One decode token's attention over every layer: (lazy outputs, keys attended)."""
    import mlx.core as mx

    outs = []
    mask = caches[0].make_mask(1, return_array=boolean)  # once per token, as models do
    for c in caches:
        keys, values = c.update_and_fetch(k, v)
        outs.append(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask))
    return outs, keys.shape[-2]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=300, help="timed tokens per contender")
    args = parser.parse_args(argv)
    if args.quick:
        args.window, args.rounds = 32, 6
    import mlx.core as mx

    model, _, weights = common.load_model(args.model, args.dtype)
    heads, kv_heads, head_dim = shapes(model)
    dtype = {"bfloat16": mx.bfloat16, "float16": mx.float16}.get(weights, mx.float32)
    caches = make_caches(model, args.sinks, args.window)
    past = args.sinks + args.window + 3 * 64  # past the first eviction and a rebase
    for cache in caches.values():
        fill(cache, kv_heads, head_dim, past, 64, dtype)
    key = mx.random.key(1)
    q = mx.random.normal((1, heads, 1, head_dim), key=key).astype(dtype)
    k, v = mx.random.normal((2, 1, kv_heads, 1, head_dim), key=key).astype(dtype)
    scale = head_dim**-0.5
    times: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    keys = {}
    for i in range(args.rounds + 3):  # the first 3 rounds warm up
        for name in CONTENDERS:
            tic = time.perf_counter()
            outs, keys[name] = step(caches[name], q, k, v, scale, boolean=name == "sink-bool")
            mx.eval(outs)
            if i >= 3:
                times[name].append(1e3 * (time.perf_counter() - tic))
    base = common.base_record(
        "attention",
        args.model,
        weights,
        sinks=args.sinks,
        window=args.window,
        layers=len(model.layers),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rounds=args.rounds,
    )
    p50 = {n: common.percentile(t, 50) for n, t in times.items()}
    records = []
    for name in CONTENDERS:
        record = dict(
            base,
            contender=name,
            keys=keys[name],
            ms_per_token=round(p50[name], 3),
            over_rotating=round(p50[name] / p50["rotating"], 3),
        )
        records.append(common.emit(record, args.out))
    return records


if __name__ == "__main__":
    main()
