"""Soak: one stream of a million tokens through ``stream-run``'s engine, in fixed memory.

The books in ``benchmarks/data`` are repeated end to end as one token stream and fed
through ``mlx_stream.eval.perplexity.stream_perplexity`` (what ``mlx-stream stream-run`` runs)
with the sink + window cache. Every ``--sample`` tokens one JSON line records MLX's
active memory, its buffer pool, the process's resident memory, the cache's RoPE offset
(bounded by ``max_offset``) and the perplexity of the tokens since the previous line.
Lines are appended to ``--out`` as they come, so a run cut short keeps what it measured;
the plot is redrawn every ``--plot-every`` samples and at the end.

A million tokens take hours on a CPU. With ``--checkpoint FILE`` the run saves
``stream-run``'s checkpoint at every sample and on Ctrl-C or SIGTERM, and the same
command run again resumes it (the engine checks the model, settings and the text
consumed against the checkpoint), so a soak can run in legs: each leg is a new process
and its lines (``leg`` 1, 2, ...) continue the run's lines in ``--out``.

    OPENBLAS_NUM_THREADS=1 nice python benchmarks/soak.py --tokens 1000000 --window 1024 \
        --checkpoint soak.safetensors --out results/soak/soak.jsonl --plot results/soak/soak.png
    python benchmarks/soak.py --quick                          # 4k tokens, window 64
    python benchmarks/soak.py --replot results/soak/soak.jsonl --plot results/soak/soak.png  # + summary
"""

from __future__ import annotations

import itertools
import json
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import common

BOOKS = ("moby_dick", "paradise_lost", "botchan", "alice_in_wonderland")


def book_stream(tokenizer, books=BOOKS) -> Iterator[int]:
    """The books tokenized block by block, one after another, forever."""
    from mlx_stream.eval.perplexity import iter_tokens

    first = True
    while True:
        for book in books:
            path = common.data_dir() / f"{book}.txt"
            yield from iter_tokens(path, tokenizer, add_special_tokens=first)
            first = False


def book_lengths(tokenizer, books=BOOKS) -> list[tuple[str, int, int]]:
    """Each book's tokens in :func:`book_stream`: ``(book, first pass, later passes)``
    (only the first book of the first pass carries the tokenizer's special tokens)."""
    from mlx_stream.eval.perplexity import iter_tokens

    # iter_tokens gives only its first block the special tokens: count them once
    # instead of tokenizing the first book twice.
    specials = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))
    out = []
    for i, book in enumerate(books):
        path = common.data_dir() / f"{book}.txt"
        later = sum(1 for _ in iter_tokens(path, tokenizer, add_special_tokens=False))
        out.append((book, later + (specials if i == 0 else 0), later))
    return out


def saved_lengths(records: list[dict]) -> list | None:
    """:func:`book_lengths` for the model of saved lines, if it is pulled here."""
    from mlx_lm.utils import load_tokenizer

    from mlx_stream.errors import UserError
    from mlx_stream.models.loader import resolve

    try:
        folder, _ = resolve(records[0]["model"], pull=False)
    except (UserError, KeyError, IndexError):
        return None
    return book_lengths(load_tokenizer(folder))


def by_book(records: list[dict], lengths: list[tuple[str, int, int]]) -> dict[str, dict]:
    """Each book's segment perplexity on each pass through the books, from the samples
    whose segment lies within one book: ``median_by_pass`` and ``same_text_ratio``, the
    median over later-pass segments of their perplexity over the first pass's on the
    same text (the first-pass segments it overlaps, weighted by overlap, in log space).
    The same text read again a pass later must score the same: drift would raise it."""
    import statistics

    spans, start, end = [], 0, max((r["tokens"] for r in records), default=0)
    for n in itertools.count():
        for book, first, later in lengths:
            size = first if n == 0 else later
            spans.append((book, n, start, start + size))
            start += size
        if start >= end:
            break
    extra = {book: first - later for book, first, later in lengths}
    # (book, pass) -> [(start in the book, end in the book, log perplexity)]
    found: dict[tuple[str, int], list[tuple[int, int, float]]] = {}
    for r in records:
        lo, hi = r["tokens"] - r["segment_tokens"], r["tokens"]
        for book, n, a, b in spans:
            if a <= lo and hi <= b:
                shift = extra[book] if n == 0 else 0  # the first pass's special tokens
                item = (lo - a - shift, hi - a - shift, math.log(r["segment_ppl"]))
                found.setdefault((book, n), []).append(item)
    out: dict[str, dict] = {}
    for book in extra:
        passes = sorted(n for b, n in found if b == book)
        if not passes:
            continue
        ratios = []
        for n in passes[1:]:
            for lo, hi, nll in found[book, n]:
                weights = [(min(hi, b) - max(lo, a), x) for a, b, x in found.get((book, 0), [])]
                weights = [(w, x) for w, x in weights if w > 0]
                if sum(w for w, _ in weights) >= (hi - lo) * 0.9:  # first pass covers it
                    expected = sum(w * x for w, x in weights) / sum(w for w, _ in weights)
                    ratios.append(math.exp(nll - expected))
        out[book] = {
            "median_by_pass": [
                round(math.exp(statistics.median(x for *_, x in found[book, n])), 3) for n in passes
            ],
            "same_text_ratio": round(statistics.median(ratios), 4) if ratios else None,
            "same_text_segments": len(ratios),
        }
    return out


def rss_mb() -> float | None:
    """Resident memory of this process in MB (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1e3
    except OSError:
        return None
    return None


class Sampler:
    """The stream_perplexity callback: one JSON line every ``every`` tokens."""

    def __init__(self, every: int, out: Path | None, plot: Path | None, plot_every: int,
                 base: dict, earlier: list[dict] = ()):  # fmt: skip
        self.caches: list = []  # set by stream_perplexity's on_cache
        self.every, self.out = every, out
        self.plot, self.plot_every, self.base = plot, plot_every, base
        self.last_position, self.last_nll_sum = 1, 0.0
        self.pool_max = 0  # the pool's largest size seen since the last sample
        self.records: list[dict] = list(earlier)  # the run's lines from earlier legs
        self.tic = time.perf_counter()
        if self.records:  # a resumed leg continues the last line of the earlier ones
            last = self.records[-1]
            self.last_position = last["tokens"]
            self.last_nll_sum = math.log(last["running_ppl"]) * (last["tokens"] - 1)
            self.tic -= last["seconds"]

    def use(self, caches: list) -> None:
        self.caches = caches

    def __call__(self, position: int, perplexity: float, last: bool = False) -> None:
        import mlx.core as mx

        # After every model call (reclaims run every 256 tokens, a sample lands right
        # after one): the pool's peak between samples is what shows it bounded.
        self.pool_max = max(self.pool_max, mx.get_cache_memory())
        crossed = position // self.every != self.last_position // self.every
        if position <= self.last_position or not (crossed or last):
            return

        # Scored tokens are position - 1; the running mean NLL gives the segment's sum.
        nll_sum = math.log(perplexity) * (position - 1)
        scored = position - self.last_position
        segment_nll = (nll_sum - self.last_nll_sum) / scored
        sink = next(c for c in self.caches if hasattr(c, "max_offset"))
        record = dict(
            self.base,
            tokens=position,
            seconds=round(time.perf_counter() - self.tic, 1),
            active_mb=round(mx.get_active_memory() / 1e6, 2),
            pool_mb=round(mx.get_cache_memory() / 1e6, 2),
            pool_max_mb=round(self.pool_max / 1e6, 2),
            peak_mb=round(mx.get_peak_memory() / 1e6, 2),
            rss_mb=rss_mb(),
            cache_nbytes_mb=round(sum(c.nbytes for c in self.caches) / 1e6, 3),
            offset=sink.offset,
            max_offset=sink.max_offset,
            segment_tokens=scored,
            segment_ppl=round(math.exp(segment_nll), 4),
            running_ppl=round(perplexity, 4),
        )
        common.emit(record, self.out)
        self.records.append(record)
        self.last_position, self.last_nll_sum, self.pool_max = position, nll_sum, 0
        if self.plot is not None and len(self.records) % self.plot_every == 0:
            draw(self.records, self.plot)


def draw(records: list[dict], path: Path) -> None:
    """Three panels against tokens: memory, the cache's RoPE offset, segment perplexity."""
    plt = common.pyplot()
    x = [r["tokens"] / 1e6 for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    ax.plot(x, [r["active_mb"] for r in records], label="MLX active")
    peaks = all("pool_max_mb" in r for r in records)  # older runs: at the sample only
    ax.plot(x, [r["pool_max_mb"] if peaks else r["pool_mb"] for r in records],
            label=f"MLX buffer pool ({'max between samples' if peaks else 'at each sample'})")  # fmt: skip
    if all(r.get("rss_mb") is not None for r in records):
        ax.plot(x, [r["rss_mb"] for r in records], label="process RSS")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.legend(loc="center right")
    last = records[-1]
    ax.set_title(
        f"soak: {last['model']}, sinks {last['sinks']} + window {last['window']}, "
        f"{last['tokens']:,} tokens"
    )
    ax = axes[1]
    ax.plot(x, [r["offset"] for r in records], ".", markersize=4, label="cache offset")
    ax.axhline(last["max_offset"], color="gray", linestyle="--", label="max_offset")
    ax.set_ylabel("RoPE position")
    ax.set_ylim(bottom=0)
    ax.legend(loc="center right")
    ax = axes[2]
    ax.plot(x, [r["segment_ppl"] for r in records], label=f"per {last['sample']} tokens")
    ax.set_ylabel("perplexity")
    ax.set_xlabel("tokens streamed (millions)")
    ax.legend(loc="upper right")
    common.save_figure(fig, path)


def summarize(records: list[dict], lengths: list | None = None) -> dict:
    """The soak in one line: memory at the start, the end and its maximum, the pool's
    maximum, the largest offset against its bound, segment perplexity early vs late
    (medians of the first and last quarter of the samples) and, given the books'
    ``lengths``, per book and pass (:func:`by_book`)."""
    import statistics

    # The first sample is taken while the window is still filling; memory is flat after.
    steady = records[1:] or records
    quarter = max(1, len(records) // 4)
    early = statistics.median(r["segment_ppl"] for r in records[:quarter])
    late = statistics.median(r["segment_ppl"] for r in records[-quarter:])
    active = [r["active_mb"] for r in steady]
    return {
        "bench": "soak", "summary": True, "tokens": records[-1]["tokens"],
        "samples": len(records), "seconds": records[-1]["seconds"],
        "active_mb_first": active[0], "active_mb_last": active[-1],
        "active_mb_max": max(active), "active_mb_min": min(active),
        "pool_mb_max": max(r.get("pool_max_mb", r["pool_mb"]) for r in records),
        "rss_mb_first": steady[0].get("rss_mb"), "rss_mb_last": steady[-1].get("rss_mb"),
        "cache_mb": records[-1]["cache_nbytes_mb"],
        "offset_max": max(r["offset"] for r in records), "max_offset": records[-1]["max_offset"],
        "segment_ppl_early": round(early, 3), "segment_ppl_late": round(late, 3),
        "late_over_early": round(late / early, 3),
        **({"segment_ppl_by_book": by_book(records, lengths)} if lengths else {}),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="stream length")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--sample", type=int, default=8192, help="tokens per JSON line")
    parser.add_argument("--plot", type=Path, help="PNG of the samples")
    parser.add_argument("--plot-every", type=int, default=16, help="redraw every N samples")
    parser.add_argument("--replot", type=Path, nargs="+", help="only plot saved JSON lines")
    parser.add_argument(
        "--checkpoint", type=Path, help="save here at every sample; resume from it if it exists"
    )
    args = parser.parse_args(argv)
    if args.replot:
        usable = lambda r: r.get("bench") == "soak" and not r.get("summary")  # noqa: E731
        records = common.saved_records(parser, args.replot, usable)
        draw(records, args.plot or args.replot[0].with_suffix(".png"))
        common.emit(summarize(records, saved_lengths(records)), args.out)  # --out: append
        return records
    if args.quick:
        args.tokens, args.window = min(args.tokens, 4096), 64
        args.sample = min(args.sample, 512)
    from mlx_stream.eval.perplexity import stream_perplexity
    from mlx_stream.generate.decode import StopOnInterrupt

    model, tokenizer, weights = common.load_model(args.model, args.dtype)
    settings = dict(sinks=args.sinks, window=args.window, chunk=args.chunk,
                    sample=args.sample, target_tokens=args.tokens)  # fmt: skip
    run, earlier = time.strftime("%Y%m%dT%H%M%S"), []
    if args.checkpoint is not None and args.checkpoint.exists():
        run, earlier = resume_lines(parser, args.checkpoint, args.out)
    base = common.base_record("soak", args.model, weights, **settings, run=run,
                              leg=1 + max((r["leg"] for r in earlier), default=0))  # fmt: skip
    sampler = Sampler(args.sample, args.out, args.plot, args.plot_every, base, earlier)
    identity = {"bench": "soak", "model": base["model"], "weights": weights, "run": run,
                **settings}  # fmt: skip
    with StopOnInterrupt((signal.SIGINT, signal.SIGTERM)) as stop:
        result = stream_perplexity(
            model, book_stream(tokenizer), sinks=args.sinks, window=args.window,
            chunk=args.chunk, callback=sampler, on_cache=sampler.use, segment=args.sample,
            limit_tokens=args.tokens, checkpoint=args.checkpoint,
            checkpoint_every=args.sample, resume=args.checkpoint is not None,
            identity=identity, should_stop=lambda: stop.interrupted,
        )  # fmt: skip
    if result.checkpoint_error:
        print(f"soak: {result.checkpoint_error}", file=sys.stderr)
    if result.interrupted:
        print(f"soak: stopped at {result.position} tokens; the same command continues it"
              if args.checkpoint and not result.checkpoint_error
              else f"soak: stopped at {result.position} tokens", file=sys.stderr)  # fmt: skip
        return sampler.records
    sampler(result.position, result.perplexity, last=True)  # the tail after the last sample
    if args.plot is not None and sampler.records:
        draw(sampler.records, args.plot)
    summary = summarize(sampler.records, book_lengths(tokenizer)) if sampler.records else None
    if summary is not None:
        common.emit(summary, args.out)
    print(
        f"soak: {result.position} tokens, perplexity {result.perplexity:.3f}, "
        f"{result.tokens_per_second:.0f} tok/s this leg, {result.seconds:.0f} s",
        file=sys.stderr,
    )
    return sampler.records + ([summary] if summary is not None else [])


def resume_lines(parser, checkpoint: Path, out: Path | None) -> tuple[str, list[dict]]:
    """The run a checkpoint belongs to and its lines in ``out`` up to the checkpoint;
    lines past it (a leg killed between a sample and its checkpoint) are dropped from
    ``out``, so the resumed leg writes them again."""
    from mlx_stream.checkpoint import read_metadata
    from mlx_stream.errors import UserError

    try:
        meta = read_metadata(checkpoint)
    except UserError as e:
        parser.error(str(e))
    run, position = meta["identity"].get("run"), meta["state"].get("position", 0)
    if run is None:
        parser.error(f"{checkpoint}: not a soak checkpoint (stream-run's?)")
    if out is None or not out.exists():
        parser.error(f"{checkpoint}: resuming needs the earlier legs' lines (--out)")
    mine = lambda r: r.get("run") == run and not r.get("summary")  # noqa: E731
    lines = [(line, json.loads(line)) for line in out.read_text().splitlines(keepends=True)]
    keep = [(line, r) for line, r in lines if not (mine(r) and r["tokens"] > position)]
    if len(keep) != len(lines):
        out.write_text("".join(line for line, _ in keep))
    earlier = [r for _, r in keep if mine(r)]
    if not earlier:
        parser.error(f"{checkpoint}: {out} holds no line of run {run}")
    return run, earlier


if __name__ == "__main__":
    common.main_guard(main)
