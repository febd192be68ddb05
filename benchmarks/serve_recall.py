"""``serve --recall``: what one session costs as its conversation grows, with and without
the recall tier, served by the engine of ``mlx-stream serve`` in this process.

Two engines share the model: the window alone and the window with recall (each session
its own store, ``--recall-ram`` MB of host memory then disk). One session in each is
fed the same ``--turns`` user turns of ``--turn-tokens`` tokens of a book, interleaved
turn by turn (machine noise hits both alike), each answered with ``--reply`` greedy
tokens. One JSON line per turn and engine (``serve-recall``): the tokens the session has
seen, its device bytes (caches + recall region: flat), its store bytes (host memory,
disk: growing), blocks stored, MLX active memory and the turn's seconds; the last line
of each engine also carries the budget's cost of one session.

    python benchmarks/serve_recall.py --window 512 --turns 8 --turn-tokens 1000 \\
        --out benchmarks/results/serve_recall/serve_recall.jsonl
"""

from __future__ import annotations

import queue
import tempfile
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
from mlx_stream.generate.session import Settings
from mlx_stream.recall import RecallSpec
from mlx_stream.serve.engine import Engine, Request
from mlx_stream.serve.event_types import Delta, End, Failed


def ask(engine: Engine, messages: list[dict], session_id: str) -> str:
    """One request to its end; the reply's text."""
    box: queue.Queue = queue.Queue()
    engine.submit(Request(emit=box.put, messages=messages, session_id=session_id))
    parts = []
    while not isinstance(event := box.get(timeout=3600), (End, Failed)):
        if isinstance(event, Delta):
            parts.append(event.text)
    if isinstance(event, Failed):
        raise RuntimeError(f"request failed: {event.error}") from event.error
    return "".join(parts)


def main(argv: list[str] | None = None) -> None:
    import mlx.core as mx

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=1000)
    parser.add_argument("--reply", type=int, default=8, help="greedy tokens per reply")
    parser.add_argument("--recall-blocks", type=int, default=8)
    parser.add_argument("--recall-ram", type=int, default=64, help="MB per session")
    parser.add_argument("--book", default="moby_dick")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.turn_tokens, args.window = 3, 200, 64
    model, tokenizer, weights = load_model(args.model, args.dtype)
    tokens = book_tokens(tokenizer, args.turns * args.turn_tokens, args.book)
    turns = [tokenizer.decode(tokens[i : i + args.turn_tokens])
             for i in range(0, len(tokens), args.turn_tokens)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="serve-recall-") as tmp:
        recall = RecallSpec(blocks=args.recall_blocks, ram_bytes=args.recall_ram * 1_000_000,
                            folder=f"{tmp}/store")  # fmt: skip
        engines = {}
        for name, spec in (("window", None), ("recall", recall)):
            cache = CacheSpec(sinks=args.sinks, window=args.window, recall=spec)
            settings = Settings(cache, max_tokens=args.reply)
            engines[name] = Engine(model, tokenizer, settings, "bench", keep_system=False)
            engines[name].start()
        messages = {name: [] for name in engines}
        try:
            for turn, text in enumerate(turns, 1):
                for name, engine in engines.items():
                    messages[name].append({"role": "user", "content": text})
                    tic = time.perf_counter()
                    reply = ask(engine, messages[name], "s")
                    seconds = time.perf_counter() - tic
                    messages[name].append({"role": "assistant", "content": reply})
                    engine.call(engine.publish).result()
                    (s,) = engine.stats["sessions"]
                    last = turn == len(turns)
                    emit(base_record(
                        "serve-recall", args.model, weights, cache=name, window=args.window,
                        sinks=args.sinks, turn=turn, tokens_seen=s["tokens_seen"],
                        device_bytes=s["device_bytes"], region_bytes=s["region_bytes"],
                        store_bytes=s["store_bytes"], store_ram_bytes=s["store_ram_bytes"],
                        store_disk_bytes=s["store_disk_bytes"], blocks_stored=s["blocks_stored"],
                        mlx_active_bytes=mx.get_active_memory(), seconds=round(seconds, 3),
                        recall_blocks=args.recall_blocks if name == "recall" else None,
                        recall_ram_mb=args.recall_ram if name == "recall" else None,
                        **({"session_budget_bytes": engine.session_bytes(args.sinks)}
                           if last else {}),
                    ), args.out)  # fmt: skip
        finally:
            for engine in engines.values():
                engine.stop()


if __name__ == "__main__":
    main_guard(main)
