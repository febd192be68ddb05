"""Batched decode across sessions: mlx-stream's ``Batch`` vs mlx-lm's ``BatchGenerator``.

For each B in ``--batches`` (default 1, 2, 4, 8), B sessions are each fed a different
``--context``-token stretch of Moby-Dick (default 1,100: past the window, so every
mlx-stream ring has wrapped), then decode ``--tokens`` greedy tokens each, all B in
lockstep:

- ``mlx-stream``: :class:`mlx_stream.batch.Batch`, one row per session on its own
  ``make_sink_cache(model, sinks, window)`` (one batched model call per step);
- ``mlx-lm``: ``mlx_lm.generate.BatchGenerator`` (continuous batching, its growing
  ``BatchKVCache``; ``--mlx-lm-max-kv`` gives it a ``BatchRotatingKVCache`` instead).

Only decode steps are timed (prefill is not). One JSON line per (engine, B): aggregate
tok/s (B x steps / time), the per-session p50/p90 of the step time (each session gets
one token per step), KV bytes per session (exact, from the caches) and the process's
active memory. The two engines alternate per B (``--repeats``), so machine noise falls on
both alike. A summary line holds the targets: mlx-stream at the largest B over itself
at B=1 (target >= 3) and over mlx-lm at the largest B (target >= 1).

    python benchmarks/batch.py --tokens 24      # 34 min at load average 15-18 on 2 cores
    python benchmarks/batch.py --batches 1,8    # the two ends only
    python benchmarks/batch.py --table benchmarks/results/batch.jsonl   # README table
"""

from __future__ import annotations

import time
from pathlib import Path

import common

ENGINES = ("mlx-stream", "mlx-lm")


def tree_bytes(caches) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    arrays = tree_flatten([c.state for c in caches])
    return sum(a.nbytes for _, a in arrays if isinstance(a, mx.array))


def prompts_for(tokenizer, B: int, context: int) -> list[list[int]]:
    """B different ``context``-token stretches of the book."""
    tokens = common.book_tokens(tokenizer, context * B)
    return [tokens[i * context : (i + 1) * context] for i in range(B)]


def run_ours(model, prompts, args) -> dict:
    import mlx.core as mx

    from mlx_stream.batch import Batch
    from mlx_stream.cache import make_sink_cache

    batch = Batch(model, prefill_chunk=512)
    rows = [batch.add(make_sink_cache(model, args.sinks, args.window), p) for p in prompts]
    while batch.waiting:  # prefill (not timed)
        batch.step()
    for r in rows:
        r.inbox.clear()
    times = []
    for _ in range(args.tokens):
        tic = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - tic)
        for r in rows:
            r.inbox.clear()
    kv = sum(layer.nbytes for layer in batch.layers)
    memory = common.memory_mb()
    for r in list(rows):
        batch.remove(r)
    mx.clear_cache()
    return {"times": times, "kv_bytes": kv, **memory}


def run_mlx_lm(model, prompts, args) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    B = len(prompts)
    gen = BatchGenerator(
        model,
        max_tokens=args.tokens + 2,
        completion_batch_size=B,
        prefill_batch_size=B,
        prefill_step_size=512,
        max_kv_size=args.mlx_lm_max_kv,
    )
    gen.insert(prompts)
    produced = 0
    while produced == 0:  # prefill (not timed) until the first tokens come
        produced = len(gen.next_generated())
    times = []
    for _ in range(args.tokens):
        tic = time.perf_counter()
        responses = gen.next_generated()
        times.append(time.perf_counter() - tic)
        assert len(responses) == B, f"{len(responses)} of {B} sessions stepped"
    kv = tree_bytes(gen._generation_batch.prompt_cache)
    memory = common.memory_mb()
    gen.close()
    del gen
    mx.clear_cache()
    return {"times": times, "kv_bytes": kv, **memory}


RUNNERS = {"mlx-stream": run_ours, "mlx-lm": run_mlx_lm}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8", help="sessions decoded together")
    parser.add_argument("--context", type=int, default=1100, help="tokens fed per session")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--mlx-lm-max-kv", type=int, default=None, help="mlx-lm's BatchRotatingKVCache size"
    )
    parser.add_argument("--table", type=Path, help="print the README table of a results file")
    args = parser.parse_args(argv)
    if args.table is not None:
        text = table(
            common.saved_records(parser, [args.table], lambda r: r.get("bench") == "batch")
        )
        print(text)
        return []
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches must be integers separated by commas (got {args.batches!r})")
    if args.quick:
        batches, args.context, args.tokens, args.window = [1, 2], 40, 4, 32
    model, tokenizer, weights = common.load_model(args.model, args.dtype)
    records = []
    for B in batches:
        prompts = prompts_for(tokenizer, B, args.context)
        for engine in common.interleave(ENGINES, args.repeats):
            result = RUNNERS[engine](model, prompts, args)
            times = result.pop("times")
            record = common.base_record(
                "batch", args.model, weights, engine=engine, sessions=B,
                context=args.context, window=args.window, sinks=args.sinks,
                tokens=args.tokens,
                tok_s=round(B * len(times) / sum(times), 2),
                p50_ms=round(1e3 * common.percentile(times, 50), 2),
                p90_ms=round(1e3 * common.percentile(times, 90), 2),
                kv_mb_per_session=round(result.pop("kv_bytes") / B / 1e6, 3),
                **result,
            )  # fmt: skip
            records.append(common.emit(record, args.out))
    records.append(common.emit(summary(records, batches, args), args.out))
    return records


def summary(records: list[dict], batches: list[int], args) -> dict:
    def best(engine, B):
        return max(r["tok_s"] for r in records if r["engine"] == engine and r["sessions"] == B)

    top = max(batches)
    out = {"bench": "batch", "summary": True, "largest_batch": top}
    if 1 in batches:
        out["ours_scaling"] = round(best("mlx-stream", top) / best("mlx-stream", 1), 2)
        out["mlx_lm_scaling"] = round(best("mlx-lm", top) / best("mlx-lm", 1), 2)
    out["ours_over_mlx_lm"] = {
        B: round(best("mlx-stream", B) / best("mlx-lm", B), 2) for B in batches
    }
    return out


def table(records: list[dict]) -> str:
    """The README table: one line per B, both engines side by side."""
    rows = [r for r in records if not r.get("summary")]
    lines = [
        "| sessions | mlx-stream tok/s | mlx-lm tok/s | ours/mlx-lm | mlx-stream p50 ms "
        "| mlx-lm p50 ms | KV MB/session (mlx-stream) | KV MB/session (mlx-lm) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for B in sorted({r["sessions"] for r in rows}):
        ours = max((r for r in rows if r["sessions"] == B and r["engine"] == "mlx-stream"),
                   key=lambda r: r["tok_s"])  # fmt: skip
        theirs = max((r for r in rows if r["sessions"] == B and r["engine"] == "mlx-lm"),
                     key=lambda r: r["tok_s"])  # fmt: skip
        lines.append(
            f"| {B} | {ours['tok_s']} | {theirs['tok_s']} | "
            f"{ours['tok_s'] / theirs['tok_s']:.2f} | {ours['p50_ms']} | {theirs['p50_ms']} | "
            f"{ours['kv_mb_per_session']} | {theirs['kv_mb_per_session']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    common.main_guard(main)
