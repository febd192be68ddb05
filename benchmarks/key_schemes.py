"""Which 4-bit key scheme keeps attention closest to float keys, on the model's own keys.

The model reads ``--tokens`` tokens of a book through plain ``KVCache`` layers while every
layer's queries, keys and values are recorded (a wrapper around the llama module's
``scaled_dot_product_attention``). For each layer, causal attention is recomputed with the
keys (or values) passed through a quantization scheme, and the relative error of the
attention output against float keys is averaged over the layers:

- ``k4g64``, ``k4g32``: ``mx.quantize`` per token (groups along the head dimension);
- ``k8g64``: 8-bit per token, for scale;
- ``had4g64``, ``had4g32``: a Hadamard rotation of the head dimension before per-token
  4-bit, undone after;
- ``smooth4g32``: keys divided by a per-channel scale (the RMS of each rotary channel
  pair, measured on another book) before per-token 4-bit, multiplied back after;
- ``kivi4g32``, ``kivi4g64``: per channel, groups of 32 or 64 tokens (KIVI; what
  ``kv_bits=4`` stores, without its float residual of the newest tokens);
- ``v4g64``, ``v4g32``: the values per token (keys float), for comparison.

One JSON line per scheme: mean and max over the layers. Llama-architecture models only.

    python benchmarks/key_schemes.py                  # ~2 min: 1,024 tokens of Botchan
"""

from __future__ import annotations

import common


def record_attention(model, tokens: list[int]) -> list[tuple]:
    """(queries, keys, values, scale) of every layer for one forward pass over ``tokens``."""
    import mlx.core as mx
    import mlx_lm.models.llama as llama
    from mlx_lm.models.cache import KVCache

    seen, original = [], llama.scaled_dot_product_attention

    def spy(queries, keys, values, cache, scale, mask, **kwargs):
        seen.append((queries, keys, values, scale))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    llama.scaled_dot_product_attention = spy
    try:
        mx.eval(model(mx.array([tokens]), cache=[KVCache() for _ in model.layers]))
    finally:
        llama.scaled_dot_product_attention = original
    return seen


def schemes(calibration) -> dict:
    """Scheme name -> (which tensor, function of (layer, tensor))."""
    import mlx.core as mx

    def q(x, group, bits=4):
        return mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group,
                             bits=bits)  # fmt: skip

    def had(x):
        return mx.hadamard_transform(x, scale=x.shape[-1] ** -0.5)

    def kivi(x, group):
        return q(x.swapaxes(-1, -2), group).swapaxes(-1, -2)

    def pair_rms(k):
        half = k.shape[-1] // 2
        m = (k * k).mean(axis=2, keepdims=True)
        p = (m[..., :half] + m[..., half:]) / 2
        return mx.sqrt(mx.concatenate([p, p], -1)) + 1e-6

    def smooth(i, k):
        s = pair_rms(calibration[i][1])
        return q(k / s, 32) * s

    return {
        "k4g64": ("keys", lambda i, k: q(k, 64)),
        "k4g32": ("keys", lambda i, k: q(k, 32)),
        "k8g64": ("keys", lambda i, k: q(k, 64, 8)),
        "had4g64": ("keys", lambda i, k: had(q(had(k), 64))),
        "had4g32": ("keys", lambda i, k: had(q(had(k), 32))),
        "smooth4g32": ("keys", smooth),
        "kivi4g32": ("keys", lambda i, k: kivi(k, 32)),
        "kivi4g64": ("keys", lambda i, k: kivi(k, 64)),
        "v4g64": ("values", lambda i, v: q(v, 64)),
        "v4g32": ("values", lambda i, v: q(v, 32)),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="multiple of 64")
    parser.add_argument("--book", default="botchan")
    parser.add_argument("--calibration-book", default="moby_dick")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = 64
    import mlx.core as mx
    import numpy as np

    model, tokenizer, weights = common.load_model(args.model, args.dtype)
    seen = record_attention(model, common.book_tokens(tokenizer, args.tokens, args.book))
    calibration = record_attention(model, common.book_tokens(tokenizer, 256, args.calibration_book))
    errors = {name: [] for name in schemes(calibration)}
    for i, (queries, keys, values, scale) in enumerate(seen):
        L = keys.shape[2]
        mask = mx.triu(mx.full((L, L), -mx.inf), k=1)
        reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                         mask=mask)  # fmt: skip
        norm = mx.linalg.norm(reference)
        for name, (which, f) in schemes(calibration).items():
            k, v = (f(i, keys), values) if which == "keys" else (keys, f(i, values))
            out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
            errors[name].append((mx.linalg.norm(out - reference) / norm).item())
    base = common.base_record("key-schemes", args.model, weights, book=args.book,
                              tokens=args.tokens, layers=len(seen))  # fmt: skip
    return [
        common.emit(
            dict(
                base,
                scheme=name,
                mean_error=round(float(np.mean(e)), 4),
                max_error=round(float(np.max(e)), 4),
            ),
            args.out,
        )  # fmt: skip
        for name, e in errors.items()
    ]


if __name__ == "__main__":
    main()
