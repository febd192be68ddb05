"""Decode speed and memory after long contexts: mlx-stream vs mlx-lm.

Three caches are fed the same Moby-Dick tokens in one process:

- ``sink``: mlx-stream's ``generate_step`` on ``make_sink_cache(model, sinks, window)``;
- ``rotating``: mlx-lm's ``generate_step`` on ``RotatingKVCache(max_size=sinks+window,
  keep=sinks)`` built per layer (``make_prompt_cache(max_kv_size=...)`` is ignored for
  llama: mlx-lm's ``make_cache`` wins);
- ``full``: mlx-lm's ``generate_step`` on its growing ``KVCache``;
- ``rotating-ours`` (only when named in ``--caches``): mlx-stream's ``generate_step`` on
  the same ``RotatingKVCache``, to tell the decode loop's cost from the cache's.

At each context length (default 1k, 4k, 8k, 16k tokens fed; the full cache stops at
``--full-max``, the model's 8k context) every cache decodes
``--tokens`` greedy tokens, in the order sink, rotating, full, sink, rotating, full
(``--repeats``), so machine noise falls on all three alike. One JSON line per (cache,
context): generation tok/s, per-token latency p50/p90, prefill tok/s of the segment
that led there, the KV cache's bytes and the process's active/peak memory (all three
caches are alive at once: ``kv_mb`` is the per-cache figure), and ``bare_p50_ms``: the
median of ``--bare`` one-token model calls per cache, timed round-robin outside any
generation loop (the cost of the cache alone). A final summary line has the
sink/rotating tok/s and bare-call ratios (with the range of the per-repeat tok/s
ratios, each sink run against the rotating run right after it), the sink's latency
flatness and the full cache's growth.

    python benchmarks/decode.py                         # 9.4 min on a quiet 2-core machine
    python benchmarks/decode.py --full-max 16384        # the full cache at 16k too (~17 min)
    python benchmarks/decode.py --contexts 1024,4096    # shorter

``--windows W1,W2,...`` measures across windows instead: per window, ``sink`` (float),
``sink-8`` (8-bit keys and values), ``sink-4`` (4-bit) and ``rotating`` are each fed
``window + sinks + 64`` tokens of the book (past the first eviction), then decode
``--tokens`` greedy tokens in ``--repeats`` interleaved rounds (sink, sink-8, sink-4,
rotating, sink, ..., the order rotated every round); ``sink-8-dequant`` and
``sink-4-dequant`` (only when named in ``--caches``) are the same quantized caches
attending on dequantized floats (``fast_route`` off: what they do where
``mlx_stream.cache.qattend`` is not installed), and ``sink-8-token`` the 8-bit cache with
keys per token through mlx-lm's quantized kernel (``token_keys``: what ``kv_bits=8`` was
before keys went per channel); one JSON line per
(cache, window) with the median tok/s over rounds, and a summary line with, per window,
the median over rounds of each round's ratio to the rotating run beside it, and the
median over ``--bare`` rounds of bare one-token model calls of each call's time over the
rotating cache's call beside it (the steadiest figure on a shared machine).

    python benchmarks/decode.py --windows 128,256,512,1024,4096 --repeats 5 --tokens 32
"""

from __future__ import annotations

import time

import common

CACHES = ("sink", "rotating", "full")
# The --windows mode: float, 8-bit and 4-bit sink caches against mlx-lm's rotating cache
# (and, when named, the quantized ones on their dequantize route).
WINDOW_CACHES = ("sink", "sink-8", "sink-4", "rotating")
WINDOW_EXTRA = ("sink-8-dequant", "sink-4-dequant", "sink-8-token")
# Only with --caches: mlx-stream's generate_step on mlx-lm's RotatingKVCache, which
# splits the sink/rotating ratio into what the decode loop costs and what the cache costs.
EXTRA = ("rotating-ours",)


def make_cache(name: str, model, sinks: int, window: int) -> list:
    """A fresh prompt cache of kind ``name`` for ``model``."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    from mlx_stream.cache.sink import make_sink_cache

    if name == "sink":
        return make_sink_cache(model, sinks, window)
    if name == "sink-8-token":
        from mlx_stream.cache.sink import CacheSpec, SinkCache

        spec = CacheSpec(sinks, window, kv_bits=8)
        return [
            SinkCache(spec, c.move, additive_mask=c.additive_mask, token_keys=True)
            if isinstance(c, SinkCache) else c
            for c in make_sink_cache(model, sinks, window, kv_bits=8)
        ]  # fmt: skip
    if name.startswith("sink-"):
        bits = int(name.split("-")[1])
        cache = make_sink_cache(model, sinks, window, kv_bits=bits)
        for c in cache if name.endswith("-dequant") else ():
            c.fast_route = False  # the dequantize route
        return cache
    if name.startswith("rotating"):
        return [RotatingKVCache(max_size=sinks + window, keep=sinks) for _ in model.layers]
    return make_prompt_cache(model)


def kv_bytes(cache: list) -> int:
    """Bytes held by a prompt cache's keys and values."""
    return sum(c.nbytes for c in cache)


def decode(name: str, model, cache: list, prompt: list[int], tokens: int, step: int) -> dict:
    """Feed ``prompt`` then decode ``tokens`` greedily; time to first token and the
    intervals between tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step as mlx_lm_step

    from mlx_stream.generate.decode import generate_step

    if name.startswith("sink") or name == "rotating-ours":
        steps = generate_step(prompt, model, cache, max_tokens=tokens, prefill_step_size=step)
    else:
        steps = mlx_lm_step(
            mx.array(prompt), model, max_tokens=tokens, prompt_cache=cache, prefill_step_size=step
        )
    tic = time.perf_counter()
    stamps = [time.perf_counter() for _ in steps]
    return {
        "ttft_s": stamps[0] - tic,
        "intervals": [b - a for a, b in zip(stamps, stamps[1:])],
    }


def bare_steps(
    model, caches: dict, names: list[str], token: int, count: int, times: dict | None = None
) -> dict:
    """Milliseconds per bare one-token model call on each cache, round-robin (no
    generation loop, no sampling, no pipelining): the cost of the cache alone. Each
    call's time is appended to ``times[name]`` when given (call ``i`` of every cache ran
    side by side)."""
    import mlx.core as mx

    times = {n: [] for n in names} if times is None else times
    y = mx.array([[token]])
    for i in range(count):
        for n in names[i % len(names) :] + names[: i % len(names)]:  # no fixed first
            tic = time.perf_counter()
            mx.eval(model(y, cache=caches[n]))
            times[n].append(1e3 * (time.perf_counter() - tic))
    return {n: round(common.percentile(t, 50), 2) for n, t in times.items() if t}


def line(name: str, context: int, runs: list[dict], cache: list, base: dict) -> dict:
    """One JSON record for ``name`` at ``context`` from its interleaved runs."""
    import mlx.core as mx

    intervals = [x for r in runs for x in r["intervals"]]
    first = runs[0]
    return dict(
        base,
        cache=name,
        context=context,
        decode_tokens=sum(len(r["intervals"]) for r in runs),
        tok_s=round(len(intervals) / sum(intervals), 2),
        run_tok_s=[round(len(r["intervals"]) / sum(r["intervals"]), 2) for r in runs],
        p50_ms=round(1e3 * common.percentile(intervals, 50), 2),
        p90_ms=round(1e3 * common.percentile(intervals, 90), 2),
        prefill_tokens=first["prompt_tokens"],
        prefill_tps=round(first["prompt_tokens"] / first["ttft_s"], 1),
        kv_mb=round(kv_bytes(cache) / 1e6, 2),
        step_peak_extra_mb=round(max(r["peak_extra"] for r in runs) / 1e6, 2),
        process_active_mb=round(mx.get_active_memory() / 1e6, 2),
        process_peak_mb=round(max(r["peak"] for r in runs) / 1e6, 2),
    )


def summarize(records: list[dict], base: dict) -> dict:
    """tok/s ratios sink/rotating, sink latency flatness, full-cache growth."""
    at = {(r["cache"], r["context"]): r for r in records}
    contexts = sorted({r["context"] for r in records})
    lo, hi = contexts[0], contexts[-1]
    summary = dict(base, summary=True, contexts=contexts)
    for c in contexts:
        # sink/rotating is the headline; with rotating-ours, its loop and cache parts
        for a, b in (
            ("sink", "rotating"),
            ("sink", "rotating-ours"),
            ("rotating-ours", "rotating"),
        ):
            if (a, c) in at and (b, c) in at:
                ratio = at[a, c]["tok_s"] / at[b, c]["tok_s"]
                summary[f"{a}_over_{b}_tok_s_{c}".replace("-", "_")] = round(ratio, 3)
        if ("sink", c) in at and ("rotating", c) in at:
            pairs = zip(at["sink", c]["run_tok_s"], at["rotating", c]["run_tok_s"])
            ratios = [s / r for s, r in pairs]  # run i of each: neighbours in time
            summary[f"sink_over_rotating_tok_s_{c}_range"] = [
                round(min(ratios), 3), round(max(ratios), 3)
            ]  # fmt: skip
            if "bare_p50_ms" in at["sink", c]:
                ratio = at["sink", c]["bare_p50_ms"] / at["rotating", c]["bare_p50_ms"]
                summary[f"sink_over_rotating_bare_ms_{c}"] = round(ratio, 3)
    if ("sink", lo) in at and ("sink", hi) in at:
        summary["sink_p50_growth"] = round(at["sink", hi]["p50_ms"] / at["sink", lo]["p50_ms"], 3)
    full = [c for c in contexts if ("full", c) in at]
    if len(full) > 1:
        lo, hi = full[0], full[-1]
        summary["full_contexts"] = [lo, hi]
        summary["full_p50_growth"] = round(at["full", hi]["p50_ms"] / at["full", lo]["p50_ms"], 3)
        summary["full_kv_mb_growth"] = [at["full", lo]["kv_mb"], at["full", hi]["kv_mb"]]
    return summary


def across_windows(args, model, tokenizer, weights) -> list[dict]:
    """The --windows mode: decode tok/s per window, interleaved rounds, medians."""
    import statistics

    import mlx.core as mx

    windows = [int(w) for w in args.windows.split(",")]
    chosen = WINDOW_CACHES + WINDOW_EXTRA
    names = [n for n in args.caches.split(",") if n in chosen] or list(WINDOW_CACHES)
    book = common.book_tokens(tokenizer, max(windows) + args.sinks + 64 + args.repeats + 1)
    for n in names:  # warm-up on throwaway caches: first-call compilation is not speed
        decode(n, model, make_cache(n, model, args.sinks, 32), book[:8], 4, 8)
    records, summary = [], {}
    for window in windows:
        base = common.base_record("decode-windows", args.model, weights, sinks=args.sinks,
                                  window=window)  # fmt: skip
        context = window + args.sinks + 64  # past the first eviction
        caches = {n: make_cache(n, model, args.sinks, window) for n in names}
        runs = {n: [] for n in names}
        for rep in range(args.repeats):
            prompt = book[:context] if rep == 0 else book[context + rep - 1 : context + rep]
            for n in names[rep % len(names) :] + names[: rep % len(names)]:  # no fixed first
                mx.clear_cache()
                run = decode(n, model, caches[n], prompt, args.tokens, args.prefill_step)
                runs[n].append(len(run["intervals"]) / sum(run["intervals"]))
        calls = {n: [] for n in names}
        bare = bare_steps(model, caches, names, book[context], args.bare, calls)
        for n in names:
            # Round 0 follows the prefill; the medians are over rounds 1.. when there are.
            timed = runs[n][1:] if len(runs[n]) > 2 else runs[n]
            record = dict(base, cache=n, tok_s=round(statistics.median(timed), 2),
                          run_tok_s=[round(x, 2) for x in runs[n]],
                          kv_mb=round(kv_bytes(caches[n]) / 1e6, 2),
                          bare_p50_ms=bare.get(n))  # fmt: skip
            records.append(common.emit(record, args.out))
        for n in names:
            if n == "rotating" or "rotating" not in runs:
                continue
            pairs = list(zip(runs[n], runs["rotating"]))
            ratios = [a / b for a, b in (pairs[1:] if len(pairs) > 2 else pairs)]
            summary[f"{n}_over_rotating_{window}".replace("-", "_")] = round(
                statistics.median(ratios), 3
            )
            summary[f"{n}_over_rotating_{window}_range".replace("-", "_")] = [
                round(min(ratios), 3), round(max(ratios), 3)
            ]  # fmt: skip
            if bare.get(n) and bare.get("rotating"):
                # Median of the ratios of neighbouring calls: a load that comes and goes
                # falls on both calls of a pair.
                paired = [a / b for a, b in zip(calls[n], calls["rotating"])]
                key = f"{n}_over_rotating_bare_ms_{window}".replace("-", "_")
                summary[key] = round(statistics.median(paired), 3)
        del caches
    base = common.base_record("decode-windows", args.model, weights, sinks=args.sinks)
    records.append(common.emit(dict(base, summary=True, windows=windows, **summary), args.out))
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,8192,16384", help="comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per run")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per context")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument(
        "--windows", default=None,
        help="comma-separated windows: decode across windows (float, 8-bit and 4-bit sink "
        "caches against mlx-lm's rotating cache) instead of across contexts",
    )  # fmt: skip
    parser.add_argument("--prefill-step", type=int, default=512)
    parser.add_argument(
        "--caches", default=",".join(CACHES),
        help="subset of sink,rotating,full, and rotating-ours (our loop, mlx-lm's cache)",
    )  # fmt: skip
    parser.add_argument(
        "--bare", type=int, default=16,
        help="bare one-token model calls per cache and context, timed round-robin",
    )  # fmt: skip
    parser.add_argument(
        "--full-max", type=int, default=8192,
        help="largest context for the full cache (its 16k prefill alone takes ~10 min here)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.tokens, args.repeats, args.window = "48,96", 8, 2, 32
        args.bare = min(args.bare, 2)
    import mlx.core as mx

    if args.windows:
        if args.quick:
            args.windows, args.tokens, args.repeats = "16,32", 4, 2
        if args.caches == ",".join(CACHES):
            args.caches = ",".join(WINDOW_CACHES)
        model, tokenizer, weights = common.load_model(args.model, args.dtype)
        return across_windows(args, model, tokenizer, weights)
    contexts = [int(c) for c in args.contexts.split(",")]
    names = args.caches.split(",")
    unknown = [n for n in names if n not in CACHES + EXTRA]
    if unknown:
        parser.error(
            f"unknown cache {', '.join(unknown)} (choose from {', '.join(CACHES + EXTRA)})"
        )
    model, tokenizer, weights = common.load_model(args.model, args.dtype)
    book = common.book_tokens(tokenizer, contexts[-1] + args.repeats + 1)
    base = common.base_record(
        "decode",
        args.model,
        weights,
        sinks=args.sinks,
        window=args.window,
    )
    caches = {n: make_cache(n, model, args.sinks, args.window) for n in names}
    # Warm-up on throwaway caches: first-call compilation is not decode speed.
    for n in names:
        decode(n, model, make_cache(n, model, args.sinks, args.window), book[:8], 4, 8)
    records, fed = [], 0
    for context in contexts:
        runs = {n: [] for n in names}
        active = [n for n in names if n != "full" or context <= args.full_max]
        for rep in range(args.repeats):
            prompt = book[fed:context] if rep == 0 else book[context + rep - 1 : context + rep]
            for n in active:
                mx.clear_cache()  # every run starts from an empty pool (mlx-lm clears at n=0)
                mx.reset_peak_memory()
                before = mx.get_active_memory()
                run = decode(n, model, caches[n], prompt, args.tokens, args.prefill_step)
                peak = mx.get_peak_memory()
                run.update(prompt_tokens=len(prompt), peak=peak, peak_extra=peak - before)
                runs[n].append(run)
        fed = context
        bare = bare_steps(model, caches, active, book[context], args.bare)
        for n in active:
            record = line(n, context, runs[n], caches[n], base)
            if n in bare:
                record["bare_p50_ms"] = bare[n]
            records.append(common.emit(record, args.out))
        if "full" not in active:  # it would need the whole stream again later
            caches.pop("full", None)
    records.append(common.emit(summarize(records, base), args.out))
    return records


if __name__ == "__main__":
    main()
