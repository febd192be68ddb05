"""Quantized decode attention: which route is fastest, per window.

One decode step's attention for one layer in the default model's shapes (9 query heads,
3 key/value heads, head dimension 64; random keys, values and query), timed round-robin:

- ``float``: ``mx.fast.scaled_dot_product_attention`` on float32 keys and values;
- ``qmm-8`` / ``dequant-8``: 8-bit keys and values grouped per token (what
  ``kv_bits=8`` stores): mlx-lm's ``quantized_scaled_dot_product_attention``
  (``mx.quantized_matmul`` on the packed keys and values), against dequantizing both and
  calling the fast float attention;
- ``dequant-k4``: what ``kv_bits=4`` does: per-channel 4-bit keys (groups of 32 tokens,
  ``mlx_stream.cache.kvquant``) and per-token 4-bit values dequantized, then fast attention;
- ``qmm-k4`` / ``qmm-k8``: per-channel 4-bit / 8-bit keys attended without
  dequantizing: scores by ``mx.quantized_matmul(q, keys, transpose=False)`` on the keys
  stored transposed (``(D, L)``, quantized along the tokens, as kvquant stores them),
  softmax, then ``mx.quantized_matmul`` on the values (per token, 4 / 8 bits), the
  query heads of a key/value head folded into the rows of one matmul;
- the parts of the 8-bit routes alone: ``scores-tok8`` (per-token keys,
  ``transpose=True``, what mlx-lm's kernel does, heads folded as in ``qmm-k8``),
  ``scores-ch8`` (per-channel keys, ``transpose=False``) and ``values-8``
  (``quantized_matmul(p, V, transpose=False)``, values per token);
- ``cache-k8`` / ``cache-k4``: the whole route a SinkCache with ``kv_bits`` 8 / 4 takes
  (``mlx_stream.cache.qattend.attend``: float sinks, the packed ring, the float residual
  of the open group, the cache's own additive mask, GQA) on a cache filled past its
  first eviction with random keys and values (a decode step in the middle of a group),
  and ``cache-k8-dequant`` / ``cache-k4-dequant``: the same columns dequantized, then the
  fast float attention (what such a cache does where the route is not installed).

One JSON line per (contender, window): median microseconds per call and the ratio to
``float``.

    python benchmarks/quantized_attention.py                # < 2 min on a quiet machine
"""

from __future__ import annotations

import time

import common

CONTENDERS = (
    "float",
    "qmm-8",
    "dequant-8",
    "dequant-k4",
    "qmm-k4",
    "qmm-k8",
    "scores-tok8",
    "scores-ch8",
    "values-8",
    "cache-k8",
    "cache-k8-dequant",
    "cache-k4",
    "cache-k4-dequant",
)


def cache_route(window: int, sinks: int, bits: int, H: int, KVH: int, D: int):
    """(route, dequantized) callables of one decode step's attention on a SinkCache of
    ``bits`` filled with random keys and values past its first eviction."""
    import mlx.core as mx

    from mlx_stream.cache import qattend
    from mlx_stream.cache.sink import CacheSpec, SinkCache

    cache = SinkCache(CacheSpec(sinks, window, kv_bits=bits, positions="absolute"))
    cache.fast_route = True
    total = sinks + window + 48  # mid-group: the open group holds 16 residual tokens
    key = mx.random.key(7)
    while cache.tokens_seen < total - 1:
        n = min(cache.max_call_tokens(), total - 1 - cache.tokens_seen)
        k1, k2, key = mx.random.split(key, 3)
        cache.update_and_fetch(mx.random.normal((1, KVH, n, D), key=k1),
                               mx.random.normal((1, KVH, n, D), key=k2))  # fmt: skip
        mx.eval(cache.keys.state, cache.values)
    mask = cache.make_mask(1)
    keys, values = cache.update_and_fetch(*mx.random.normal((2, 1, KVH, 1, D), key=key))
    q = mx.random.normal((1, H, 1, D), key=mx.random.key(8))
    mx.eval(q, mask, keys, values)
    fk, fv = qattend.unpack(keys, values)
    scale = D**-0.5

    def dequantized():
        k, v = qattend.unpack(keys, values)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    route = lambda: qattend.attend(q, keys, values, scale, mask)  # noqa: E731
    error = mx.abs(route() - mx.fast.scaled_dot_product_attention(q, fk, fv, scale=scale,
                                                                  mask=mask)).max().item()  # fmt: skip
    assert error < 1e-4, f"the route differs from float attention by {error}"
    return route, dequantized


def contenders(L: int, H: int, KVH: int, D: int) -> dict:
    """The contenders' zero-argument callables over fresh random tensors of ``L`` slots."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from mlx_stream.cache import kvquant

    g, G = 64, kvquant.GROUP
    L = L // G * G  # whole per-channel groups
    q = mx.random.normal((1, H, 1, D), key=mx.random.key(0))
    k = mx.random.normal((1, KVH, L, D), key=mx.random.key(1))
    v = mx.random.normal((1, KVH, L, D), key=mx.random.key(2))
    k8, v8 = (mx.quantize(x, group_size=g, bits=8) for x in (k, v))
    v4 = mx.quantize(v, group_size=g, bits=4)
    kt4 = mx.quantize(k.swapaxes(-1, -2), group_size=G, bits=4)  # (1, KVH, D, L)
    kt8 = mx.quantize(k.swapaxes(-1, -2), group_size=G, bits=8)
    probs = mx.softmax(mx.random.normal((1, KVH, H // KVH, L), key=mx.random.key(3)), axis=-1)
    mx.eval(q, k, v, k8, v8, v4, kt4, kt8, probs)
    scale, rep = D**-0.5, H // KVH

    def deq(x, bits, group=g):
        return mx.dequantize(*x, group_size=group, bits=bits)

    def qmm_k(kt, vq, bits):
        qs = (q * scale).reshape(1, KVH, rep, D)
        scores = mx.quantized_matmul(qs, *kt, transpose=False, group_size=G, bits=bits)
        probs = mx.softmax(scores, axis=-1, precise=True)
        out = mx.quantized_matmul(probs, *vq, transpose=False, group_size=g, bits=bits)
        return out.reshape(1, H, 1, D)

    def scores_tok8():
        qs = (q * scale).reshape(1, KVH, rep, D)
        return mx.quantized_matmul(qs, *k8, transpose=True, group_size=g, bits=8)

    def scores_ch8():
        qs = (q * scale).reshape(1, KVH, rep, D)
        return mx.quantized_matmul(qs, *kt8, transpose=False, group_size=G, bits=8)

    sdpa = mx.fast.scaled_dot_product_attention
    return {
        "float": lambda: sdpa(q, k, v, scale=scale, mask=None),
        # mlx-lm scales the queries in place (``queries *= scale``): a fresh copy each call
        "qmm-8": lambda: quantized_scaled_dot_product_attention(
            q * 1.0, k8, v8, scale=scale, mask=None, group_size=g, bits=8
        ),
        "dequant-8": lambda: sdpa(q, deq(k8, 8), deq(v8, 8), scale=scale, mask=None),
        "dequant-k4": lambda: sdpa(
            q, deq(kt4, 4, G).swapaxes(-1, -2), deq(v4, 4), scale=scale, mask=None
        ),
        "qmm-k4": lambda: qmm_k(kt4, v4, 4),
        "qmm-k8": lambda: qmm_k(kt8, v8, 8),
        "scores-tok8": scores_tok8,
        "scores-ch8": scores_ch8,
        "values-8": lambda: mx.quantized_matmul(
            probs, *v8, transpose=False, group_size=g, bits=8
        ),  # fmt: skip
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--windows", default="128,256,512,1024,4096")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=200, help="timed calls per contender")
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.rounds = "64", 3
    import mlx.core as mx

    records = []
    for window in (int(w) for w in args.windows.split(",")):
        fns = contenders(args.sinks + window + 31, 9, 3, 64)
        for bits in (8, 4):
            route, dequantized = cache_route(window, args.sinks, bits, 9, 3, 64)
            fns[f"cache-k{bits}"], fns[f"cache-k{bits}-dequant"] = route, dequantized
        for f in fns.values():  # warm-up
            mx.eval(f())
        times = {n: [] for n in fns}
        for _ in range(args.rounds):
            for n, f in fns.items():
                tic = time.perf_counter()
                mx.eval(f())
                times[n].append(1e6 * (time.perf_counter() - tic))
        base = common.percentile(times["float"], 50)
        for n, t in times.items():
            us = common.percentile(t, 50)
            record = common.base_record("quantized-attention", args.model, "random",
                                        window=window, contender=n, us=round(us, 1),
                                        ratio_to_float=round(us / base, 3))  # fmt: skip
            records.append(common.emit(record, args.out))
    return records


if __name__ == "__main__":
    main()
