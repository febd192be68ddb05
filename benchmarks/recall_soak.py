"""Recall soak: a long stream through a recall cache whose store spills to disk.

The books in ``benchmarks/data``, repeated end to end (``soak.book_stream``), are fed
through ``stream-run``'s engine (``mlx_stream.eval.perplexity.stream_perplexity``) with
a sink + window cache and the recall tier, its store (blocks and their summaries)
allowed ``--ram-mb`` of host memory before it spills to files in ``--folder``. Every
``--sample`` tokens one JSON line (``recall-soak``) records MLX's active memory, its
buffer pool and peak, the sink caches' device bytes, the retrieval regions' device
bytes, the store's host and disk bytes (and its block summaries', which share its RAM
budget), the process's resident memory, the seconds per 1k tokens of that segment and
how much of it went to selection refreshes (every refresh scores all stored blocks),
and the segment's perplexity. Lines are appended to ``--out`` as they come (a run cut
short keeps them); a summary line closes the run, with the growth of resident memory
over the run's last three quarters.

    nice python benchmarks/recall_soak.py --model TINY --tokens 1000000 --sample 32768 \\
        --ram-mb 16 --folder /tmp/recall-store --out benchmarks/results/recall_soak/recall_soak_tiny.jsonl
    nice python benchmarks/recall_soak.py --tokens 32768 --sample 2048 --ram-mb 16 \\
        --folder /tmp/recall-store --out benchmarks/results/recall_soak/recall_soak.jsonl
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import common
from soak import book_stream, rss_mb


def rss_parts_mb() -> dict:
    """Resident memory split as Linux reports it: anonymous (the heap: numpy arrays,
    MLX buffers) and file-backed (pages of mapped files, the spilled store among
    them, which the kernel may drop under pressure); empty elsewhere."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    key = "rss_anon_mb" if line.startswith("RssAnon") else "rss_file_mb"
                    out[key] = int(line.split()[1]) / 1e3
    except OSError:
        pass
    return out


def open_files() -> int | None:
    """File descriptors this process holds (Linux ``/proc``; ``None`` elsewhere): each
    spilled segment is a memory map, and each map keeps one open."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def disk_bytes(folder: Path) -> int:
    """Bytes the files in ``folder`` occupy on disk (allocated blocks, not sizes)."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


class Sampler:
    """The stream_perplexity callback: one JSON line every ``every`` tokens."""

    def __init__(self, every: int, out: Path | None, base: dict, folder: Path):
        self.every, self.out, self.base, self.folder = every, out, base, folder
        self.caches: list = []
        self.tier = None
        self.records: list[dict] = []
        self.last_position, self.last_nll_sum = 1, 0.0
        self.tic = self.last_time = time.perf_counter()
        self.refresh_s = self.last_refresh_s = 0.0
        self.pool_max = 0
        self.compare = False  # --compare: each reuse refresh against the flat scan
        self.shortlist = None  # (size, rescan) the tier's shortlist is made with; 0 0: flat
        self.compared = self.agreed = self.compared_last = self.agreed_last = 0
        self.within = self.within_last = 0  # refreshes that scored the flat scan's k
        self.common = self.common_last = 0  # blocks chosen by both, over the refreshes

    def agreement(self, point: int, scored) -> None:
        """Score every block as the flat scan does and count whether the ``k`` it
        chooses are the shortlist's, and whether they were among
        the blocks the refresh scored (``scored``: the reuse index's candidates,
        ``None``: every block), outside the refresh's timing; ``scores`` alone never
        reads the reuse index's shortlist."""
        from mlx_stream.recall import select

        tier = self.tier
        flat = tier.scores(point)
        if flat is not None:
            want = select.top_k(flat, tier.spec.blocks)
            self.compared += 1
            self.agreed += want == tier.selection
            self.common += len(set(want) & set(tier.selection))
            self.within += scored is None or set(want) <= {int(j) for j in scored}

    def use(self, caches: list) -> None:
        from mlx_stream.recall import tier_of

        self.caches = caches
        self.tier = tier_of(caches)
        if self.shortlist is not None:  # --index flat, --shortlist, --rescan: not the tier's own
            from mlx_stream.recall import reuse

            size, rescan = self.shortlist
            self.tier.shortlist = reuse.Shortlist(size, rescan) if rescan else None
        refresh = self.tier.refresh

        def timed(point):  # wrapped on the instance: the tier's code is unchanged
            tier = self.tier
            short = tier.shortlist if self.compare else None  # what it will score
            scored = short.candidates(tier.candidates(point)) if short else None
            tic = time.perf_counter()
            refresh(point)
            self.refresh_s += time.perf_counter() - tic
            if self.compare and tier.refreshed_at == point:
                self.agreement(point, scored)

        self.tier.refresh = timed

    def __call__(self, position: int, perplexity: float, last: bool = False) -> None:
        import math

        import mlx.core as mx

        self.pool_max = max(self.pool_max, mx.get_cache_memory())
        crossed = position // self.every != self.last_position // self.every
        if position <= self.last_position or not (crossed or last):
            return
        now = time.perf_counter()
        nll_sum = math.log(perplexity) * (position - 1)
        scored = position - self.last_position
        tier, store = self.tier, self.tier.store
        per_1k = 1000 / scored
        record = dict(
            self.base,
            tokens=position,
            seconds=round(now - self.tic, 1),
            active_mb=round(mx.get_active_memory() / 1e6, 3),
            pool_max_mb=round(self.pool_max / 1e6, 2),
            peak_mb=round(mx.get_peak_memory() / 1e6, 2),
            cache_mb=round(sum(c.nbytes for c in self.caches) / 1e6, 3),
            region_mb=round(tier.device_nbytes / 1e6, 3),
            store_ram_mb=round(store.host_bytes / 1e6, 2),
            store_disk_mb=round(store.disk_bytes / 1e6, 2),
            folder_disk_mb=round(disk_bytes(self.folder) / 1e6, 2),
            summaries_mb=round(tier.summaries.nbytes / 1e6, 2),
            index_ram_mb=round(tier.summaries.host_bytes / 1e6, 2),
            index_disk_mb=round(tier.summaries.disk_bytes / 1e6, 2),
            stored_blocks=tier.stored,
            rss_mb=rss_mb(),
            **rss_parts_mb(),
            open_files=open_files(),
            s_per_1k=round((now - self.last_time) * per_1k, 3),
            refresh_s_per_1k=round((self.refresh_s - self.last_refresh_s) * per_1k, 3),
            refreshes=tier.refreshes,
            scored_blocks=tier.scored_blocks,
            **self.index_record(),
            segment_tokens=scored,
            segment_ppl=round(math.exp((nll_sum - self.last_nll_sum) / scored), 4),
            running_ppl=round(perplexity, 4),
        )
        common.emit(record, self.out)
        self.records.append(record)
        self.last_position, self.last_nll_sum, self.pool_max = position, nll_sum, 0
        self.last_time, self.last_refresh_s = now, self.refresh_s
        self.compared_last, self.agreed_last = self.compared, self.agreed
        self.within_last, self.common_last = self.within, self.common

    def index_record(self) -> dict:
        """The shortlist's counters (``--index reuse``: refreshes that scanned every
        block, those that read the shortlist), and with ``--compare`` the segment's
        refreshes compared, those that chose the flat scan's blocks (``agreed``), those
        that scored all of them (``within``) and the blocks both chose (``common``)."""
        short = self.tier.shortlist
        if short is None:
            return {}
        out = {"scans": short.scans, "reuses": short.reuses}
        if self.compare:
            n = self.compared - self.compared_last
            out.update(
                compared=n,
                agreed=self.agreed - self.agreed_last,
                within=self.within - self.within_last,
                common=self.common - self.common_last,
            )
        return out


def summarize(records: list[dict], ram_mb: float) -> dict:
    """The run in one line: device memory and RSS at the first and last sample (the
    first taken once the window is full) and their extremes, the store's growth, the
    time per 1k tokens early and late."""
    steady = records[1:] or records
    quarter = max(1, len(records) // 4)
    # the last three quarters of the run: from the first sample at a quarter of its tokens
    from_quarter = next(r for r in records if r["tokens"] >= records[-1]["tokens"] / 4)

    def median(key, rows):
        import statistics

        return round(statistics.median(r[key] for r in rows), 3)

    return {
        "bench": "recall-soak", "summary": True, "tokens": records[-1]["tokens"],
        "samples": len(records), "seconds": records[-1]["seconds"], "ram_budget_mb": ram_mb,
        "active_mb_first": steady[0]["active_mb"], "active_mb_last": steady[-1]["active_mb"],
        "active_mb_min": min(r["active_mb"] for r in steady),
        "active_mb_max": max(r["active_mb"] for r in steady),
        "cache_mb": sorted({r["cache_mb"] for r in steady}),
        "region_mb": sorted({r["region_mb"] for r in steady}),
        "rss_mb_first": steady[0]["rss_mb"], "rss_mb_last": steady[-1]["rss_mb"],
        "rss_mb_max": max(r["rss_mb"] or 0 for r in steady),
        "rss_growth_mb_last_3q": _growth(from_quarter, records[-1], "rss_mb"),
        "rss_anon_growth_mb_last_3q": _growth(from_quarter, records[-1], "rss_anon_mb"),
        "from_quarter_tokens": from_quarter["tokens"],
        "rss_anon_mb_first": steady[0].get("rss_anon_mb"),
        "rss_anon_mb_last": steady[-1].get("rss_anon_mb"),
        "rss_file_mb_last": steady[-1].get("rss_file_mb"),
        "store_ram_mb_last": records[-1]["store_ram_mb"],
        "store_disk_mb_last": records[-1]["store_disk_mb"],
        "summaries_mb_last": records[-1]["summaries_mb"],
        "index_ram_mb_last": records[-1].get("index_ram_mb"),
        "open_files_first": steady[0].get("open_files"),
        "open_files_last": records[-1].get("open_files"),
        "stored_blocks_last": records[-1]["stored_blocks"],
        "s_per_1k_early": median("s_per_1k", steady[:quarter]),
        "s_per_1k_late": median("s_per_1k", steady[-quarter:]),
        "refresh_s_per_1k_early": median("refresh_s_per_1k", steady[:quarter]),
        "refresh_s_per_1k_late": median("refresh_s_per_1k", steady[-quarter:]),
        "segment_ppl_early": median("segment_ppl", steady[:quarter]),
        "segment_ppl_late": median("segment_ppl", steady[-quarter:]),
    }  # fmt: skip


def _growth(first: dict, last: dict, key: str) -> float | None:
    """``last[key] - first[key]`` (MB), ``None`` where a sample lacks it."""
    if first.get(key) is None or last.get(key) is None:
        return None
    return round(last[key] - first[key], 1)


def render(records: list[dict], every: int = 1) -> str:
    """Markdown: every ``every``-th sample of each run (and its last) as a row."""
    head = (
        "| tokens | MLX active MB | sink caches MB | regions MB | store RAM MB | store disk "
        "MB | summaries MB | RSS MB (anon + file) | s per 1k tokens | of which refresh |"
    )
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    samples = [r for r in records if r.get("bench") == "recall-soak" and not r.get("summary")]
    for k, r in enumerate(samples):
        last = k == len(samples) - 1 or samples[k + 1]["tokens"] < r["tokens"]
        if k % every and not last:
            continue
        rss = f"{r['rss_mb']:.0f}"
        if r.get("rss_anon_mb") is not None:
            rss += f" ({r['rss_anon_mb']:.0f} + {r['rss_file_mb']:.0f})"
        out.append(f"| {r['tokens']:,} | {r['active_mb']:.2f} | {r['cache_mb']:.3f} | "
                   f"{r['region_mb']:.3f} | {r['store_ram_mb']:.1f} | {r['store_disk_mb']:.1f} "
                   f"| {r['summaries_mb']:.1f} | {rss} | {r['s_per_1k']:.2f} | "
                   f"{r['refresh_s_per_1k']:.2f} |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="stream length")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8, help="recall blocks (k)")
    parser.add_argument("--block", type=int, default=64, help="tokens per block (= stride)")
    parser.add_argument(
        "--index",
        choices=("reuse", "flat"),
        default="reuse",
        help="reuse (the tier's) or flat (every block scored at every refresh)",
    )
    parser.add_argument(
        "--shortlist", type=int, default=0, help="reuse: blocks a scan keeps (0: the tier's)"
    )
    parser.add_argument(
        "--rescan",
        type=int,
        default=16,
        help="reuse: every block scanned once per this many refreshes",
    )
    parser.add_argument("--compare", action="store_true",
                        help="reuse: check every refresh against the flat scan")  # fmt: skip
    parser.add_argument("--bits", type=int, default=None, help="store bits (4, 8)")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--sample", type=int, default=4096, help="tokens per JSON line")
    parser.add_argument("--ram-mb", type=float, default=16, help="store RAM before disk")
    parser.add_argument("--folder", type=Path, help="store folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the store's files")
    parser.add_argument("--table", type=Path, help="render saved JSON lines and exit")
    parser.add_argument("--every", type=int, default=1, help="--table: every Nth sample")
    args = parser.parse_args(argv)
    if args.table is not None:
        import json

        lines = args.table.read_text().splitlines()
        print(render([json.loads(x) for x in lines if x.strip()], args.every))
        return []
    if args.quick:
        args.tokens, args.window, args.sample, args.blocks = 2048, 64, 256, 2
        args.ram_mb = min(args.ram_mb, 0.05)
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.eval.perplexity import stream_perplexity
    from mlx_stream.generate.decode import StopOnInterrupt
    from mlx_stream.recall import RecallSpec, reuse

    tmp = None
    if args.folder is None:
        tmp = tempfile.TemporaryDirectory(prefix="recall-soak-")
        folder = Path(tmp.name) / "store"
    else:
        folder = args.folder
        if folder.exists() and any(folder.iterdir()):
            parser.error(f"{folder}: not empty (the soak measures the files it writes)")
    model, tokenizer, weights = common.load_model(args.model, args.dtype)
    recall = RecallSpec(blocks=args.blocks, block=args.block, bits=args.bits,
                        ram_bytes=int(args.ram_mb * 1e6), folder=str(folder))  # fmt: skip
    spec = CacheSpec(args.sinks, args.window, stride=args.block, recall=recall)
    layers = getattr(getattr(model, "args", None), "num_hidden_layers", None)
    settings = dict(sinks=args.sinks, window=args.window, blocks=args.blocks, block=args.block,
                    selector="quest", store_bits=args.bits, chunk=args.chunk,
                    sample=args.sample, ram_mb=args.ram_mb, layers=layers,
                    target_tokens=args.tokens, index=args.index, shortlist=args.shortlist,
                    expand=0, rescan=args.rescan)  # fmt: skip
    base = common.base_record("recall-soak", args.model, weights, **settings)
    sampler = Sampler(args.sample, args.out, base, folder)
    sampler.compare = args.compare and args.index == "reuse"
    size = args.shortlist or reuse.shortlist_size(args.blocks)
    sampler.shortlist = (size, args.rescan if args.index == "reuse" else 0)
    try:
        with StopOnInterrupt((signal.SIGINT, signal.SIGTERM)) as stop:
            result = stream_perplexity(
                model, book_stream(tokenizer), chunk=args.chunk, callback=sampler,
                on_cache=sampler.use, segment=args.sample, limit_tokens=args.tokens,
                should_stop=lambda: stop.interrupted, cache_spec=spec,
            )  # fmt: skip
        if not result.interrupted:
            sampler(result.position, result.perplexity, last=True)
        summary = summarize(sampler.records, args.ram_mb) if sampler.records else None
        if summary is not None:
            common.emit(summary, args.out)
        print(f"recall soak: {result.position} tokens, {result.seconds:.0f} s, perplexity "
              f"{result.perplexity:.3f}", file=sys.stderr)  # fmt: skip
    finally:
        if sampler.tier is not None:
            sampler.tier.close()
        if tmp is not None:
            tmp.cleanup()
        elif not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return sampler.records + ([summary] if summary is not None else [])


if __name__ == "__main__":
    common.main_guard(main)
