"""``mlx-stream profile``: memory and latency of every decode step.

Generates ``--tokens`` tokens greedily (end-of-sequence is ignored, so every setting
decodes the same number of tokens) and samples MLX's active memory, its pool of freed
buffers (``cache``) and the peak after each step. ``--compare`` runs several settings
in one process: the three KV caches, or with a draft model the three reclaim schedules
(the speculative case where ``n % every == 0`` misses its multiples).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from mlx_stream.defaults import RECLAIM_MODES

from . import options as opt
from .common import (
    EXIT_RUNTIME,
    atomic_path,
    atomic_write_csv,
    check_choice,
    check_distinct,
    check_output_path,
    check_positive,
    check_text_file,
    error_line,
    fail,
    handle_errors,
    json_line,
)
from .groups import Only, grouped

CACHES = ("sink", "full", "rotating")
DEFAULT_PROMPT = "Once upon a time, in a small town by the sea, there lived"
PLOT_INSTALL = 'pip install -e ".[plot]"'  # as docs/cli.md says
SPARKS = "▁▂▃▄▅▆▇█"
CHART_WIDTH = 60
MB = 1e6


@dataclass(frozen=True)
class Setting:
    """One profiled configuration."""

    cache: str
    schedule: str
    draft: bool

    @property
    def name(self) -> str:
        return f"{self.cache}/{self.schedule}" + ("+draft" if self.draft else "")


def settings_for(cache: str, schedule: str, draft: bool, compare: bool) -> list[Setting]:
    """The settings to run: one, or with ``--compare`` the caches (schedules with a draft)."""
    if not compare:
        return [Setting(cache, schedule, draft)]
    if draft:
        return [Setting(cache, s, True) for s in RECLAIM_MODES]
    return [Setting(c, schedule, False) for c in CACHES]


def make_caches(model: Any, kind: str, cache: Any) -> list:
    """A prompt cache of ``kind``: our SinkCache of the policy ``cache`` (a
    ``CacheSpec``), mlx-lm's growing KVCache, or mlx-lm's
    ``RotatingKVCache(max_size=sinks + window, keep=sinks)`` built per layer (mlx-lm's
    ``max_kv_size`` is ignored by models that define ``make_cache``)."""
    from mlx_lm.models import cache as mlx_cache

    sinks, window = cache.sinks, cache.window
    if kind == "sink":
        return cache.build(model)  # refused with the bytes when it cannot fit
    if kind == "full":
        return mlx_cache.make_prompt_cache(model)
    return [
        mlx_cache.RotatingKVCache(max_size=sinks + window, keep=sinks)
        for _ in range(len(model.layers))
    ]


@contextlib.contextmanager
def ignoring_eos(tokenizer: Any) -> Iterator[None]:
    """Decode through end-of-sequence tokens (a profile wants exactly N steps)."""
    saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = set()
    try:
        yield
    finally:
        tokenizer.eos_token_ids = saved


# Reserved (allocated) MB: the region on the device, the store's RAM + disk (and each);
# then the MB the stored blocks use of them, and the blocks (mlx_stream.cache.estimate's
# vocabulary: reserved vs used, device vs RAM vs disk).
RECALL_KEYS = ("recall_device_mb", "recall_store_mb", "recall_store_ram_mb",
               "recall_store_disk_mb", "recall_store_used_mb", "recall_store_ram_used_mb",
               "recall_store_disk_used_mb", "recall_stored_blocks",
               "recall_recalled_blocks", "recall_stored_tokens")  # fmt: skip
BYTES_KEYS = ("kv_cache_mb", "kv_cache_used_mb", *RECALL_KEYS)


def recall_bytes(tier: Any) -> dict:
    """The recall tier's device region (reserved once, fixed), its store's room
    reserved (all of it, RAM and disk) and the part its blocks use, in MB; the blocks
    stored and recalled (``Recall.usage``)."""
    if tier is None:
        return {}
    u = tier.usage()
    sizes = (u["region_bytes"], u["reserved_bytes"], u["ram_reserved_bytes"],
             u["disk_reserved_bytes"], u["ram_bytes"] + u["disk_bytes"], u["ram_bytes"],
             u["disk_bytes"])  # fmt: skip
    return {**dict(zip(RECALL_KEYS, (round(b / MB, 3) for b in sizes))),
            "recall_stored_blocks": u["stored_blocks"],
            "recall_recalled_blocks": u["recalled_blocks"],
            "recall_stored_tokens": u["stored_blocks"] * tier.block}  # fmt: skip


def kv_bytes(caches: list) -> dict:
    """The KV cache's device MB: reserved (``kv_cache_mb``, its buffers as allocated)
    and used (``kv_cache_used_mb``, the slots holding tokens)."""
    from mlx_stream.cache.estimate import cache_usage

    used, reserved = cache_usage(caches)
    return {"kv_cache_mb": round(reserved / MB, 3), "kv_cache_used_mb": round(used / MB, 3)}


def run_setting(
    setting: Setting,
    model: Any,
    tokenizer: Any,
    draft_model: Any,
    prompt: list[int],
    tokens: int,
    cache: Any,
    every: int,
    num_draft_tokens: int,
) -> list[dict[str, Any]]:
    """Decode ``tokens`` tokens under ``setting``; one row per yielded token."""
    import mlx.core as mx

    from mlx_stream.cache.reclaim import ReclaimSchedule, memory_snapshot
    from mlx_stream.generate.decode import stream_generate
    from mlx_stream.recall import tier_of

    caches = make_caches(model, setting.cache, cache)
    if setting.draft:
        caches += make_caches(draft_model, setting.cache, cache.replace(recall=None))
    tier = tier_of(caches)
    schedule = ReclaimSchedule(every, setting.schedule)
    mx.clear_cache()
    mx.reset_peak_memory()
    rows: list[dict[str, Any]] = []
    with ignoring_eos(tokenizer):
        tic = time.perf_counter()
        for step, r in enumerate(
            stream_generate(
                model,
                tokenizer,
                prompt,
                max_tokens=tokens,
                draft_model=draft_model if setting.draft else None,
                prompt_cache=caches,
                num_draft_tokens=num_draft_tokens,
                reclaim=schedule,
            ),
            start=1,
        ):
            now = time.perf_counter()
            mem = memory_snapshot()
            rows.append(
                {
                    "setting": setting.name,
                    "step": step,
                    "tokens": int(getattr(r, "generation_tokens", step)),
                    "latency_ms": round((now - tic) * 1000, 3),
                    "active_memory_mb": round(mem.active / MB, 3),
                    "cache_memory_mb": round(mem.cache / MB, 3),
                    "peak_memory_mb": round(mem.peak / MB, 3),
                    **kv_bytes(caches),
                    **recall_bytes(tier),
                    "reclaims": schedule.reclaims,
                    "from_draft": bool(getattr(r, "from_draft", False)),
                    "generation_tps": round(float(getattr(r, "generation_tps", 0.0)), 3),
                }
            )
            tic = now
    return rows


def summarize(setting: Setting, rows: list[dict[str, Any]], cache: Any) -> dict:
    """The ``--json`` object of one setting."""
    if not rows:
        fail("the model produced no tokens")
    active = [r["active_memory_mb"] for r in rows]
    pool = [r["cache_memory_mb"] for r in rows]
    latency = sorted(r["latency_ms"] for r in rows[1:]) or [rows[0]["latency_ms"]]
    decode_s = sum(latency) / 1000
    return {
        "setting": setting.name,
        "cache": setting.cache,
        "schedule": setting.schedule,
        "draft": setting.draft,
        "sinks": cache.sinks,
        "window": cache.window,
        "tokens": rows[-1]["tokens"],
        "reclaims": rows[-1]["reclaims"],
        "active_memory_mb": {"start": active[0], "end": active[-1], "max": max(active)},
        "cache_memory_mb": {"max": max(pool), "end": pool[-1]},
        **{k: {"start": rows[0][k], "end": rows[-1][k]} for k in BYTES_KEYS if k in rows[0]},
        "peak_memory_mb": max(r["peak_memory_mb"] for r in rows),
        "tokens_per_second": round(len(latency) / decode_s, 3) if decode_s > 0 else None,
        "latency_ms": {
            "first": rows[0]["latency_ms"],
            "p50": round(statistics.median(latency), 3),
            "p99": latency[min(len(latency) - 1, math.ceil(0.99 * len(latency)) - 1)],
            "max": latency[-1],
        },
    }


def sparkline(values: list[float], lo: float, hi: float, width: int = CHART_WIDTH) -> str:
    """``values`` resampled to ``width`` columns of block characters on a ``lo..hi`` scale."""
    if not values:
        return ""
    n = min(width, len(values))
    cols = [values[min(len(values) - 1, (i * len(values)) // n)] for i in range(n)]
    span = hi - lo
    if span <= 0:
        return SPARKS[0] * n
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / span * len(SPARKS)))] for v in cols)


def print_report(summaries: list[dict], runs: dict[str, list[dict]]) -> None:
    """A rich summary table and a small terminal chart of active memory on stdout."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(
        title="mlx-stream profile",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )
    table.add_column("setting", no_wrap=True)
    for col in ("tokens", "tok/s", "active MB\nstart→end", "active\nmax MB", "pool\nmax MB",
                "reclaims", "p50\nms"):  # fmt: skip
        table.add_column(col, justify="right", no_wrap=True)
    for s in summaries:
        a, p, lat = s["active_memory_mb"], s["cache_memory_mb"], s["latency_ms"]
        table.add_row(
            s["setting"],
            str(s["tokens"]),
            f"{s['tokens_per_second'] or 0:.1f}",
            f"{a['start']:.1f}→{a['end']:.1f}",
            f"{a['max']:.1f}",
            f"{p['max']:.1f}",
            str(s["reclaims"]),
            f"{lat['p50']:.1f}",
        )
    console.print(table)
    for s in summaries:
        console.print(f"{s['setting']}: " + "; ".join(bytes_lines(s)), soft_wrap=True)
        if "distributed" in s:
            d = s["distributed"]
            share = f"{d['collective_share']:.0%}" if d["collective_share"] is not None else "-"
            console.print(f"{s['setting']}: {d['strategy']} parallel, collectives {d['collective_ms']:.1f} ms of a step ({share})")  # fmt: skip
            for r in d["ranks"]:
                console.print(f"  rank {r['rank']}: weights {r['weights_mb']:.1f} MB, KV cache {r['kv_cache_mb']:.1f} MB, peak {r['peak_memory_mb']:.1f} MB")  # fmt: skip
    everything = [r["active_memory_mb"] for rows in runs.values() for r in rows]
    lo, hi = min(everything), max(everything)
    console.print(f"active memory against tokens ({lo:.1f}..{hi:.1f} MB)", style="dim")
    width = max(len(name) for name in runs)
    columns = max(10, min(CHART_WIDTH, console.width - width - 12))
    for name, rows in runs.items():
        line = sparkline([r["active_memory_mb"] for r in rows], lo, hi, columns)
        console.print(f"{name:<{width}} {line} {rows[-1]['active_memory_mb']:.1f} MB")


def bytes_lines(s: dict) -> list[str]:
    """A summary's bytes at the end of the run, each used of reserved and where."""
    from mlx_stream.cache.estimate import human, used_of

    def end(key: str) -> int:
        return int(s[key]["end"] * MB)

    out = [f"KV cache {used_of(end('kv_cache_used_mb'), end('kv_cache_mb'), 'device')}"]
    if "recall_store_mb" in s:
        ram, disk = "recall_store_ram", "recall_store_disk"
        out += [
            f"recall region {used_of(None, end('recall_device_mb'), 'device')}",
            f"recall store {s['recall_stored_blocks']['end']} blocks "
            f"({s['recall_recalled_blocks']['end']} recalled): "
            f"{used_of(end(ram + '_used_mb'), end(ram + '_mb'), 'RAM')}"
            + (f" + {used_of(end(disk + '_used_mb'), end(disk + '_mb'), 'disk')}"
               if s[disk + "_mb"]["end"] else ""),
        ]  # fmt: skip
        tokens = s["recall_stored_tokens"]["end"]
        if tokens:  # what a long stream costs: host bytes per 1k evicted tokens
            per = {where: end(f"{key}_used_mb") * 1000 / tokens
                   for where, key in (("RAM", ram), ("disk", disk))}  # fmt: skip
            out.append(f"recall store per 1k stored tokens: {human(int(per['RAM']))} RAM"
                       f" + {human(int(per['disk']))} disk")  # fmt: skip
    return out


def check_matplotlib() -> None:
    """One-line error when ``--plot`` cannot work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail(f"--plot needs matplotlib: {PLOT_INSTALL} (in the mlx-stream folder)")


def write_plot(path: Path, runs: dict[str, list[dict]]) -> None:
    """A PNG of active memory (solid) and active + pool (dashed) against tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, rows in runs.items():
        x = [r["tokens"] for r in rows]
        (line,) = ax.plot(x, [r["active_memory_mb"] for r in rows], label=f"{name} active")
        ax.plot(
            x,
            [r["active_memory_mb"] + r["cache_memory_mb"] for r in rows],
            linestyle="--",
            color=line.get_color(),
            label=f"{name} active + pool",
        )
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("MLX memory (MB)")
    ax.set_title("mlx-stream profile")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def read_prompt(prompt: str | None, file: Path | None) -> str:
    """The prompt text from ``--prompt`` or ``--file`` (default: a story opening)."""
    if prompt is not None and file is not None:
        fail("give --prompt or --file, not both")
    if file is not None:
        return check_text_file(file).read_text(encoding="utf-8", errors="replace")
    if prompt is not None and not prompt.strip():
        fail("--prompt is empty")
    return prompt or DEFAULT_PROMPT


@handle_errors
@grouped
def profile(
    *,
    reply: Annotated[opt.ReplyOptions, Only("prompt")],
    file: opt.PromptFile = None,
    tokens: opt.Tokens = opt.DEFAULT_PROFILE_TOKENS,
    cache: opt.CacheKind = "sink",
    schedule: opt.Schedule = "crossing",
    every: opt.Every = opt.DEFAULT_RECLAIM_EVERY,
    compare: opt.Compare = False,
    output: opt.OutputOptions,
    plot: opt.Plot = None,
    model: opt.ModelOptions,
    sizes: opt.CacheOptions,
    draft: opt.DraftOptions,
    recall: opt.RecallOptions,
) -> None:
    """Profile memory and latency per decoded token.

    Generates --tokens tokens greedily and samples active memory, MLX's buffer pool
    and peak memory plus the latency of every step. Prints a table and a terminal
    chart; --json prints a summary (a list with --compare).
    """
    check_positive(tokens, "--tokens")
    check_positive(every, "--every")
    draft.check()
    check_choice(cache, "--cache", CACHES)
    check_choice(schedule, "--schedule", RECLAIM_MODES)
    sizes.check()
    if sizes.kv_bits is not None and (cache != "sink" or (compare and not draft.draft_model)):
        fail("--kv-bits quantizes the sink cache: use it with --cache sink, without --compare")
    recall_policy = recall.spec()
    if recall_policy is not None and (cache != "sink" or compare):
        fail("--recall extends the sink cache: use it with --cache sink, without --compare")
    text = read_prompt(reply.prompt, file)
    csv, json_out = output.csv, output.json_out
    for path in (csv, plot):
        if path is not None:
            check_output_path(path)
    check_distinct({"--csv": csv, "--plot": plot}, {"--file": file})
    if plot is not None:
        check_matplotlib()
    from mlx_stream import distributed as dist

    cluster = model.join()
    if cluster is not None and not cluster.is_root:
        csv = plot = None
    drafted = draft.num_draft_tokens if draft.draft_model else None  # a verify block in the slack
    target, tokenizer, _, policy, _ = model.load(sizes, cluster, num_draft_tokens=drafted)
    drafter = draft.load(model.dtype)
    policy = policy.replace(recall=recall_policy)
    estimate = memory_estimate(target, drafter, policy)
    prompt_tokens = list(tokenizer.encode(text))
    runs: dict[str, list[dict]] = {}
    summaries = []
    for setting in settings_for(cache, schedule, drafter is not None, compare):
        rows = run_setting(
            setting, target, tokenizer, drafter, prompt_tokens, tokens, policy, every,
            draft.num_draft_tokens,
        )  # fmt: skip
        runs[setting.name] = rows
        summaries.append(dict(summarize(setting, rows, policy), estimate=estimate))
        if cluster is not None:  # per-rank memory and the collectives' share of a step
            s = summaries[-1]
            s["distributed"] = dist.rank_report(
                cluster, target, s["kv_cache_mb"]["end"], s["latency_ms"]["p50"]
            )

    # The main result goes out first: a side output that fails cannot take it along.
    if json_out:
        typer.echo(json_line(summaries if compare else summaries[0]))
    else:
        print_report(summaries, runs)
        from mlx_stream.cache.estimate import describe

        typer.echo(f"estimate (sink cache): {describe(estimate)}")
    failures = []
    for flag, path, write in (("--csv", csv, lambda p: atomic_write_csv(p, [r for rows in runs.values() for r in rows])),
                              ("--plot", plot, lambda p: write_plot(p, runs))):  # fmt: skip
        if path is not None:
            try:
                write(path)
            except OSError as e:
                failures.append(f"cannot write {flag} {path}: {e.strerror or e}")
    if failures:
        error_line("; ".join(failures))
        raise typer.Exit(EXIT_RUNTIME)


def memory_estimate(target: Any, draft: Any, cache: Any) -> dict:
    """Weights (as loaded) and the full sink cache of the policy ``cache``, for the report."""
    from mlx.utils import tree_flatten

    from mlx_stream.cache.estimate import summary

    weights = kv = 0
    for m in (target, draft):
        if m is None:
            continue
        weights += sum(v.nbytes for _, v in tree_flatten(m.parameters()))
        kv += cache.bytes(m)
    return summary(weights, kv)
