"""What the window forgets: divergence from the full cache on books, and passkey recall.

The engine of ``mlx-stream eval divergence`` / ``eval recall`` over a grid, one JSON
line per policy and book (``forget-divergence``) and per window and placement
(``forget-recall``); ``--table FILE`` renders saved lines as the README's tables.

    python benchmarks/forget.py --book botchan --window 256,1024 --sinks 0,4 \\
        --out benchmarks/results/forget/forget.jsonl
    python benchmarks/forget.py --recall-only --window 256 --trials 3 --out ...
    python benchmarks/forget.py --table benchmarks/results/forget/forget.jsonl
"""

from __future__ import annotations

import time
from pathlib import Path

from common import (  # first: it preloads OpenBLAS before mlx.core
    base_parser,
    base_record,
    book_tokens,
    emit,
    load_model,
    main_guard,
)

from mlx_stream.eval.divergence import POSITIONS, Policy, divergence, sample_points
from mlx_stream.eval.passkey import PLACEMENTS, check_prompts, recall

KV = {"float": (None, None), "8": (8, None), "4": (4, None), "4k8": (4, 8)}


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def words(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def context_of(model) -> int | None:
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--book", action="append", help="book(s) in benchmarks/data (repeat)")
    parser.add_argument("--tokens", type=int, default=2048, help="teacher-forced tokens")
    parser.add_argument("--window", type=ints, default=[256, 1024])
    parser.add_argument("--sinks", type=ints, default=[0, 4])
    parser.add_argument("--positions", type=words, default=["cache"])
    parser.add_argument("--kv", type=words, default=["float"], help="float, 8, 4, 4k8")
    parser.add_argument("--points", type=int, default=4)
    parser.add_argument("--generate", type=int, default=24)
    parser.add_argument("--trials", type=int, default=3, help="pass keys per recall cell")
    parser.add_argument("--recall-only", action="store_true")
    parser.add_argument("--divergence-only", action="store_true")
    parser.add_argument("--table", type=Path, help="render saved JSON lines and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(render(read_lines(args.table)))
        return []
    if args.quick:  # the tiny model: a few tokens, a few trials
        args.tokens, args.window, args.trials, args.points = 160, [32], 1, 2
        args.generate, args.kv = 4, ["float"]
    model, tokenizer, weights = load_model(args.model, args.dtype)
    context = context_of(model)
    records = []
    if not args.recall_only:
        policies = [
            Policy(s, w, p, *KV[kv]) for w in args.window for s in args.sinks
            for p in args.positions for kv in args.kv if not (p == "rotating" and kv != "float")
        ]  # fmt: skip
        for book in args.book or ["botchan"]:
            tokens = book_tokens(tokenizer, min(args.tokens, context or args.tokens), book)
            points = sample_points(len(tokens), args.points, args.generate)
            tic = time.perf_counter()
            results = divergence(model, tokens, policies, points=points, generate=args.generate)
            seconds = time.perf_counter() - tic
            for r in results:
                summary = r.summary(segment=max(len(tokens) // 4, 1))
                records.append(emit(
                    base_record("forget-divergence", args.model, weights, book=book,
                                generate=args.generate, run_seconds=round(seconds, 1),
                                policies_in_run=len(policies), **summary),
                    args.out,
                ))  # fmt: skip
    if not args.divergence_only:
        check_prompts(tokenizer, args.window, PLACEMENTS, 4, context, 12)
        tic = time.perf_counter()
        rows = recall(model, tokenizer, args.window, trials=args.trials, context=context)
        seconds = time.perf_counter() - tic
        for row in rows:
            records.append(emit(
                base_record("forget-recall", args.model, weights, run_seconds=round(seconds, 1),
                            **row),
                args.out,
            ))  # fmt: skip
    return records


def read_lines(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _f(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render(records: list[dict]) -> str:
    """Markdown tables: divergence per book and policy, then recall."""
    out = []
    div = [r for r in records if r.get("bench") == "forget-divergence"]
    if div:
        out += ["| book | tokens scored | window | sinks | positions | KV | KL | top-1 | KL evicted | "
                "top-1 evicted | ppl | full ppl | first divergence | mismatch after |",
                "|" + "---|" * 14]  # fmt: skip
        kv_order = ["float", "8", "4k8", "4"]
        div.sort(key=lambda r: (r["book"], r["tokens"], r["window"], r["sinks"],
                                POSITIONS.index(r["positions"]), kv_order.index(r["kv"])))  # fmt: skip
        for r in div:
            first = r["first_divergence_median"]
            out.append(
                f"| {r['book']} | {r['tokens']} | {r['window']} | {r['sinks']} | "
                f"{r['positions']} | {r['kv']} | {_f(r['kl'], '.3f')} | "
                f"{_f(r['top1_agreement'], '.3f')} | {_f(r['kl_evicted'], '.3f')} | "
                f"{_f(r['top1_agreement_evicted'], '.3f')} | {_f(r['perplexity'], '.2f')} | "
                f"{_f(r['reference_perplexity'], '.2f')} | "
                f"{'none in ' + str(r['generate']) if first is None else f'{first:g}'} | "
                f"{_f(r['mismatch_after_divergence'], '.2f')} |"
            )
    rec = [r for r in records if r.get("bench") == "forget-recall"]
    if rec:
        out += ["", "| window | placement | key distance (tokens) | sinks | accuracy | "
                "full cache | trials |", "|" + "---|" * 7]  # fmt: skip
        for r in rec:
            out.append(
                f"| {r['window']} | {r['placement']} | {r['key_distance']} | {r['sinks']} | "
                f"{r['accuracy']:.2f} | {r['reference_accuracy']:.2f} | {r['trials']} |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    main_guard(main)
