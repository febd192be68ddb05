"""Batched decode across sessions: mlx-stream's ``Batch`` vs mlx-lm's ``BatchGenerator``.

For each B in ``--batches`` (default 1, 2, 4, 8), B sessions are each fed a different
``--context``-token stretch of Moby-Dick (default 1,100: past the window, so every
mlx-stream ring has wrapped), then decode ``--tokens`` greedy tokens each, all B in
lockstep:

- ``mlx-stream``: :class:`mlx_stream.generate.batch.Batch`, one row per session on its own
  ``make_sink_cache(model, sinks, window)`` (one batched model call per step);
- ``mlx-lm``: ``mlx_lm.generate.BatchGenerator`` (continuous batching, its growing
  ``BatchKVCache``; ``--mlx-lm-max-kv`` gives it a ``BatchRotatingKVCache`` instead).

Only decode steps are timed (prefill is not). Both engines hold their B sessions at
once and decode in alternating blocks of ``--block`` steps, so machine noise falls on
both alike. One JSON line per (engine, B): aggregate tok/s (B x steps / time), the
per-session p50/p90 of the step time (a block's time over its steps; each session gets
one token per step), KV bytes
per session (exact, from the caches) and the process's active memory (both engines'). A summary line holds the targets: mlx-stream at the largest B over itself
at B=1 (target >= 3) and over mlx-lm at the largest B (target >= 1).

    python benchmarks/batch.py --tokens 24      # 34 min at load average 15-18 on 2 cores
    python benchmarks/batch.py --batches 1,8    # the two ends only
    python benchmarks/batch.py --table benchmarks/results/batch/batch.jsonl   # README table
"""

from __future__ import annotations

import time
from pathlib import Path

import common


def tree_bytes(caches) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    arrays = tree_flatten([c.state for c in caches])
    return sum(a.nbytes for _, a in arrays if isinstance(a, mx.array))


def prompts_for(tokenizer, B: int, context: int) -> list[list[int]]:
    """B different ``context``-token stretches of the book."""
    tokens = common.book_tokens(tokenizer, context * B)
    return [tokens[i * context : (i + 1) * context] for i in range(B)]


class Ours:
    """mlx-stream: one ``Batch`` row per session, each on its own sink cache."""

    def __init__(self, model, prompts, args):
        from mlx_stream.cache.sink import make_sink_cache
        from mlx_stream.generate.batch import Batch

        self.batch = Batch(model, prefill_chunk=512)
        self.rows = [
            self.batch.add(make_sink_cache(model, args.sinks, args.window), p) for p in prompts
        ]
        while self.batch.waiting:  # prefill (not timed)
            self.batch.step()
        self.step()

    def step(self) -> None:
        self.batch.step()
        for r in self.rows:
            r.inbox.clear()

    def kv_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.batch.layers)

    def close(self) -> None:
        for r in list(self.rows):
            self.batch.remove(r)


class MlxLm:
    """mlx-lm: ``BatchGenerator`` (continuous batching, its growing ``BatchKVCache``)."""

    def __init__(self, model, prompts, args):
        from mlx_lm.generate import BatchGenerator

        self.B = len(prompts)
        self.gen = BatchGenerator(
            model,
            max_tokens=args.tokens + 4,
            completion_batch_size=self.B,
            prefill_batch_size=self.B,
            prefill_step_size=512,
            max_kv_size=args.mlx_lm_max_kv,
        )
        self.gen.insert(prompts)
        while not self.gen.next_generated():  # prefill (not timed) until the first tokens
            pass
        self.step()

    def step(self) -> None:
        responses = self.gen.next_generated()
        assert len(responses) == self.B, f"{len(responses)} of {self.B} sessions stepped"

    def kv_bytes(self) -> int:
        from mlx_stream.mlxlm import batch_caches

        return tree_bytes(batch_caches(self.gen))

    def close(self) -> None:
        self.gen.close()


ENGINES = {"mlx-stream": Ours, "mlx-lm": MlxLm}


def run_both(model, prompts, args) -> dict[str, dict]:
    """Both engines prefilled, then stepped in alternating blocks of ``--block`` steps
    (one engine's block, then the other's), so a load swing on this shared machine falls
    on both alike. Within a block each engine pipelines its steps as it does in use; a
    block ends when its last step's work is done, so none spills into the other's."""
    import mlx.core as mx

    engines = {name: cls(model, prompts, args) for name, cls in ENGINES.items()}
    mx.synchronize()
    times: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    for b in range(-(-args.tokens // args.block)):
        steps = min(args.block, args.tokens - b * args.block)
        for name in order if b % 2 == 0 else order[::-1]:
            tic = time.perf_counter()
            for _ in range(steps):
                engines[name].step()
            mx.synchronize()
            times[name] += [(time.perf_counter() - tic) / steps] * steps
    memory = common.memory_mb()  # both engines' sessions are alive: the process's total
    out = {name: {"times": times[name], "kv_bytes": e.kv_bytes(), **memory}
           for name, e in engines.items()}  # fmt: skip
    for e in engines.values():
        e.close()
    del engines
    mx.clear_cache()
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8", help="sessions decoded together")
    parser.add_argument("--context", type=int, default=1100, help="tokens fed per session")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    parser.add_argument("--block", type=int, default=8, help="steps per timed block")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
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
        results = run_both(model, prompts, args)
        for engine, result in results.items():
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
