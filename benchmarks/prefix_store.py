"""A second process with the same long system prompt: time to first token with the
prefix store on disk (``mlx_stream.prefix_store``) against the first process.

One JSON line (``prefix-store``): three fresh processes in turn, each loading the model
and asking one question under the same ~2,000-token system prompt (the start of a book,
as a ChatSession's system prompt with chat's default cache), greedy:

- ``first``: an empty store: the system prompt is prefilled, then put in the store;
- ``second``: the same store: the system prompt's caches are read from it;
- ``no_store``: ``--no-prefix-store`` (chat before the store: the system prompt goes in
  with the first turn in one prefill).

Time to first token is from the question to its first token (model load excluded, the
store's read or prefill + write included); ``speedup`` is first / second;
``identical`` says whether the second's greedy reply equals the first's token for
token (``same_as_no_store``: the no-store process's too).

    python benchmarks/prefix_store.py --out benchmarks/results/prefix_store/prefix_store.jsonl
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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

QUESTION = "In one sentence: who tells this story?"


def child(args) -> None:
    """One process: load, ask, print one JSON line."""
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.model_config import end_of_turn_tokens
    from mlx_stream.generate.session import ChatSession, Settings
    from mlx_stream.models.loader import resolve
    from mlx_stream.models.registry import load_registry
    from mlx_stream.prefix_store import PrefixStore

    tic = time.perf_counter()
    model, tokenizer, weights = load_model(args.model, args.dtype)
    load_s = time.perf_counter() - tic
    system = tokenizer.decode(book_tokens(tokenizer, args.system_tokens))
    registry = load_registry()
    entry = registry.models.get(args.model) if args.model in registry.models else None
    cache = CacheSpec.for_model(entry)
    settings = Settings(cache=cache, max_tokens=args.max_tokens, temp=0.0,
                        stop_tokens=end_of_turn_tokens(tokenizer))  # fmt: skip
    store = None if args.store is None else PrefixStore(args.store).bind(resolve(args.model)[0])
    session = ChatSession(model, tokenizer, settings, system=system, prefix_store=store)
    first = None
    tokens = []
    tic = time.perf_counter()
    for response in session.stream(QUESTION):
        if first is None:
            first = time.perf_counter() - tic
        tokens.append(response.token)
    total = time.perf_counter() - tic
    out = {
        "weights": weights,
        "load_s": round(load_s, 3),
        "system_tokens": session.system_tokens(),
        "cache": cache.to_json(),
        "ttft_s": round(first, 3),
        "reply_s": round(total, 3),
        "reply_tokens": tokens,
        "reply": session.last.text,
    }
    if store is not None:
        out.update(hits=store.hits, misses=store.misses, writes=store.writes,
                   store_bytes=store.size())  # fmt: skip
    print(json.dumps(out), flush=True)


def run_child(args, store: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype,
           "--system-tokens", str(args.system_tokens), "--max-tokens", str(args.max_tokens)]  # fmt: skip
    if store is not None:
        cmd += ["--store", str(store)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        sys.exit(f"child failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict] | None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--child", action="store_true", help=argparse_hidden())
    parser.add_argument("--store", type=Path, help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.quick:
        args.system_tokens, args.max_tokens = min(args.system_tokens, 200), 8
    if args.child:
        child(args)
        return None
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "prefixes"
        first = run_child(args, store)
        second = run_child(args, store)
    plain = run_child(args, None)
    assert first["misses"] == 1 and first["writes"] == 1, first
    assert second["hits"] == 1, second
    record = base_record(
        "prefix-store", args.model, first["weights"],
        system_tokens=first["system_tokens"], cache=first["cache"],
        reply_tokens=len(first["reply_tokens"]),
        ttft_first_s=first["ttft_s"], ttft_second_s=second["ttft_s"],
        ttft_no_store_s=plain["ttft_s"],
        speedup=round(first["ttft_s"] / second["ttft_s"], 1),
        identical=first["reply_tokens"] == second["reply_tokens"],
        same_as_no_store=plain["reply_tokens"] == first["reply_tokens"],
        store_bytes=first["store_bytes"], load_s=second["load_s"],
        reply=second["reply"],
    )  # fmt: skip
    return [emit(record, args.out)]


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main_guard(main)
