"""Where retrieved blocks go, against streaming perplexity: the window alone, then the
window with recall whose every selection is placed ``stream`` / ``near`` / ``before`` /
``fixed`` (``prompt_placement`` is never used: a stream has no prompt end).

One JSON line per placement: perplexity over the first ``--tokens`` tokens of a book,
fed as one stream (``stream_perplexity``, what ``stream-run`` uses), and the seconds.

    python benchmarks/recall_placement.py --book moby_dick --tokens 6144 \\
        --placements window,near,stream --out benchmarks/results/recall_placement/recall_placement.jsonl
"""

from __future__ import annotations

import time

from common import (  # first: it preloads OpenBLAS before mlx.core
    base_parser,
    base_record,
    book_tokens,
    emit,
    load_model,
    main_guard,
)

from mlx_stream.cache.spec import CacheSpec
from mlx_stream.eval.perplexity import stream_perplexity
from mlx_stream.recall import RecallSpec


def main(argv: list[str] | None = None) -> list[dict]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--book", default="moby_dick")
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--placements", default="window,near,stream")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8, help="recall blocks (k)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.window = 400, 64
    model, tokenizer, weights = load_model(args.model, args.dtype)
    tokens = book_tokens(tokenizer, args.tokens, args.book)
    records = []
    for name in args.placements.split(","):
        recall = None if name == "window" else RecallSpec(
            blocks=args.blocks, placement=name, prompt_placement=None)  # fmt: skip
        spec = CacheSpec(sinks=args.sinks, window=args.window, recall=recall)
        tic = time.perf_counter()
        result = stream_perplexity(model, tokens, cache_spec=spec, segment=len(tokens))
        records.append(emit(base_record(
            "recall-placement", args.model, weights, book=args.book, tokens=len(tokens),
            window=args.window, sinks=args.sinks, blocks=args.blocks, placement=name,
            perplexity=round(result.perplexity, 4),
            seconds=round(time.perf_counter() - tic, 1)), args.out))  # fmt: skip
    return records


if __name__ == "__main__":
    main_guard(main)
