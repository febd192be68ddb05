"""``mlx-stream stream-run``: a long document through the model in fixed memory.

The text is read and tokenized block by block (``evaluate.iter_tokens``) and fed as one
stream through the sink + window cache; every token's negative log-likelihood is
scored and reported as perplexity overall and per segment. ``--prompt`` then asks a
question of whatever the window still holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from . import options as opt
from .common import (
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    atomic_write_csv,
    check_distinct,
    check_output_path,
    check_positive,
    check_text_file,
    error_line,
    fail,
    handle_errors,
    json_line,
    lenient_stdin,
    stderr_console,
)
from .groups import grouped

CHECKPOINT_SUFFIX = ".safetensors"
Source = Annotated[
    str,
    typer.Argument(help="UTF-8 text file to stream, or - for standard input.", show_default=False),
]


class CountingReader:
    """A text file wrapper that counts the bytes handed out (for progress and ETA)."""

    def __init__(self, f: Any):
        self.f = f
        self.bytes = 0

    def read(self, n: int = -1) -> str:
        text = self.f.read(n)
        self.bytes += len(text.encode("utf-8", "surrogatepass"))
        return text


class Tracked:
    """An iterator over tokens that remembers how many it gave and the last one."""

    def __init__(self, tokens: Iterable[int]):
        self.tokens = iter(tokens)
        self.count = 0
        self.last: int | None = None

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        token = next(self.tokens)
        self.count += 1
        self.last = token
        return token


def check_checkpoint_name(path: Path, flag: str) -> Path:
    """Checkpoints are safetensors files and must be named so (MLX reads by suffix)."""
    if path.suffix != CHECKPOINT_SUFFIX:
        fail(f"{flag} {path}: use a file name ending in {CHECKPOINT_SUFFIX}")
    return path


def prepare_resume(
    resume: Path, checkpoint: Path | None, sinks: int | None, window: int | None
) -> tuple[Path, int, int]:
    """Check ``--resume`` against the options; returns (where to save from now on,
    sinks, window as saved). Without ``--checkpoint`` the run continues the file in
    place; with another one the file resumed from stays as it was. The other settings,
    the model and the text are checked when the checkpoint is loaded
    (``mlx_stream.checkpoint``), before anything is written."""
    from mlx_stream.checkpoint import read_metadata

    saved = read_metadata(check_checkpoint_name(resume, "--resume"))["identity"]
    for flag, given in (("sinks", sinks), ("window", window)):
        if given is not None and saved.get(flag) != given:
            fail(f"{resume}: made with --{flag} {saved.get(flag)}, not {given}")
    return checkpoint or resume, saved.get("sinks", sinks), saved.get("window", window)


def open_source(path: str) -> tuple[Any, int | None]:
    """The text to stream (a file or stdin) and its size in bytes when known."""
    if path == "-":
        return lenient_stdin(), None
    checked = check_text_file(path)
    # The head was checked; a stray bad byte further on becomes U+FFFD, not an error.
    return open(checked, encoding="utf-8", errors="replace"), checked.stat().st_size  # noqa: SIM115


def make_progress(console: Any, unit: str):
    """A rich progress bar over the file's bytes (``unit`` ``"bytes"``), the
    ``--limit-tokens`` tokens or, for stdin, the tokens so far (``"tokens"``): tok/s,
    running perplexity and, with a total, rich's ETA from the rate of progress."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    amount = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    return Progress(
        TextColumn("[bold]stream-run"),
        BarColumn(bar_width=16),
        TaskProgressColumn(),
        amount,
        TextColumn(
            "· {task.fields[tokens]} tokens · {task.fields[tps]} tok/s · ppl {task.fields[ppl]} · eta"
        ),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


def progress_done(position: int, tokens: Tracked, reader: CountingReader, size: int) -> int:
    """Bytes of the file behind the ``position`` tokens scored: the bytes read so far per
    token read so far (the tokenizer reads 64k characters ahead), capped at ``size``."""
    if not tokens.count:
        return 0
    return min(size, round(position * reader.bytes / tokens.count))


def evaluate(
    model: Any,
    tokens: Tracked,
    reader: CountingReader,
    size: int | None,
    cache: Any,
    chunk: int,
    segment: int,
    limit_tokens: int | None,
    checkpoint: Path | None,
    checkpoint_every: int,
    resume: Path | None,
    identity: dict,
):
    """Run ``evaluate.stream_perplexity`` under a progress bar, on a new cache of the
    policy ``cache`` (a ``CacheSpec``) or the one ``resume`` holds.

    Returns:
        ``(result, caches)``: the caches as they ended.
    """
    import signal
    import time

    from mlx_stream.eval.perplexity import stream_perplexity
    from mlx_stream.generate.decode import StopOnInterrupt

    caches = None
    if resume is None:
        caches = cache.build(model)  # refused with the bytes when it cannot fit
    console = stderr_console()
    by_bytes = bool(size) and limit_tokens is None
    progress = make_progress(console, "bytes" if by_bytes else "tokens")
    total = size if by_bytes else limit_tokens
    task = progress.add_task("stream", total=total, tps="-", ppl="-", tokens=0)
    tic = time.perf_counter()
    first: list[int] = []

    def callback(position: int, perplexity: float) -> None:
        if not first:
            first.append(position)
        done = progress_done(position, tokens, reader, size) if by_bytes else position
        elapsed = time.perf_counter() - tic
        progress.update(
            task, completed=done, ppl=fmt_ppl(perplexity), tokens=position,
            tps=f"{(position - first[0]) / elapsed:.0f}" if elapsed > 0 else "-",
        )  # fmt: skip

    # Only a terminal gets the live bar; a log file or a pipe stays clean. Ctrl-C or
    # SIGTERM stops between model calls, so the checkpoint written then is whole.
    signals = (signal.SIGINT, signal.SIGTERM)
    with StopOnInterrupt(signals) as stop, progress if console.is_terminal else contextlib.nullcontext():  # fmt: skip
        result = stream_perplexity(
            model, tokens, chunk=chunk, cache_spec=cache, prompt_cache=caches,
            callback=callback, segment=segment,
            limit_tokens=limit_tokens, checkpoint=checkpoint, resume=resume or False,
            checkpoint_every=checkpoint_every, identity=identity,
            should_stop=lambda: stop.interrupted,
        )  # fmt: skip
    return result, result.prompt_cache


def answer(
    model: Any, tokenizer: Any, caches: list, pending: int | None, prompt: str, max_tokens: int,
    write: Any, processors: list | None = None, sample: Any = None, seed: int | None = None,
) -> tuple[str, str | None]:  # fmt: skip
    """Ask ``prompt`` of what the window holds (the document's last token, still
    pending, goes first) and stream the reply through ``write`` (``processors``: e.g.
    a ``--json-schema`` constraint; ``sample``: a ``Sampling``, default greedy, drawn
    after seeding ``mx.random`` with ``seed`` when given). The reply ends at any token that ends a turn (``end_of_turn_tokens``).

    Returns:
        ``(text, finish_reason)``: ``"stop"`` at an end-of-turn token, ``"length"`` at
        ``max_tokens``.
    """
    from mlx_stream.generate.decode import stream_responses
    from mlx_stream.generate.model_config import Sampling, end_of_turn_tokens
    from mlx_stream.generate.sampler import make_sampling

    sample = sample or Sampling()
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        bos = getattr(tokenizer, "bos_token", None)
        if bos and text.startswith(bos):
            text = text[len(bos) :]
        text = "\n\n" + text
    else:
        text = f"\n\n{prompt}\n"
    tokens = ([] if pending is None else [pending]) + list(
        tokenizer.encode(text, add_special_tokens=False)
    )
    parts, finish = [], None
    sampler, penalty = make_sampling(sample, seed)
    for r in stream_responses(
        model, tokenizer, tokens, max_tokens=max_tokens, prompt_cache=caches, sampler=sampler,
        logits_processors=penalty + list(processors or []),
        stop_tokens=end_of_turn_tokens(tokenizer),
    ):  # fmt: skip
        parts.append(r.text)
        write(r.text)
        finish = r.finish_reason
    return "".join(parts), finish


def report(result: Any, cache: Any, as_json: bool, extra: dict):
    """The figures as one JSON object (``--json``) or a rich table on stdout."""
    sinks, window, positions = cache.sinks, cache.window, cache.positions
    data = {
        "tokens": result.tokens,
        "perplexity": result.perplexity,
        "nll": result.nll,
        "segments": [
            {k: s[k] for k in ("start", "end", "tokens", "perplexity")} for s in result.segments
        ],
        "sinks": sinks,
        "window": window,
        "positions": positions,
        "cache": cache.to_json(),
        "tokens_per_second": result.tokens_per_second,
        "peak_memory_mb": result.peak_memory / 1e6,
        "seconds": result.seconds,
        **extra,
    }
    recall = recall_usage(getattr(result, "prompt_cache", None))
    if recall is not None:
        data["recall"] = recall
    if as_json:
        typer.echo(json_line(data))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title_justify="left")
    for col in ("segment (tokens)", "perplexity"):
        table.add_column(col, justify="right")
    for s in result.segments:
        table.add_row(f"{s['start']}–{s['end']}", fmt_ppl(s["perplexity"]))
    console.print(table)
    console.print(
        f"perplexity {fmt_ppl(result.perplexity)} over {result.tokens} tokens · sinks {sinks} + "
        f"window {window} ({positions} positions) · {result.tokens_per_second:.0f} tok/s · "
        f"peak {result.peak_memory / 1e6:.0f} MB"
    )
    if recall is not None:
        console.print(recall_line(recall), soft_wrap=True)


def recall_usage(caches: list | None) -> dict | None:
    """``--json``'s ``recall`` object (``Recall.usage``: blocks stored, recalled and
    scored by the last refresh, the bytes of the blocks and of their index used in RAM
    and on disk, the room reserved, the seconds spent choosing), or ``None`` without a
    recall tier."""
    from mlx_stream.recall import tier_of

    tier = tier_of(caches) if caches else None
    return None if tier is None else tier.usage()


def recall_line(u: dict) -> str:
    """The text summary's recall line, in the CLI's vocabulary (used of reserved, where)."""
    from mlx_stream.cache.estimate import human, used_of

    disk = u["disk_reserved_bytes"]
    return (
        f"recall {u['stored_blocks']} blocks stored, {u['recalled_blocks']} recalled, "
        f"{u['scored_blocks']} scored ({u['refresh_seconds']:.2f} s choosing) · store "
        f"{used_of(u['ram_bytes'], u['ram_reserved_bytes'], 'RAM')}"
        + (f" + {used_of(u['disk_bytes'], disk, 'disk')}" if disk else "")
        + f", index {human(u['index_bytes'])} of it"
        + f" · region {used_of(None, u['region_bytes'], 'device')}"
    )


def fmt_ppl(value: float) -> str:
    """A perplexity for people: 2 decimals, or 3 significant digits when huge."""
    return f"{value:.2f}" if value < 1e5 else f"{value:.3g}"


def interrupted_line(result: Any, checkpoint: Path | None) -> str:
    """What a stopped run says on stderr: where it stopped, and how to go on."""
    where = f"interrupted at token {result.position}"
    if checkpoint is not None and result.checkpoint_error is None:
        return f"{where}; checkpoint saved, continue with --resume {checkpoint}"
    return f"{where}; nothing saved (pass --checkpoint FILE to keep a stopped run)"


def failure_line(result: Any, checkpoint: Path | None) -> str:
    """What a run stopped by a failure says: why, where, and how to go on."""
    where = f"{result.failure}; stopped at token {result.position}"
    if checkpoint is not None and result.checkpoint_error is None:
        return f"{where}; checkpoint saved, continue with --resume {checkpoint}"
    if result.checkpoint_error is not None:
        return f"{where}; {result.checkpoint_error}"
    return f"{where}; nothing saved (pass --checkpoint FILE to keep a stopped run)"


@handle_errors
@grouped
def stream_run(
    path: Source,
    positions: opt.Positions = "cache",
    *,
    scoring: opt.ScoringOptions,
    reply: opt.ReplyOptions,
    output: opt.OutputOptions,
    checkpoint: opt.Checkpoint = None,
    checkpoint_every: opt.CheckpointEvery = opt.DEFAULT_CHECKPOINT_EVERY,
    resume: opt.Resume = None,
    model: opt.ModelOptions,
    cache: opt.CacheOptions,
    sampling: opt.SamplingOptions,
    recall: opt.RecallOptions,
) -> None:
    """Stream a long text (a file, or - for stdin) through the model in fixed memory.

    Scores every token and reports perplexity overall and per segment. --prompt then
    answers a question from what is still in the window (with --recall: also from the
    evicted blocks its queries choose), sampled like chat (the model's
    generation_config.json, else temperature 0.7) and ended at the end of its turn. Ctrl-C (or SIGTERM) stops
    between model calls, saves --checkpoint and prints the figures so far; so does a
    recall store whose disk is full (exit 1). A checkpoint carries the recall store.
    """
    scoring.check()
    check_positive(reply.max_tokens, "--max-tokens")
    check_positive(checkpoint_every, "--checkpoint-every")
    sampling.check()
    cache.check(positions)
    prompt, csv, json_out = reply.prompt, output.csv, output.json_out
    if prompt is not None and not prompt.strip():
        fail("--prompt is empty")
    if reply.json_schema is not None and prompt is None:
        fail("--json-schema constrains the answer to --prompt: pass --prompt too")
    recall_policy = recall.spec()
    if csv is not None:
        check_output_path(csv)
    if checkpoint is not None:
        check_output_path(check_checkpoint_name(checkpoint, "--checkpoint"))
    # Continuing a checkpoint in place is what --resume X --checkpoint X means.
    check_distinct({"--csv": csv, "--checkpoint": checkpoint}, {"the input": path})
    check_distinct({"--csv": csv}, {"--resume": resume})
    cluster = model.join()
    if cluster is not None and (checkpoint or resume):
        fail("--checkpoint and --resume are not available with --distributed")
    if cluster is not None and recall_policy is not None:
        fail("--recall is not available with --distributed")
    if cluster is None or cluster.is_root:
        f, size = open_source(path)
    else:  # the text lives on rank 0's machine: read what rank 0 shares
        f, size = None, None
        csv = None
    if cluster is not None:
        f, size = cluster.stream(f), cluster.share_int(-1 if size is None else size)
        size = None if size < 0 else size
    try:
        if resume is not None:
            checkpoint, sinks, window = prepare_resume(
                resume, checkpoint, cache.sinks, cache.window
            )
            cache = dataclasses.replace(cache, sinks=sinks, window=window)
        target, tokenizer, spec, policy, model_path = model.load(
            cache, cluster, positions=positions
        )
        policy = policy.replace(recall=recall_policy)
        constraint = None
        if reply.json_schema is not None:  # checked before the long run, used after it
            from mlx_stream.serve.structured import Grammars, schema_file_grammar

            constraint = Grammars(tokenizer).constraint(schema_file_grammar(reply.json_schema))
        from mlx_stream.eval.perplexity import iter_tokens
        from mlx_stream.models.loader import resolve_dtype

        reader = CountingReader(f)
        tokens = Tracked(iter_tokens(reader, tokenizer))
        identity = {
            "model": spec.name if spec is not None else str(Path(model.model).resolve()),
            "dtype": resolve_dtype(model.dtype), **policy.to_json(),
        }  # fmt: skip
        result, caches = evaluate(
            target, tokens, reader, size, policy, scoring.chunk, scoring.segment,
            scoring.limit_tokens, checkpoint, checkpoint_every, resume, identity,
        )  # fmt: skip
    finally:
        if path != "-":
            f.close()
    if result.failure is not None:  # e.g. the recall store's disk is full
        if result.tokens:
            report(result, policy, json_out, {"interrupted": True, "failure": result.failure}
                   if json_out else {})  # fmt: skip
        error_line(failure_line(result, checkpoint))
        raise typer.Exit(EXIT_RUNTIME)
    if result.interrupted and result.tokens == 0:
        typer.echo(interrupted_line(result, checkpoint), err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    if result.tokens == 0:
        fail(f"{'stdin' if path == '-' else path}: too short, no token to score")
    # The main result goes out first: a side output that fails cannot take it along.
    if not json_out or result.interrupted:
        report(result, policy, json_out, {"interrupted": True} if json_out else {})
    if result.interrupted:
        typer.echo(interrupted_line(result, checkpoint), err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    extra: dict[str, Any] = {}
    if prompt is not None:

        def write(text: str) -> None:
            if not json_out:
                print(text, end="", flush=True)

        extra["answer"], extra["finish_reason"] = answer(
            target, tokenizer, caches, tokens.last, prompt, reply.max_tokens, write,
            [constraint] if constraint is not None else None,
            sampling.sampling(model_path), sampling.seed,
        )  # fmt: skip
        if not json_out:
            print(flush=True)
    if json_out:
        report(result, policy, True, extra)
    failures = [result.checkpoint_error] if result.checkpoint_error else []
    if csv is not None:
        try:
            atomic_write_csv(csv, [dict(s) for s in result.segments])
        except OSError as e:
            failures.append(f"cannot write --csv {csv}: {e.strerror or e}")
    if failures:
        error_line("; ".join(failures))
        raise typer.Exit(EXIT_RUNTIME)
