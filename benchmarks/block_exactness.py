"""Does a block of tokens (a speculative verify block, a prefill chunk) give the logits of
the same tokens fed one at a time, bit for bit? Per cache and weight dtype.

The same book tokens go through the model twice per cache: one token per call, then in
calls of ``--block`` tokens (at most what the cache admits). One JSON line per cache and
dtype: rows whose logits differ in any bit, rows whose greedy token differs, and the
largest difference. mlx-lm's ``KVCache`` is the reference for what the model's own
kernels do: where it differs, the matmuls give a row different bits in a block than
alone (float32 through OpenBLAS), and no cache can be exact there; a 4-bit window then
turns some of those last bits into a different greedy token.

    python benchmarks/block_exactness.py              # ~5 min: 240 tokens, 2 dtypes
"""

from __future__ import annotations

import common

CACHES = ("kvcache", "sink", "sink-8", "sink-4")


def make_cache(name: str, model, window: int):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_stream.cache import make_sink_cache

    if name == "kvcache":
        return make_prompt_cache(model)
    bits = int(name.split("-")[1]) if "-" in name else None
    # Absolute positions: bfloat16 rope moves are not exact enough for the self-check.
    return make_sink_cache(model, 4, window, slack=16, kv_bits=bits, positions="absolute")


def feed(model, cache, tokens: list[int], block: int):
    """Logits of every token, fed in calls of at most ``block`` tokens."""
    import mlx.core as mx

    from mlx_stream.cache.sink import max_call_tokens

    out, i = [], 0
    while i < len(tokens):
        n = min(block, max_call_tokens(cache) or block, len(tokens) - i)
        out.append(model(mx.array([tokens[i : i + n]]), cache=cache)[0])
        mx.eval(out[-1])
        i += n
    return mx.concatenate(out)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=240)
    parser.add_argument("--block", type=int, default=4, help="tokens per call of the block run")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--book", default="botchan")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.window = 80, 16
    import mlx.core as mx

    records = []
    for dtype in args.dtypes.split(","):
        model, tokenizer, weights = common.load_model(args.model, dtype)
        tokens = common.book_tokens(tokenizer, args.tokens, args.book)
        for name in args.caches.split(","):
            one = feed(model, make_cache(name, model, args.window), tokens, 1)
            block = feed(model, make_cache(name, model, args.window), tokens, args.block)
            rows = (one != block).any(axis=-1)
            record = common.base_record(
                "block-exactness", args.model, weights, cache=name, tokens=len(tokens),
                block=args.block, window=args.window,
                rows_differing=rows.sum().item(),
                greedy_differing=(one.argmax(-1) != block.argmax(-1)).sum().item(),
                max_abs_diff=mx.abs(one - block).max().item(),
            )  # fmt: skip
            records.append(common.emit(record, args.out))
    return records


if __name__ == "__main__":
    common.main_guard(main)
