"""MLX's buffer pool and active memory during long speculative decoding.

Speculative rounds advance the token count by several tokens, so a reclaim rule that
fires on ``count % 256 == 0`` can step over its multiples (ollama PR 18510). Compared,
each on a fresh cache, decoding ``--tokens`` greedy tokens with ``--draft`` drafting:

- ``sink-crossing``: mlx-stream, SinkCache, ``ReclaimSchedule(mode="crossing")``;
- ``sink-exact``: mlx-stream, SinkCache, ``ReclaimSchedule(mode="exact")``;
- ``mlx-lm``: mlx-lm's ``speculative_generate_step`` on its full ``KVCache`` (it never
  clears the pool while decoding).

MLX's pool (``mx.get_cache_memory``) and active memory are sampled every ``--sample``
tokens. One JSON line per contender (with the sampled series), and a PNG of pool
memory against tokens (``--plot``).

    python benchmarks/spec_memory.py                   # 2,048 tokens each: 8.0 min, quiet
    python benchmarks/spec_memory.py --tokens 10240    # the long run
    python benchmarks/spec_memory.py --replot a.jsonl b.jsonl --plot pool.png
"""

from __future__ import annotations

import time
from pathlib import Path

import common

CONTENDERS = ("sink-crossing", "sink-exact", "mlx-lm")
DEFAULT_PROMPT = 100  # tokens of Moby-Dick; not a multiple of the draft step


def series_run(name: str, model, draft, prompt: list[int], args) -> dict:
    """Decode with contender ``name``; memory sampled every ``args.sample`` tokens."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_stream.cache.reclaim import ReclaimSchedule
    from mlx_stream.cache.sink import make_sink_cache
    from mlx_stream.defaults import slack_for
    from mlx_stream.generate.decode import generate_step

    mx.clear_cache()
    mx.reset_peak_memory()
    schedule = None
    if name == "mlx-lm":
        cache = make_prompt_cache(model) + make_prompt_cache(draft)
        steps = speculative_generate_step(
            mx.array(prompt), model, draft, num_draft_tokens=args.num_draft_tokens,
            max_tokens=args.tokens, prompt_cache=cache,
        )  # fmt: skip
    else:
        schedule = ReclaimSchedule(args.every, mode=name.removeprefix("sink-"))
        slack = slack_for(args.num_draft_tokens)
        cache = make_sink_cache(model, args.sinks, args.window, slack)
        cache += make_sink_cache(draft, args.sinks, args.window, slack)
        steps = generate_step(
            prompt, model, cache, draft_model=draft, num_draft_tokens=args.num_draft_tokens,
            max_tokens=args.tokens, reclaim=schedule,
        )  # fmt: skip
    tokens, pool, active, accepted = [], [], [], 0
    tic = time.perf_counter()
    for i, (_, _, from_draft) in enumerate(steps, start=1):
        accepted += bool(from_draft)
        if i % args.sample == 0 or i == args.tokens:
            tokens.append(i)
            pool.append(round(mx.get_cache_memory() / 1e6, 3))
            active.append(round(mx.get_active_memory() / 1e6, 3))
    seconds = time.perf_counter() - tic
    return {
        "contender": name,
        "tokens": i,
        "tok_s": round(i / seconds, 2),
        "accepted_fraction": round(accepted / i, 3),
        "reclaims": schedule.reclaims if schedule else 0,
        "pool_mb_max": max(pool),
        "pool_mb_last": pool[-1],
        "active_mb_max": max(active),
        "active_mb_last": active[-1],
        "peak_mb": round(mx.get_peak_memory() / 1e6, 2),
        "kv_mb": round(sum(c.nbytes for c in cache) / 1e6, 2),
        "series": {"tokens": tokens, "pool_mb": pool, "active_mb": active},
    }


def title(r: dict) -> str:
    """The plot title from a record's settings."""
    return (
        f"{r['model']}, draft {r['draft']}, {r['num_draft_tokens']} drafts/round, "
        f"reclaim every {r['every']}"
    )


def plot(records: list[dict], path: Path, title: str) -> None:
    """Pool memory against tokens, one line per contender (matplotlib, Agg)."""
    plt = common.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for r in records:
        s = r["series"]
        ax.plot(
            s["tokens"], s["pool_mb"], label=f"{r['contender']} (max {r['pool_mb_max']:.0f} MB)"
        )
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("MLX buffer pool (MB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--draft", help="draft model (default: the model itself)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per contender")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=DEFAULT_PROMPT, help="prompt tokens")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--every", type=int, default=256, help="reclaim cadence")
    parser.add_argument("--sample", type=int, default=16, help="sample memory every N tokens")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--plot", type=Path, help="PNG of pool memory against tokens")
    parser.add_argument(
        "--replot", type=Path, nargs="+", metavar="JSONL",
        help="no run: draw --plot from these saved JSON lines (contenders run apart)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot")
        records = common.saved_records(parser, args.replot, lambda r: "series" in r)
        plot(records, args.plot, title(records[0]))
        return records
    if args.quick:
        args.tokens, args.window, args.every, args.sample, args.prompt = 48, 16, 8, 4, 10
    model, tokenizer, weights = common.load_model(args.model, args.dtype)
    draft = model if args.draft in (None, args.model) else common.load_model(args.draft)[0]
    prompt = common.book_tokens(tokenizer, args.prompt)
    base = common.base_record(
        "spec_memory",
        args.model,
        weights,
        draft=common.model_label(args.draft or args.model),
        num_draft_tokens=args.num_draft_tokens,
        prompt_tokens=len(prompt),
        sinks=args.sinks,
        window=args.window,
        every=args.every,
    )
    records = []
    for name in args.contenders.split(","):
        records.append(
            common.emit(dict(base, **series_run(name, model, draft, prompt, args)), args.out)
        )
    if args.plot:
        plot(records, args.plot, title(base))
    return records


if __name__ == "__main__":
    main()
