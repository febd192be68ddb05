"""One prefill call's attention per layer, split: where a longer key list's time goes.

A document's prefill feeds calls of ``--queries`` tokens (64 once the window is full:
what a SinkCache admits per call); each layer attends them to the keys the cache
holds: ``sinks + window + slack`` without recall, those plus the recall region's
slots with it (580 and 1,160 for the default model with window 512, 4 sinks and 8
recalled blocks of 64). For each ``--keys`` count, on random tensors in the model's
shapes with an additive mask (as the sink cache hands attention after an eviction):
``mx.fast.scaled_dot_product_attention`` (the call the model makes), and its parts
done one by one (the grouped ``q @ k.T``, ``softmax``, ``p @ v``), and ``exp`` alone
over as many elements as the softmax, through MLX and through numpy. Contenders
timed round-robin, the median of ``--reps``.

One JSON line per key count (milliseconds per layer), then a summary line with the
ratios of the largest count to the smallest.

    python benchmarks/prefill_attention.py --keys 580,1160
"""

from __future__ import annotations

import time

import common
import numpy as np
from attention import shapes

PARTS = ("sdpa", "qk", "softmax", "pv", "exp_mlx", "exp_numpy")


def kernels(mx, heads: int, kv_heads: int, head_dim: int, queries: int, keys: int, dtype):
    """``name -> fn`` for one layer's call (each returns what must be evaluated)."""
    key = mx.random.key(keys)
    q = mx.random.normal((1, heads, queries, head_dim), key=key).astype(dtype)
    k, v = mx.random.normal((2, 1, kv_heads, keys, head_dim), key=key).astype(dtype)
    mask = mx.zeros((queries, keys), dtype)
    scale = head_dim**-0.5
    group = heads // kv_heads
    qg = q.reshape(1, kv_heads, group * queries, head_dim)
    logits = (qg * scale) @ k.swapaxes(-1, -2) + mx.tile(mask, (group, 1))
    probs = mx.softmax(logits, axis=-1)
    host = np.random.default_rng(0).standard_normal(logits.size).astype(np.float32)
    mx.eval(q, k, v, logits, probs)
    return {
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
        "qk": lambda: (qg * scale) @ k.swapaxes(-1, -2),
        "softmax": lambda: mx.softmax(logits, axis=-1),
        "pv": lambda: probs @ v,
        "exp_mlx": lambda: mx.exp(logits),
        "exp_numpy": lambda: np.exp(host),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--keys", default="580,1160", help="key counts (comma-separated)")
    parser.add_argument("--queries", type=int, default=64, help="tokens per prefill call")
    parser.add_argument("--reps", type=int, default=200, help="timed calls per contender")
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.queries, args.reps = "36,72", 16, 5
    mx = common.mx
    counts = [int(x) for x in args.keys.split(",") if x]
    if len(counts) < 1 or min(counts) < 1 or args.queries < 1 or args.reps < 1:
        parser.error("--keys, --queries and --reps must be positive")
    model, _, weights = common.load_model(args.model, args.dtype)
    heads, kv_heads, head_dim = shapes(model)
    dtype = {"bfloat16": mx.bfloat16, "float16": mx.float16}.get(weights, mx.float32)
    fns = {n: kernels(mx, heads, kv_heads, head_dim, args.queries, n, dtype) for n in counts}
    times: dict[tuple[int, str], list[float]] = {(n, p): [] for n in counts for p in PARTS}
    for i in range(args.reps + 3):  # the first 3 rounds warm up
        for n in counts:
            for part in PARTS:
                tic = time.perf_counter()
                out = fns[n][part]()
                if part != "exp_numpy":
                    mx.eval(out)
                if i >= 3:
                    times[(n, part)].append(1e3 * (time.perf_counter() - tic))
    base = common.base_record("prefill-attention", args.model, weights, heads=heads,
                              kv_heads=kv_heads, head_dim=head_dim, queries=args.queries,
                              reps=args.reps)  # fmt: skip
    med = {key: common.percentile(t, 50) for key, t in times.items()}
    records = []
    for n in counts:
        row = {f"{p}_ms": round(med[(n, p)], 4) for p in PARTS}
        row["softmax_share"] = round(med[(n, "softmax")] / med[(n, "sdpa")], 3)
        row["exp_mlx_over_numpy"] = round(med[(n, "exp_mlx")] / med[(n, "exp_numpy")], 2)
        records.append(common.emit(dict(base, keys=n, **row), args.out))
    lo, hi = min(counts), max(counts)
    summary = {f"{p}_{hi}_over_{lo}": round(med[(hi, p)] / med[(lo, p)], 3) for p in PARTS}
    records.append(common.emit(dict(base, summary=True, **summary), args.out))
    return records


if __name__ == "__main__":
    common.main_guard(main)
