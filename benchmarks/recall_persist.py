"""Saving and restoring the recall tier: bytes, seconds, memory, and bit-identity.

One JSON line per store kind (``recall-persist``): a book fed through a window with
recall, the cache saved (``save_cache``: the file and its ``.recall`` folder) and
loaded into a fresh cache (``load_cache``); then both the restored cache and the one
that never stopped are fed the same next tokens in the same calls, and their logits
compared (``identical``: bit for bit, and ``max_abs_diff``). Seconds and bytes of the
save and the load; the peak of host memory allocated (numpy and Python, traced by
``tracemalloc``) during each, and the process's RSS peak above its level before each,
sampled every 5 ms (RSS can hide an allocation that reuses freed heap; a spilled store
is copied file to file and mapped again, so neither should grow with its size).

    python benchmarks/recall_persist.py --tokens 8192 --out benchmarks/results/recall_persist/recall_persist.jsonl
"""

from __future__ import annotations

import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

from common import (  # first: it preloads OpenBLAS before mlx.core
    base_parser,
    base_record,
    book_tokens,
    emit,
    load_model,
    main_guard,
)

from mlx_stream.cache import make_sink_cache, max_call_tokens
from mlx_stream.cache.sink import load_cache, save_cache
from mlx_stream.recall import RecallSpec, persist, tier_of

STORES = {
    "float": {},
    "float-spilled": {"ram_bytes": 0},
    "4bit": {"bits": 4},
    "4bit-spilled": {"bits": 4, "ram_bytes": 0},
}


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Peak:
    """The RSS peak above the level at entry, sampled every 5 ms in a thread, and the
    peak of traced allocations."""

    def __enter__(self):
        tracemalloc.start()
        self.base = self.peak = rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.005):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, rss())
        self.mb = (self.peak - self.base) / 1e6
        self.traced_mb = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()


def feed(model, cache, tokens, chunk: int) -> list:
    import mlx.core as mx

    out, i = [], 0
    while i < len(tokens):
        n = min(chunk, max_call_tokens(cache) or chunk, len(tokens) - i)
        logits = model(mx.array([tokens[i : i + n]]), cache=cache)[0]
        mx.eval(logits)
        out.append(logits)
        i += n
    return out


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> list[dict]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens fed before the save")
    parser.add_argument("--after", type=int, default=256, help="tokens fed after it")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--stores", default=",".join(STORES), help="of " + ",".join(STORES))
    parser.add_argument("--book", default="moby_dick")
    args = parser.parse_args(argv)
    import mlx.core as mx  # after common: OpenBLAS is preloaded first

    if args.quick:  # the tiny test model: its head dimension (16) takes no 4-bit group
        args.tokens, args.after, args.window = 400, 64, 32
        args.stores = "float,float-spilled"
    model, tokenizer, weights = load_model(args.model, args.dtype)
    tokens = book_tokens(tokenizer, args.tokens + args.after, args.book)
    before, after = tokens[: args.tokens], tokens[args.tokens :]
    records = []
    for name in args.stores.split(","):
        with tempfile.TemporaryDirectory(prefix="recall-persist-") as tmp:
            tmp = Path(tmp)
            spec = RecallSpec(**STORES[name], folder=str(tmp / "store"))
            cache = make_sink_cache(model, args.sinks, args.window, recall=spec)
            tic = time.perf_counter()
            feed(model, cache, before, args.chunk)
            fed_s = time.perf_counter() - tic
            tier = tier_of(cache)
            path = tmp / "c.safetensors"
            with Peak() as saving:
                tic = time.perf_counter()
                save_cache(path, cache)
                save_s = time.perf_counter() - tic
            with Peak() as loading:
                tic = time.perf_counter()
                restored, _ = load_cache(path, model, spec)
                load_s = time.perf_counter() - tic
            back = tier_of(restored)
            want = mx.concatenate(feed(model, cache, after, args.chunk))
            got = mx.concatenate(feed(model, restored, after, args.chunk))
            record = base_record(
                "recall-persist", args.model, weights, store=name, tokens=args.tokens,
                after=len(after), window=args.window, sinks=args.sinks, blocks=spec.blocks,
                stored_blocks=tier.stored, store_mb=tier.store_nbytes / 1e6,
                store_disk_mb=tier.store.disk_bytes / 1e6,
                file_mb=path.stat().st_size / 1e6,
                sidecar_mb=folder_bytes(persist.sidecar(path)) / 1e6,
                sidecar_files=len(list(persist.sidecar(path).iterdir())),
                fed_s=fed_s, save_s=save_s, load_s=load_s,
                save_rss_peak_mb=saving.mb, load_rss_peak_mb=loading.mb,
                save_alloc_peak_mb=saving.traced_mb, load_alloc_peak_mb=loading.traced_mb,
                restored_disk_mb=back.store.disk_bytes / 1e6,
                identical=bool(mx.array_equal(got, want)),
                max_abs_diff=mx.abs(got - want).max().item(),
                same_selections=back.history == tier.history,
            )  # fmt: skip
            records.append(emit(record, args.out))
            back.close()
            tier.close()
    return records


if __name__ == "__main__":
    main_guard(main)
