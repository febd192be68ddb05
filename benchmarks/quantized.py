"""Quantized sink cache: perplexity, bytes per token and decode speed against the
float cache, and perplexity at equal memory (a 4-bit window of 4x the tokens).

mlx-lm cannot quantize its rolling cache (``RotatingKVCache.to_quantized`` raises NYI),
so the comparison is mlx-stream's float SinkCache against its own 8- and 4-bit ones,
all in the same process on the same token stream. One JSON line per configuration.

    python benchmarks/quantized.py                      # 4k tokens, window 256: 8.8 min, quiet
    python benchmarks/quantized.py --tokens 8192        # the README run (14.1 min, quiet)
"""

from __future__ import annotations

import math
import statistics
import time

from common import (  # first: it preloads OpenBLAS before mlx.core
    DEFAULT_MODEL,
    base_parser,
    book_tokens,
    emit,
    environment,
    load_model,
    main_guard,
    model_label,
    mx,
)

from mlx_stream.cache.sink import SinkCache, make_sink_cache
from mlx_stream.eval.perplexity import stream_perplexity
from mlx_stream.generate.decode import generate_step


def configurations(window: int) -> list[tuple[str, int | None, int | None, int]]:
    """(label, kv_bits, key_bits, window): the same window, then 4x the window in about
    the float cache's bytes (4-bit values take ~1/4 of float16, ~1/6 of float32)."""
    return [
        ("float", None, None, window),
        ("8-bit", 8, None, window),
        ("4-bit", 4, None, window),
        ("8-bit keys, 4-bit values", 4, 8, window),
        ("4-bit, 4x window", 4, None, 4 * window),
        ("8-bit keys, 4-bit values, 4x window", 4, 8, 4 * window),
        ("float, 4x window", None, None, 4 * window),
    ]


def bytes_per_token(cache: list) -> float:
    """Cache bytes per slot, summed over the layers (after the first update)."""
    return sum(c.nbytes / c.capacity for c in cache if isinstance(c, SinkCache))


def decode_speed(model, cache_factory, prompt: list[int], tokens: int) -> float:
    """Greedy decode tokens/s on a fresh cache, after ``prompt`` fills the window."""
    cache = cache_factory()
    steps = generate_step(prompt, model, cache, max_tokens=tokens + 1)
    next(steps)  # prefill + first token outside the timing
    tic = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - tic)


def interleaved_speeds(model, factories, prompts, tokens: int, repeats: int) -> list[float]:
    """Median decode tokens/s per configuration, measured A, B, C, A, B, C, ... so that
    machine noise spreads over all of them."""
    runs = [[] for _ in factories]
    for _ in range(repeats):
        for i, (factory, prompt) in enumerate(zip(factories, prompts)):
            runs[i].append(decode_speed(model, factory, prompt, tokens))
    return [statistics.median(r) for r in runs]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the stream")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved decode rounds")
    parser.add_argument("--book", default="moby_dick")
    parser.add_argument(
        "--decode-only", action="store_true", help="only the interleaved decode speeds"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.window, args.decode_tokens, args.repeats = 256, 32, 8, 1
        args.group_size = min(args.group_size, 32)

    model, tokenizer, weights = load_model(args.model, args.dtype)
    stream = book_tokens(tokenizer, args.tokens, args.book)
    env = environment()
    configs = configurations(args.window)
    factories = [
        lambda bits=bits, key_bits=key_bits, window=window: make_sink_cache(
            model, args.sinks, window, kv_bits=bits, kv_group_size=args.group_size,
            key_bits=key_bits,
        )
        for _, bits, key_bits, window in configs
    ]  # fmt: skip
    prompts = [stream[: window + args.sinks] for *_, window in configs]
    speeds = interleaved_speeds(model, factories, prompts, args.decode_tokens, args.repeats)
    records = []
    for (label, bits, key_bits, window), factory, speed in zip(configs, factories, speeds):
        cache = factory()
        if args.decode_only:
            model(mx.array([stream[:8]]), cache=cache)  # allocate the buffers
            result = None
        else:
            result = stream_perplexity(
                model, stream, args.sinks, window, prompt_cache=cache, segment=len(stream)
            )
        per_token = bytes_per_token(cache)
        records.append(
            emit(
                {
                    "benchmark": "quantized",
                    "config": label,
                    "model": model_label(args.model or DEFAULT_MODEL),
                    "weights": weights,
                    "kv_bits": bits,
                    "key_bits": key_bits,
                    "group_size": args.group_size if bits else None,
                    "sinks": args.sinks,
                    "window": window,
                    "tokens": result.tokens if result else None,
                    "perplexity": result.perplexity if result else None,
                    "cache_bytes_per_token": round(per_token, 1),
                    "cache_mb": round(per_token * (args.sinks + window) / 1e6, 3),
                    "eval_tokens_per_second": result.tokens_per_second if result else None,
                    "decode_tokens": args.decode_tokens,
                    "decode_repeats": args.repeats,
                    "decode_tokens_per_second": speed,
                    **env,
                },
                args.out,
            )
        )
    base = records[0]
    for r in records:
        if not args.decode_only:
            r["perplexity_vs_float"] = r["perplexity"] / base["perplexity"] - 1
            assert math.isfinite(r["perplexity"])
        r["decode_ratio_vs_float"] = (
            r["decode_tokens_per_second"] / base["decode_tokens_per_second"]
        )
    emit(
        {
            "benchmark": "quantized-summary",
            "rows": [
                {k: r.get(k) for k in ("config", "window", "perplexity", "perplexity_vs_float",
                                   "cache_bytes_per_token", "cache_mb", "decode_ratio_vs_float")}
                for r in records
            ],
        },
        args.out,
    )  # fmt: skip
    return records


if __name__ == "__main__":
    main_guard(main)
