"""The StreamingLLM table: perplexity of one long stream of Moby-Dick under cache policies.

For each window (``--windows``): window only (0 sinks), 1, 2, 4 and 8 sinks with
positions within the cache (``--sinks``), 4 sinks at absolute positions (mlx-lm's
behaviour, ``--absolute``), all through ``mlx_stream.eval.perplexity.stream_perplexity`` over
the first ``--tokens`` tokens. Then the full cache over the first ``min(--tokens,
--full)`` tokens (the model's 8k context), and sliding window with re-computation (the
quality oracle) on ``--oracle`` random tokens past the first window, with every
configuration's perplexity on exactly those tokens alongside. Last, chunked vs
token-by-token evaluation of the same ``--throughput`` tokens: same perplexity,
speed-up.

One JSON line per configuration (overall perplexity, perplexity per ``--segment``
tokens, tokens/s) and a PNG of perplexity per segment (``--plot``).

    python benchmarks/perplexity.py                      # 8k tokens, window 256: 9.2 min, quiet
    python benchmarks/perplexity.py --tokens 100000 --windows 1024 --sinks 4 --absolute "" --full 0
    python benchmarks/perplexity.py --replot results/a.jsonl results/b.jsonl --plot x.png
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import common
import numpy as np

DEFAULT_CONTEXT = 8192  # SmolLM2's trained context: the full cache stops there


def per_token_nll(result, n: int) -> np.ndarray:
    """NLL of stream index 1..n-1 from a ``segment=1`` result (``nan`` where absent)."""
    nll = np.full(n, np.nan)
    for s in result.segments:
        nll[s["start"]] = s["nll"]
    return nll


def segments(nll: np.ndarray, size: int) -> list[dict]:
    """Perplexity per ``size`` stream tokens from per-token NLLs."""
    out = []
    for start in range(0, len(nll), size):
        part = nll[start : start + size]
        part = part[~np.isnan(part)]
        if part.size:
            out.append({"start": start, "tokens": int(part.size), "ppl": math.exp(part.mean())})
    return out


def evaluate(model, tokens, label: str, segment: int, **kwargs) -> tuple[dict, np.ndarray]:
    """Run ``stream_perplexity`` with per-token NLLs; a record and the NLL array."""
    from mlx_stream.eval.perplexity import stream_perplexity

    every, total, last = 8192, len(tokens), [0]

    def progress(position: int, ppl: float) -> None:  # long runs say where they are
        if position // every != last[0] // every or position == total:
            print(f"{label}: {position}/{total} tokens, perplexity {ppl:.3f}", file=sys.stderr)
        last[0] = position

    result = stream_perplexity(model, tokens, segment=1, callback=progress, **kwargs)
    nll = per_token_nll(result, len(tokens))
    record = {
        "config": label,
        "tokens": result.tokens,
        "perplexity": round(result.perplexity, 3),
        "tok_s": round(result.tokens_per_second, 1),
        "peak_mb": round(result.peak_memory / 1e6, 1),
        "segments": [dict(s, ppl=round(s["ppl"], 3)) for s in segments(nll, segment)],
    }
    return record, nll


def configs(args) -> list[tuple[str, dict]]:
    """``(label, stream_perplexity kwargs)`` for the sink/position grid of a window."""
    out = []
    for window in args.windows:
        for s in args.sinks:
            out.append((f"sinks={s} window={window}", dict(sinks=s, window=window)))
        for s in args.absolute:
            kwargs = dict(sinks=s, window=window, positions="absolute")
            out.append((f"sinks={s} window={window} absolute", kwargs))
    return out


def oracle_indices(n: int, window: int, sinks: int, count: int, seed: int = 0) -> list[int]:
    """``count`` stream indices past the first window (where policies differ)."""
    first = min(window + sinks + 1, n - 1)
    population = range(first, n)
    return sorted(random.Random(seed).sample(population, min(count, len(population))))


def throughput(model, tokens, window: int, sinks: int) -> dict:
    """Chunked (64) vs token-by-token evaluation of the same tokens."""
    from mlx_stream.eval.perplexity import stream_perplexity

    runs = {}
    for chunk in (64, 1, 64, 1):  # interleaved
        r = stream_perplexity(model, tokens, sinks=sinks, window=window, chunk=chunk)
        runs.setdefault(chunk, []).append(r)
    chunked, single = runs[64], runs[1]
    tps = {c: float(np.median([r.tokens_per_second for r in rs])) for c, rs in runs.items()}
    return {
        "config": f"throughput sinks={sinks} window={window}",
        "tokens": chunked[0].tokens,
        "chunked_perplexity": round(chunked[0].perplexity, 4),
        "token_by_token_perplexity": round(single[0].perplexity, 4),
        "perplexity_rel_diff": abs(chunked[0].nll - single[0].nll) / abs(single[0].nll),
        "chunked_tok_s": round(tps[64], 1),
        "token_by_token_tok_s": round(tps[1], 1),
        "speedup": round(tps[64] / tps[1], 2),
    }


def plot(records: list[dict], path: Path, title: str) -> None:
    """Perplexity per segment, one panel per window (matplotlib, Agg)."""
    plt = common.pyplot()

    windows = sorted({r["window"] for r in records if "window" in r})
    fig, axes = plt.subplots(1, len(windows), figsize=(6 * len(windows), 4), dpi=90, squeeze=False)
    for ax, window in zip(axes[0], windows):
        for r in records:
            if r.get("window") in (window, None) and r.get("segments"):
                xs = [s["start"] / 1000 for s in r["segments"]]
                ax.plot(xs, [s["ppl"] for s in r["segments"]], marker=".", label=r["config"])
        ax.set_yscale("log")
        ax.set_xlabel("stream position (k tokens)")
        ax.set_ylabel("perplexity per segment")
        ax.set_title(f"{title}, window {window}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--book", default="moby_dick", help="<data>/<book>.txt")
    parser.add_argument("--tokens", type=int, default=8192, help="stream length")
    parser.add_argument("--windows", default="256", help="comma-separated, e.g. 256,1024")
    parser.add_argument("--sinks", default="0,1,2,4,8", help="sink counts (cache positions)")
    parser.add_argument("--absolute", default="4", help="sink counts at absolute positions")
    parser.add_argument("--full", type=int, default=DEFAULT_CONTEXT, help="full-cache tokens")
    parser.add_argument("--oracle", type=int, default=32, help="recompute-oracle tokens")
    parser.add_argument("--throughput", type=int, default=512, help="tokens for chunk vs 1")
    parser.add_argument("--segment", type=int, default=4096, help="tokens per segment")
    parser.add_argument("--plot", type=Path, help="PNG of perplexity per segment")
    parser.add_argument(
        "--replot", type=Path, nargs="+", metavar="JSONL",
        help="no run: draw --plot from these saved JSON lines (e.g. several 100k runs)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot")
        records = common.saved_records(parser, args.replot, lambda r: bool(r.get("segments")))
        r0 = records[0]
        plot(records, args.plot, f"{r0['model']}, {r0['book']}, {r0['stream_tokens']} tokens")
        return records
    if args.quick:  # small sizes; a section set to 0 stays off
        args.tokens, args.windows, args.sinks, args.segment = 160, "32", "0,4", 64
        args.full, args.oracle = min(args.full, 160), min(args.oracle, 4)
        args.throughput = min(args.throughput, 80)
    args.windows = [int(w) for w in args.windows.split(",")]
    args.sinks = [int(s) for s in args.sinks.split(",") if s]
    args.absolute = [int(s) for s in args.absolute.split(",") if s]

    from mlx_lm.models.cache import make_prompt_cache

    from mlx_stream.eval.perplexity import recompute_perplexity

    model, tokenizer, weights = common.load_model(args.model, args.dtype)
    tokens = common.book_tokens(tokenizer, args.tokens, args.book)
    base = common.base_record(
        "perplexity",
        args.model,
        weights,
        book=args.book,
        stream_tokens=len(tokens),
    )
    records, nlls = [], {}
    for label, kwargs in configs(args):
        record, nlls[label] = evaluate(model, tokens, label, args.segment, **kwargs)
        records.append(common.emit(dict(base, **kwargs, **record), args.out))
    full = tokens[: args.full]
    if len(full) > 1:  # --full 0 skips the full-cache row
        record, nlls["full"] = evaluate(
            model, full, f"full cache (first {len(full)})", args.segment,
            prompt_cache=make_prompt_cache(model),
        )  # fmt: skip
        records.append(common.emit(dict(base, **record), args.out))
    for window in args.windows if args.oracle > 0 else []:
        sinks = 4
        idx = oracle_indices(len(tokens), window, sinks, args.oracle)
        oracle = recompute_perplexity(model, tokens, sinks=sinks, window=window, indices=idx)
        same = {
            label: round(math.exp(np.nanmean(nll[idx])), 3)
            for label, nll in nlls.items()
            if f"window={window}" in label and not np.isnan(nll[idx]).any()
        }
        record = dict(
            base,
            config=f"recompute sinks={sinks} window={window}",
            window=window,
            tokens=oracle.tokens,
            perplexity=round(oracle.perplexity, 3),
            tok_s=round(oracle.tokens_per_second, 2),
            same_tokens_perplexity=same,
        )
        records.append(common.emit(record, args.out))
    if args.throughput > 1:
        fast = throughput(model, tokens[: args.throughput], args.windows[0], 4)
        records.append(common.emit(dict(base, **fast), args.out))
    if args.plot:
        plot(records, args.plot, f"{base['model']}, {args.book}")
    return records


if __name__ == "__main__":
    main()
