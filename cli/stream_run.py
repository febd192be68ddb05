"""``mlx-stream stream-run``: a long document through the model in fixed memory.

The text is read and tokenized block by block (``evaluate.iter_tokens``) and fed as one
stream through the sink + window cache; every token's negative log-likelihood is
scored and reported as perplexity overall and per segment. ``--prompt`` then asks a
question of whatever the window still holds.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import options as opt
from cli.common import (
    atomic_path,
    atomic_write_csv,
    check_choice,
    check_kv_bits,
    check_output_path,
    check_positive,
    check_text_file,
    fail,
    handle_errors,
    load_model,
    sizes,
    stderr_console,
)

POSITIONS = ("cache", "absolute")
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


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The evaluation state and cache sizes saved in a ``--checkpoint`` file."""
    import mlx.core as mx

    from mlx_stream.evaluate import CHECKPOINT_KEY

    if not path.exists():
        fail(f"{path}: no such checkpoint")
    if path.is_dir():
        fail(f"{path}: is a directory, expected a checkpoint file")
    try:
        _, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        totals = json.loads(meta[CHECKPOINT_KEY])
        layers = json.loads(meta["mlx_stream"])["layers"]
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        fail(f"{path}: not a stream-run checkpoint ({type(exc).__name__})")
    sink = next((layer["meta"] for layer in layers if layer.get("meta")), {})
    return {"totals": totals, "sinks": sink.get("sinks"), "window": sink.get("window")}


def prepare_resume(
    resume: Path, checkpoint: Path | None, segment: int, sinks: int | None, window: int | None
) -> tuple[Path, int, int]:
    """Check ``--resume`` against the options; returns (checkpoint to continue, sinks,
    window) as saved. With a different ``--checkpoint`` the saved file is copied there
    first, so the original stays as it was."""
    saved = read_checkpoint(check_checkpoint_name(resume, "--resume"))
    if saved["totals"].get("segment") != segment:
        fail(f"{resume}: saved with --segment {saved['totals'].get('segment')}; pass the same")
    for flag, given, kept in (("--sinks", sinks, saved["sinks"]), ("--window", window, saved["window"])):  # fmt: skip
        if given is not None and kept is not None and given != kept:
            fail(f"{resume}: saved with {flag} {kept}, not {given}")
    target = resume
    if checkpoint is not None and checkpoint.resolve() != resume.resolve():
        with atomic_path(checkpoint) as tmp:
            shutil.copyfile(resume, tmp)
        target = checkpoint
    return target, saved["sinks"], saved["window"]


def open_source(path: str) -> tuple[Any, int | None]:
    """The text to stream (a file or stdin) and its size in bytes when known."""
    if path == "-":
        return sys.stdin, None
    checked = check_text_file(path)
    return open(checked, encoding="utf-8"), checked.stat().st_size  # noqa: SIM115


def make_progress(console: Any):
    """A rich progress bar: tokens, tok/s, running perplexity and (size known) ETA."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]stream-run"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("tokens · {task.fields[tps]} tok/s · ppl {task.fields[ppl]} · eta"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


def evaluate(
    model: Any,
    tokens: Tracked,
    reader: CountingReader,
    size: int | None,
    sinks: int,
    window: int,
    chunk: int,
    positions: str,
    segment: int,
    limit_tokens: int | None,
    checkpoint: Path | None,
    resume: bool,
    kv: dict,
):
    """Run ``evaluate.stream_perplexity`` under a progress bar.

    Returns:
        ``(result, caches)``: the caches as they ended (reloaded from the checkpoint
        when one was written, since a resumed run loads its own).
    """
    import time

    from mlx_stream.cache import load_cache, make_sink_cache
    from mlx_stream.evaluate import stream_perplexity

    caches = None
    if not resume:
        caches = make_sink_cache(model, sinks, window, positions=positions, **kv)
    console = stderr_console()
    progress = make_progress(console)
    task = progress.add_task("stream", total=limit_tokens, tps="-", ppl="-")
    tic = time.perf_counter()
    first: list[int] = []

    def callback(position: int, perplexity: float) -> None:
        if not first:
            first.append(position)
        total = limit_tokens
        if size and reader.bytes and tokens.count:
            # Tokens per byte so far, times the file size: the stream's likely length.
            estimate = int(tokens.count * size / reader.bytes)
            total = min(total or estimate, max(estimate, position))
        elapsed = time.perf_counter() - tic
        progress.update(
            task, completed=position, total=total, ppl=fmt_ppl(perplexity),
            tps=f"{(position - first[0]) / elapsed:.0f}" if elapsed > 0 else "-",
        )  # fmt: skip

    # Only a terminal gets the live bar; a log file or a pipe stays clean.
    with progress if console.is_terminal else contextlib.nullcontext():
        result = stream_perplexity(
            model, tokens, sinks=sinks, window=window, chunk=chunk, positions=positions,
            prompt_cache=caches, callback=callback, segment=segment,
            limit_tokens=limit_tokens, checkpoint=checkpoint, resume=resume,
        )  # fmt: skip
    if checkpoint is not None:
        caches, _ = load_cache(checkpoint, model)
    return result, caches


def answer(
    model: Any, tokenizer: Any, caches: list, pending: int | None, prompt: str, max_tokens: int,
    write: Any,
) -> str:  # fmt: skip
    """Ask ``prompt`` of what the window holds (the document's last token, still
    pending, goes first) and stream the reply through ``write``."""
    from mlx_stream.decode import stream_generate

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
    parts = []
    for r in stream_generate(model, tokenizer, tokens, max_tokens=max_tokens, prompt_cache=caches):
        parts.append(r.text)
        write(r.text)
    return "".join(parts)


def report(result: Any, sinks: int, window: int, positions: str, as_json: bool, extra: dict):
    """The figures as one JSON object (``--json``) or a rich table on stdout."""
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
        "tokens_per_second": result.tokens_per_second,
        "peak_memory_mb": result.peak_memory / 1e6,
        "seconds": result.seconds,
        **extra,
    }
    if as_json:
        typer.echo(json.dumps(data))
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


def fmt_ppl(value: float) -> str:
    """A perplexity for people: 2 decimals, or 3 significant digits when huge."""
    return f"{value:.2f}" if value < 1e5 else f"{value:.3g}"


@handle_errors
def stream_run(
    path: Source,
    model: opt.Model = None,
    sinks: opt.Sinks = None,
    window: opt.Window = None,
    positions: opt.Positions = "cache",
    chunk: opt.Chunk = opt.DEFAULT_CHUNK,
    segment: opt.Segment = opt.DEFAULT_SEGMENT,
    limit_tokens: opt.LimitTokens = None,
    prompt: opt.Prompt = None,
    max_tokens: opt.MaxTokens = opt.DEFAULT_MAX_TOKENS,
    json_out: opt.Json = False,
    csv: opt.Csv = None,
    checkpoint: opt.Checkpoint = None,
    resume: opt.Resume = None,
    dtype: opt.Dtype = "auto",
    kv_bits: opt.KvBits = None,
    kv_group_size: opt.KvGroupSize = 64,
    kv_key_bits: opt.KvKeyBits = None,
    distributed: opt.Distributed = "auto",
) -> None:
    """Stream a long text (a file, or - for stdin) through the model in fixed memory.

    Scores every token and reports perplexity overall and per segment. --prompt then
    answers a question from what is still in the window.
    """
    check_positive(sinks, "--sinks", 0)
    check_positive(window, "--window")
    check_positive(chunk, "--chunk")
    check_positive(segment, "--segment")
    check_positive(limit_tokens, "--limit-tokens", 2)
    check_positive(max_tokens, "--max-tokens")
    check_choice(positions, "--positions", POSITIONS)
    check_kv_bits(kv_bits, kv_group_size, kv_key_bits)
    if prompt is not None and not prompt.strip():
        fail("--prompt is empty")
    if csv is not None:
        check_output_path(csv)
    if checkpoint is not None:
        check_output_path(check_checkpoint_name(checkpoint, "--checkpoint"))
    from mlx_stream import distributed as dist

    cluster = dist.join(distributed, model)
    if cluster is not None and (checkpoint or resume):
        fail("--checkpoint and --resume are not available with --distributed")
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
            checkpoint, sinks, window = prepare_resume(resume, checkpoint, segment, sinks, window)
        target, tokenizer, spec = load_model(model, dtype, prepare=dist.preparer(cluster))
        sinks, window = sizes(spec, sinks, window)
        from mlx_stream.evaluate import iter_tokens

        reader = CountingReader(f)
        tokens = Tracked(iter_tokens(reader, tokenizer))
        result, caches = evaluate(
            target, tokens, reader, size, sinks, window, chunk, positions, segment,
            limit_tokens, checkpoint, resume is not None,
            {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "key_bits": kv_key_bits},
        )  # fmt: skip
    finally:
        if f is not sys.stdin:
            f.close()
    if result.tokens == 0:
        fail(f"{'stdin' if path == '-' else path}: too short, no token to score")
    if csv is not None:
        atomic_write_csv(csv, [dict(s) for s in result.segments])
    if not json_out:
        report(result, sinks, window, positions, False, {})
    extra: dict[str, Any] = {}
    if prompt is not None:

        def write(text: str) -> None:
            if not json_out:
                print(text, end="", flush=True)

        extra["answer"] = answer(target, tokenizer, caches, tokens.last, prompt, max_tokens, write)
        if not json_out:
            print(flush=True)
    if json_out:
        report(result, sinks, window, positions, True, extra)
