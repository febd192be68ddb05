"""``mlx-stream eval``: what the window forgets, measured against the full cache.

``eval divergence FILE`` feeds a text through the full cache and through every cache
policy asked for, teacher-forced, and continues it greedily from sampled points;
``eval recall`` hides pass keys inside, just outside and far outside the window (and in
a pinned system prompt) and asks for them back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
from typing import Annotated, Any

import typer

from . import options as opt
from .common import (
    cache_spec,
    check_choice,
    check_positive,
    check_text_file,
    fail,
    handle_errors,
    load_model,
    sizes,
    stderr_console,
)
from .groups import Only, grouped

app = typer.Typer(
    name="eval",
    help="Measure what the window forgets: divergence from the full cache, passkey recall.",
    no_args_is_help=True,
)

KV_CHOICES = {"float": (None, None), "8": (8, None), "4": (4, None), "4k8": (4, 8)}

Windows = Annotated[
    str | None,
    typer.Option("--window", help="Windows, comma-separated (e.g. 256,1024). Default: registry."),
]
SinksList = Annotated[
    str | None,
    typer.Option("--sinks", help="Sinks, comma-separated (e.g. 0,4). Default: registry."),
]
PositionsList = Annotated[
    str,
    typer.Option(
        "--positions",
        help="Comma-separated: cache (StreamingLLM), absolute (sinks at absolute positions), "
        "rotating (mlx-lm's RotatingKVCache, float only).",
    ),
]
KvList = Annotated[
    str,
    typer.Option(
        "--kv-bits",
        help="Comma-separated cache precisions: float, 8, 4, 4k8 (4-bit values, 8-bit keys).",
    ),
]
Points = Annotated[int, typer.Option("--points", help="Points to continue greedily from.")]
Generate = Annotated[int, typer.Option("--generate", help="Greedy tokens per point.")]
Trials = Annotated[int, typer.Option("--trials", help="Pass keys per placement and window.")]
Placements = Annotated[
    str,
    typer.Option(
        "--placements", help="Comma-separated: inside, just_outside, far_outside, system."
    ),
]
AnswerTokens = Annotated[int, typer.Option("--answer-tokens", help="Most tokens per answer.")]
Seed = Annotated[int, typer.Option(help="Seed of the random pass keys.")]
Lengths = Annotated[
    str | None,
    typer.Option(
        "--length",
        help="Long-context mode: prompt lengths in tokens, comma-separated (e.g. 4096,16384).",
    ),
]
Depths = Annotated[
    str, typer.Option("--depths", help="Needle depths in the haystack (0-1), comma-separated.")
]
Kinds = Annotated[str, typer.Option("--kinds", help="Needles, comma-separated: passkey, word.")]
Haystack = Annotated[
    str, typer.Option("--haystack", help="filler (repeated sentences) or a UTF-8 text file.")
]
Source = Annotated[
    str, typer.Argument(help="UTF-8 text file to compare the caches on.", show_default=False)
]


def parse_ints(value: str | None, flag: str, minimum: int) -> list[int] | None:
    """``"256,1024"`` -> ``[256, 1024]``; a one-line error for anything else."""
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",")]
    except ValueError:
        fail(f"{flag} must be comma-separated whole numbers (got {value!r})")
    for v in out:
        check_positive(v, flag, minimum)
    return list(dict.fromkeys(out))


def parse_choices(value: str, flag: str, choices: tuple[str, ...]) -> list[str]:
    """A comma-separated list of ``choices``; a one-line error for anything else."""
    out = [v.strip() for v in value.split(",")]
    for v in out:
        check_choice(v, flag, choices)
    return list(dict.fromkeys(out))


def model_context(model: Any) -> int | None:
    """The context the model was trained for (``max_position_embeddings``), if known."""
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    return int(value) if value else None


@contextlib.contextmanager
def progress_bar(label: str):
    """A ``(done, total)`` callback drawing a bar on a terminal's stderr, else nothing."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = stderr_console()
    if not console.is_terminal:
        yield lambda done, total: None
        return
    progress = Progress(
        TextColumn(f"[bold]{label}"), BarColumn(bar_width=20), MofNCompleteColumn(),
        TimeRemainingColumn(), console=console, transient=True,
    )  # fmt: skip
    task = progress.add_task(label, total=None)
    with progress:
        yield lambda done, total: progress.update(task, completed=done, total=total)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


@app.command("divergence")
@handle_errors
@grouped
def divergence(
    path: Source,
    window: Windows = None,
    sinks: SinksList = None,
    positions: PositionsList = "cache",
    kv_bits: KvList = "float",
    *,
    cache: Annotated[opt.CacheOptions, Only("kv_group_size")],
    scoring: opt.ScoringOptions,
    points: Points = 4,
    generate: Generate = 32,
    output: Annotated[opt.OutputOptions, Only("json_out")],
    model: Annotated[opt.ModelOptions, Only("model", "dtype")],
    recall: opt.RecallOptions,
) -> None:
    """Compare cache policies with the full cache on a text, within the model's context.

    Teacher-forced: per-token KL(full || policy), top-1 agreement and both
    perplexities. Then greedy continuations from points in the second half of the
    text: where each policy first leaves the full cache's tokens, and how often they
    differ after. With --recall every cache-positions policy is measured a second
    time with the recall tier (a 'recall' column says which).
    """
    windows = parse_ints(window, "--window", 1)
    sink_list = parse_ints(sinks, "--sinks", 0)
    position_list = parse_choices(positions, "--positions", ("cache", "absolute", "rotating"))
    kv_list = parse_choices(kv_bits, "--kv-bits", tuple(KV_CHOICES))
    cache.check()
    if position_list == ["rotating"] and "float" not in kv_list:
        fail("--positions rotating (mlx-lm's RotatingKVCache) cannot be quantized: add float")
    limit_tokens, chunk, segment = scoring.limit_tokens, scoring.chunk, scoring.segment
    check_positive(limit_tokens, "--limit-tokens", 2)
    check_positive(points, "--points", 0)
    check_positive(generate, "--generate")
    check_positive(chunk, "--chunk")
    check_positive(segment, "--segment")
    recall_policy = recall.spec()
    if recall_policy is not None and "cache" not in position_list:
        fail("--recall needs --positions cache (bounded positions)")
    checked = check_text_file(path)

    target, tokenizer, spec = load_model(model.model, model.dtype)
    from mlx_stream.eval.divergence import Policy, sample_points
    from mlx_stream.eval.divergence import divergence as run_divergence
    from mlx_stream.eval.perplexity import iter_tokens

    default = cache_spec(spec)  # the registry entry's sizes
    context = model_context(target)
    if limit_tokens is not None and context is not None and limit_tokens > context:
        fail(
            f"--limit-tokens {limit_tokens} is past the model's context ({context}): the full "
            "cache is no reference there"
        )
    if context is None and limit_tokens is None:
        fail("the model does not say its context length: pass --limit-tokens")
    limit = limit_tokens or context
    tokens = list(itertools.islice(iter_tokens(checked, tokenizer), limit))
    if len(tokens) < 2:
        fail(f"{path}: too short, no token to score")
    policies = [
        Policy(s, w, p, *KV_CHOICES[kv], cache.kv_group_size)
        for w in windows or [default.window]
        for s in (sink_list if sink_list is not None else [default.sinks])
        for p in position_list
        for kv in kv_list
        if not (p == "rotating" and kv != "float")  # mlx-lm cannot quantize it
    ]
    if recall_policy is not None:  # each cache-positions policy again, with recall
        policies = [
            q for p in policies
            for q in ((p, dataclasses.replace(p, recall=recall_policy))
                      if p.positions == "cache" else (p,))
        ]  # fmt: skip
    at = sample_points(len(tokens), points, generate)
    with progress_bar("eval divergence") as callback:
        results = run_divergence(
            target, tokens, policies, chunk=chunk, points=at, generate=generate, callback=callback
        )
    summaries = [r.summary(segment) for r in results]
    if output.json_out:
        typer.echo(json.dumps({"tokens": len(tokens), "generate": generate, "policies": summaries}))
        return
    _divergence_table(summaries, len(tokens), generate)


def _console():
    """A rich console on stdout; a file or pipe gets whole rows, not 80 columns."""
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160
    return console


def _recall_label(row: dict) -> str:
    """``—`` without recall, else its blocks (and the store's bits)."""
    r = row.get("recall")
    if r is None:
        return "—"
    return f"{r['blocks']} blocks" + (f" {r['bits']}-bit" if r["bits"] else "")


def _divergence_table(rows: list[dict], tokens: int, generate: int) -> None:
    from rich import box
    from rich.table import Table

    from .stream_run import fmt_ppl

    console = _console()
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    columns = ("window", "sinks", "positions", "kv", "recall", "KL", "top-1", "KL evicted",
               "top-1 evicted", "ppl", "full ppl", "first div.", "mismatch after")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        first = r["first_divergence_median"]
        table.add_row(
            str(r["window"]), str(r["sinks"]), r["positions"], r["kv"], _recall_label(r),
            _fmt(r["kl"], ".4f"),
            _fmt(r["top1_agreement"], ".3f"), _fmt(r["kl_evicted"], ".4f"),
            _fmt(r["top1_agreement_evicted"], ".3f"), fmt_ppl(r["perplexity"]),
            fmt_ppl(r["reference_perplexity"]),
            f">={generate}" if first is None else f"{first:g}",
            _fmt(r["mismatch_after_divergence"], ".2f"),
        )  # fmt: skip
    console.print(table)
    console.print(
        f"{tokens - 1} tokens against the full cache · first divergence: median greedy tokens "
        f"equal to the full cache's over {rows[0]['points'] if rows else 0} points "
        f"(of {generate})"
    )


@app.command("recall")
@handle_errors
@grouped
def recall(
    window: Windows = "256,1024",
    *,
    cache: Annotated[opt.CacheOptions, Only("sinks")],
    placements: Placements = "inside,just_outside,far_outside,system",
    trials: Trials = 4,
    answer_tokens: AnswerTokens = 12,
    seed: Seed = 0,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object per window and placement.")
    ] = False,
    length: Lengths = None,
    depths: Depths = "0.1,0.3,0.5,0.7,0.9",
    kinds: Kinds = "passkey,word",
    haystack: Haystack = "filler",
    model: Annotated[opt.ModelOptions, Only("model", "dtype")],
    recall: opt.RecallOptions,
) -> None:
    """Passkey retrieval through the window, beside the full cache's accuracy.

    The key sits inside the window, just outside it, far outside it, or in the system
    prompt pinned as the sinks (what chat's --keep-system does). With --length, long
    contexts instead (past the trained length too): a pass key and a word fact at
    --depths of a haystack, through the window alone, the window with --recall, and
    the full cache where the prompt fits the model's context.
    """
    sinks = cache.sinks
    if length is not None:
        return _needles(
            model.model, window, sinks, trials, answer_tokens, seed, json_out, model.dtype,
            length, depths, kinds, haystack, recall.spec(),
        )  # fmt: skip
    from_recall = ("inside", "just_outside", "far_outside", "system")
    windows = parse_ints(window, "--window", 1)
    placement_list = parse_choices(placements, "--placements", from_recall)
    check_positive(sinks, "--sinks", 0)
    check_positive(trials, "--trials")
    check_positive(answer_tokens, "--answer-tokens")

    target, tokenizer, spec = load_model(model.model, model.dtype)
    from mlx_stream.eval.passkey import check_prompts
    from mlx_stream.eval.passkey import recall as run_recall

    sinks = cache.spec(spec).sinks
    context = model_context(target)
    try:  # every prompt must fit before the first token
        check_prompts(tokenizer, windows, placement_list, sinks, context, answer_tokens)
    except ValueError as exc:
        fail(str(exc))
    with progress_bar("eval recall") as callback:
        rows = run_recall(
            target, tokenizer, windows, placement_list, trials=trials, sinks=sinks,
            answer_tokens=answer_tokens, context=context, seed=seed, callback=callback,
        )  # fmt: skip
    if json_out:  # one object per line: a window and a placement
        for r in rows:
            typer.echo(json.dumps(r))
        return
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("window", "placement", "key distance", "sinks", "accuracy", "full cache"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["window"]), r["placement"], str(r["key_distance"]), str(r["sinks"]),
            f"{r['accuracy']:.2f}", f"{r['reference_accuracy']:.2f}",
        )  # fmt: skip
    _console().print(table)


def _needles(model, window, sinks, trials, answer_tokens, seed, json_out, dtype, length,
             depths, kinds, haystack, recall) -> None:  # fmt: skip
    """``eval recall --length``: needles at depths of long prompts, per cache."""
    from mlx_stream.eval.needle import CACHES, KINDS

    lengths = parse_ints(length, "--length", 64)
    windows = parse_ints(window, "--window", 1) if window != "256,1024" else None
    if windows is not None and len(windows) > 1:
        fail("--length takes one --window")
    try:
        depth_list = [float(d) for d in depths.split(",")]
    except ValueError:
        fail(f"--depths must be comma-separated numbers (got {depths!r})")
    if any(not 0 <= d <= 1 for d in depth_list):
        fail("--depths must lie between 0 and 1")
    kind_list = parse_choices(kinds, "--kinds", KINDS)
    check_positive(sinks, "--sinks", 0)
    check_positive(trials, "--trials")
    check_positive(answer_tokens, "--answer-tokens")
    text = None if haystack == "filler" else check_text_file(haystack)

    target, tokenizer, spec = load_model(model, dtype)
    from mlx_stream.eval.needle import filler_tokens, filler_unit, needle_eval

    sinks, default_window = sizes(spec, sinks, None)
    window_size = windows[0] if windows else default_window
    need = max(lengths) + 256
    align = 1
    if text is None:
        hay, align = filler_tokens(tokenizer, need), filler_unit(tokenizer)
    else:
        hay = list(tokenizer.encode(text.read_text(encoding="utf-8"), add_special_tokens=False))
        if len(hay) < need:
            fail(f"{haystack}: {len(hay)} tokens, --length {max(lengths)} needs {need}")
    caches = [c for c in CACHES if c != "recall" or recall is not None]
    rows = []
    with progress_bar("eval recall") as callback:
        total = len(lengths) * len(kind_list) * len(depth_list) * trials * len(caches)

        def done(row):
            rows.append(row)
            callback(len(rows), total)
            if json_out:
                typer.echo(json.dumps(row))

        try:
            for t in range(trials):
                needle_eval(
                    target, tokenizer, hay, lengths, depth_list, kind_list, caches, sinks,
                    window_size, recall, model_context(target), answer_tokens, seed + t, done,
                    align=align,
                )  # fmt: skip
        except ValueError as exc:
            fail(str(exc))
    if json_out:
        return
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("length", "needle", "window", "window + recall", "full cache"):
        table.add_column(col, justify="right")
    for n in lengths:
        for kind in kind_list:
            mine = [r for r in rows if r["kind"] == kind and r["length_asked"] == n]
            cells = []
            for cache in CACHES:
                got = [r["found"] for r in mine if r["cache"] == cache]
                cells.append(f"{sum(got)}/{len(got)}" if got else "—")
            table.add_row(str(n), kind, *cells)
    _console().print(table)
    _console().print(
        f"window {window_size} + {sinks} sinks; needles found / trials over depths "
        f"{', '.join(f'{d:g}' for d in depth_list)}; full cache only within the model's context"
    )
