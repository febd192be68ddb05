"""What every command shares: one-line errors with exit codes, input-file and option
checks, atomic output files, and model loading with a progress bar for pulls.

Only typer is imported at module level; rich and the engine are imported where used,
so ``mlx-stream --help`` stays instant.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `cmd | head`
DEBUG_ENV = "MLX_STREAM_DEBUG"
SNIFF_BYTES = 1 << 16


def _user_error_class() -> type[Exception]:
    from mlx_stream.errors import UserError

    return UserError


def fail(message: str) -> NoReturn:
    """Raise the engine's one-line user error (exit 2) with ``message``."""
    raise _user_error_class()(message)


def error_line(message: str) -> None:
    """Print ``Error: message`` as exactly one line on stderr."""
    text = " ".join(str(message).split()) or "unknown error"
    typer.echo(f"Error: {text}", err=True)


def exit_code_for(exc: BaseException) -> int:
    """The exit code of an exception: 2 for bad usage or input, 1 for runtime failures.

    The engine's ``UserError`` carries its own ``exit_code`` (2, or 1 for its runtime
    subclass); undecodable input is bad input; anything else is a runtime failure.
    """
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int):
        return code
    return EXIT_USAGE if isinstance(exc, UnicodeDecodeError) else EXIT_RUNTIME


def describe(exc: BaseException) -> str:
    """A one-line description of ``exc`` for the user."""
    if isinstance(exc, UnicodeDecodeError):
        return f"input is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if isinstance(exc, MemoryError):
        return "out of memory"
    text = str(exc)
    if isinstance(exc, _user_error_class()) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def handle_errors(func: F) -> F:
    """Decorate a command so failures end as one line on stderr and an exit code.

    ``typer.Exit``/``Abort`` and click usage errors pass through untouched. Set
    ``MLX_STREAM_DEBUG=1`` to see the traceback of an unexpected error.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = func(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return result
        except BrokenPipeError:
            silence_stdout()
            raise typer.Exit(EXIT_BROKEN_PIPE) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            typer.echo("", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:  # noqa: BLE001 - this is the one place that catches all
            import click

            if isinstance(exc, click.ClickException):
                raise
            if os.environ.get(DEBUG_ENV):
                raise
            error_line(describe(exc))
            raise typer.Exit(exit_code_for(exc)) from None

    return wrapper  # type: ignore[return-value]


def silence_stdout() -> None:
    """Point stdout at /dev/null: the reader of a pipe went away (``| head``), and
    Python's final flush must not print a traceback about it."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def json_line(data: Any) -> str:
    """``data`` as one JSON line in which NaN and infinities are ``null`` (JSON has
    no such numbers, and a reader must never mistake one for a figure)."""
    import json
    import math

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(data), allow_nan=False)


def lenient_stdin():
    """Standard input as text where undecodable bytes become U+FFFD, not a crash."""
    import io

    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # already text (a test runner's stand-in)
        return sys.stdin
    return io.TextIOWrapper(buffer, encoding="utf-8", errors="replace")


# ---------------------------------------------------------------------------- checks


def check_positive(value: int | None, flag: str, minimum: int = 1) -> None:
    """One-line error unless ``value`` (when given) is at least ``minimum``."""
    if value is not None and value < minimum:
        fail(f"{flag} must be at least {minimum} (got {value})")


def check_choice(value: str, flag: str, choices: tuple[str, ...]) -> None:
    """One-line error unless ``value`` is one of ``choices``."""
    if value not in choices:
        fail(f"{flag} must be one of {', '.join(choices)} (got {value!r})")


def check_cache(
    sinks: int | None = None,
    window: int | None = None,
    positions: str = "cache",
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    key_bits: int | None = None,
) -> None:
    """One-line error naming the flag for cache options a SinkCache cannot have,
    before any model loads (the engine's ``CacheSpec`` checks, nothing repeated here)."""
    from mlx_stream.cache.spec import CacheSpec

    CacheSpec.for_model(None, sinks, window, positions, kv_bits, kv_group_size, key_bits)


def check_kv_bits(kv_bits: int | None, kv_group_size: int, key_bits: int | None = None) -> None:
    """One-line error for a cache quantization the SinkCache cannot store."""
    check_cache(kv_bits=kv_bits, kv_group_size=kv_group_size, key_bits=key_bits)


def check_sampling(
    temp: float | None, top_p: float | None, top_k: int | None = None,
    repetition_penalty: float | None = None,
) -> None:  # fmt: skip
    """One-line error for a negative temperature, a top-p outside (0, 1], a negative
    top-k or a repetition penalty that is not positive (``None``: not given)."""
    if temp is not None and temp < 0:
        fail(f"--temp must be at least 0 (got {temp})")
    if top_p is not None and not 0 < top_p <= 1:
        fail(f"--top-p must be in (0, 1] (got {top_p})")
    if top_k is not None and top_k < 0:
        fail(f"--top-k must be at least 0 (got {top_k})")
    if repetition_penalty is not None and repetition_penalty <= 0:
        fail(f"--repetition-penalty must be above 0 (got {repetition_penalty})")


def sampling(
    model_path: Any, temp: float | None = None, top_p: float | None = None,
    top_k: int | None = None, repetition_penalty: float | None = None,
):  # fmt: skip
    """The run's ``Sampling``: the model's defaults (its ``generation_config.json``,
    else mlx-stream's) with the options given over them."""
    from mlx_stream.generate.model_config import sampling_defaults

    base = sampling_defaults(model_path)
    given = {"temp": temp, "top_p": top_p, "top_k": top_k,
             "repetition_penalty": repetition_penalty}  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return base
    if given.get("repetition_penalty") == 1.0:
        given["repetition_penalty"] = None
    return base.replace(**given, source=f"{base.source}, options over it")


def check_text_file(path: str | Path) -> Path:
    """Return ``path`` if it names a non-empty UTF-8 text file, else a one-line error.

    Only the first 64 KiB are sniffed here (for NUL bytes and UTF-8); a bad byte
    further on surfaces as a ``UnicodeDecodeError``, which ``handle_errors`` also
    reports as bad input.
    """
    path = Path(path)
    if not path.exists():
        fail(f"{path}: no such file")
    if path.is_dir():
        fail(f"{path}: is a directory, expected a text file")
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as exc:
        fail(f"{path}: cannot read ({exc.strerror or exc})")
    if not head:
        fail(f"{path}: file is empty")
    if b"\x00" in head:
        fail(f"{path}: looks like a binary file, expected UTF-8 text")
    try:
        # A multi-byte character cut at the sniff boundary is fine; at the end of the
        # file it is not.
        import codecs

        whole = len(head) < SNIFF_BYTES
        codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as exc:
        fail(f"{path}: not UTF-8 text (bad byte at offset {exc.start})")
    if not head.strip():
        fail(f"{path}: file has only whitespace")
    return path


def check_output_path(path: str | Path) -> Path:
    """Return ``path`` if a file can be written there, else a one-line error.

    Checked before any long run so a typo costs nothing.
    """
    path = Path(path)
    if path.is_dir():
        fail(f"{path}: is a directory, expected a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        fail(f"{path}: directory {parent} does not exist")
    if not parent.is_dir():
        fail(f"{path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"{path}: directory {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        fail(f"{path}: file is not writable")
    return path


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (an existing file by inode, else by path)."""
    a, b = Path(a), Path(b)
    with contextlib.suppress(OSError):
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def check_distinct(outputs: dict[str, Any], inputs: dict[str, Any]) -> None:
    """One-line error when an output path (``{flag: path}``, None skipped) names an
    input or another output: writing it would destroy what it is computed from."""
    outs = [(flag, path) for flag, path in outputs.items() if path is not None]
    ins = [(flag, path) for flag, path in inputs.items() if path not in (None, "-")]
    for i, (flag, path) in enumerate(outs):
        for other, where in ins + outs[:i]:
            if same_file(path, where):
                fail(f"{flag} {path} is the same file as {other} {where}: choose another path")


# ----------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success move it over ``path``.

    The temporary name keeps the suffix of ``path`` (some writers pick the format
    from it) and carries this process's pid, so a later run removes it if this one is
    killed. On any error the temporary file is removed and ``path`` is untouched, so
    readers never see a half-written file. The file gets the mode the umask gives.
    """
    from mlx_stream import files

    path = Path(path)
    files.remove_stale(path)  # what a killed run left beside it
    fd, tmp = tempfile.mkstemp(prefix=files.temp_prefix(path), suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, files.file_mode())  # mkstemp makes it private; follow the umask
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file + ``os.replace``)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` (dicts with the same keys) as CSV to ``path`` atomically."""
    import csv
    import io

    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


# ----------------------------------------------------------------- engine glue


def print_table(table: Any) -> None:
    """Print a rich table on stdout; off a terminal (a pipe, a file) as wide as its
    rows and without trailing blanks, so no name is cut to ``smollm2-135...`` nor a
    row wrapped."""
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        console.print(table)
        return
    wide = Console(width=10_000)
    with wide.capture() as capture:
        wide.print(table)
    typer.echo("\n".join(line.rstrip() for line in capture.get().splitlines()))


def reflow(text: str | None) -> str | None:
    """A docstring as help text: each paragraph's lines joined into one (the help
    wraps them to the terminal, so none breaks mid-sentence); paragraphs with indented
    or bulleted lines, and ``\\b`` blocks, stay as written."""
    if not text:
        return text
    paragraphs = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines = para.split("\n")
        kept = para.startswith("\b") or any(line.startswith((" ", "- ", "* ")) for line in lines)
        paragraphs.append(para if kept else " ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def tidy_help(app: typer.Typer) -> None:
    """Help that reads as sentences: every command's docstring reflowed (:func:`reflow`)
    and flags shown without a type (typer 0.29 prints ``<bool>`` beside ``--json``)."""
    from typer.core import TyperOption

    for info in app.registered_commands:
        if info.callback is not None:
            info.callback.__doc__ = reflow(info.callback.__doc__)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            tidy_help(group.typer_instance)
    shown = TyperOption.display_type_rich
    if not getattr(shown, "tidy", False) and callable(shown):

        def display_type_rich(self: Any, ctx: Any) -> str | None:
            return None if self.is_flag else shown(self, ctx)

        display_type_rich.tidy = True  # type: ignore[attr-defined]
        TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def stderr_console():
    """A rich console on stderr (progress bars, tables) that never pollutes stdout."""
    from rich.console import Console

    return Console(stderr=True)


def load_model(
    name: str | None, dtype: str = "auto", what: str = "model", prepare=None, sinks=None,
    window=None, kv=None, with_path: bool = False,
):  # fmt: skip
    """Load ``name`` (registry name, Hugging Face id, folder or .gguf; None: the
    default) with a rich progress bar on stderr while a first use pulls or converts
    it; ``sinks``/``window`` (None: the entry's) and ``kv`` (the cache's ``kv_bits``,
    ``kv_group_size``, ``key_bits``) size the fit check before loading.

    Returns:
        ``(model, tokenizer, spec)``; ``spec`` is the registry entry (None for a path);
        ``with_path``: the mlx-lm folder loaded after them.
    """
    from mlx_stream.models import loader

    console = stderr_console()

    def log(message: str) -> None:
        console.print(message, style="dim", highlight=False, soft_wrap=True)

    with _pull_progress(console, what) as callback:
        model, tokenizer, info = loader.load(
            name, dtype=dtype, progress=callback, log=log, return_info=True, prepare=prepare,
            sinks=sinks, window=window, kv=kv,
        )  # fmt: skip
    if with_path:
        return model, tokenizer, info.spec, info.path
    return model, tokenizer, info.spec


def pull_bars(console: Any, transient: bool = True) -> tuple[Any, Callable[..., None]]:
    """``(bars, callback)``: a rich ``Progress`` and its callback ``(done, total,
    stage)``, one bar per stage of a pull. A stage of bytes shows ``12.1/101.9 MB``,
    its speed and time left; a stage of steps ``12/272``; a stage of unknown length
    (``total`` None) a running clock until the next stage begins, then ``done``."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    from mlx_stream.models.registry import counts_bytes

    class Amount(ProgressColumn):
        """What a stage counts, in its unit; its speed and time left for bytes."""

        columns = (DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())

        def render(self, task):
            if task.fields.get("over"):
                return Text("done", style="green")
            if task.total is None:
                return TimeElapsedColumn().render(task)
            if counts_bytes(task.description):  # speed and time left once known
                shown = self.columns if task.speed else self.columns[:1]
                return Text(" ").join(c.render(task) for c in shown)
            return Text(f"{int(task.completed)}/{int(task.total)}", style="progress.download")

    bars = Progress(TextColumn("[bold]{task.description}"), BarColumn(), Amount(),
                    console=console, transient=transient)  # fmt: skip
    tasks: dict[str, Any] = {}

    def callback(done: int | float, total: int | float | None = None, stage: Any = None):
        label = str(stage or "pull")
        if label not in tasks:
            for task in bars.tasks:  # a stage of unknown length is over when the next begins
                if task.total is None and not task.fields.get("over"):
                    bars.update(task.id, total=1, completed=1, over=True)
            tasks[label] = bars.add_task(label, total=total)
        bars.update(tasks[label], completed=done, total=total)

    return bars, callback


@contextlib.contextmanager
def _pull_progress(console, what: str) -> Iterator[Callable[..., None]]:
    """A progress callback ``(done, total, description=None)`` drawing rich bars
    (:func:`pull_bars`).

    The bars appear only once a pull reports progress, so loading a model that is
    already on disk prints nothing.
    """
    bars, draw = pull_bars(console)
    started = []

    def callback(done: int | float, total: int | float | None = None, description: Any = None):
        if not started:
            bars.start()
            started.append(True)
        draw(done, total, description or f"Pulling {what}")

    try:
        yield callback
    finally:
        if started:
            bars.stop()


def cache_spec(spec, sinks: int | None = None, window: int | None = None, **options: Any):
    """The command's ``CacheSpec``: the registry entry ``spec`` (None for a path) with
    the options given over it (``positions``, ``kv_bits``, ``kv_group_size``,
    ``key_bits``, ``num_draft_tokens``); errors name the flags."""
    from mlx_stream.cache.spec import CacheSpec

    return CacheSpec.for_model(spec, sinks, window, **options)


def load_for_cache(
    model: str | None, dtype: str, sinks: int | None, window: int | None, prepare=None,
    with_path: bool = False, **options: Any,
):  # fmt: skip
    """Load ``model`` fit-checked against the cache it will run with, and that cache's
    ``CacheSpec`` (``options``: as for :func:`cache_spec`).

    Returns:
        ``(model, tokenizer, spec, cache)``; ``spec`` is the registry entry (None for a
        path), ``cache`` the command's ``CacheSpec``; ``with_path``: the mlx-lm folder
        loaded last.
    """
    kv = {k: options[k] for k in ("kv_bits", "kv_group_size", "key_bits") if k in options}
    target, tokenizer, spec, path = load_model(
        model, dtype, prepare=prepare, sinks=sinks, window=window, kv=kv, with_path=True
    )
    policy = cache_spec(spec, sinks, window, **options)
    return (
        (target, tokenizer, spec, policy, path) if with_path else (target, tokenizer, spec, policy)
    )


def sizes(spec, sinks: int | None, window: int | None) -> tuple[int, int]:
    """``(sinks, window)``: the options if given, else the registry entry's defaults."""
    policy = cache_spec(spec, sinks, window)
    return policy.sinks, policy.window


def is_interactive(stream=None) -> bool:
    """Whether ``stream`` (default stdin) is a terminal."""
    stream = stream or sys.stdin
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def recall_spec(recall: bool, blocks: int, bits: int | None, ram_mb: int, folder: Any):
    """The ``RecallSpec`` of the ``--recall*`` options (``None`` without ``--recall``);
    an option not on the command line takes the model's registry default
    (``recall:`` of its entry) if it has one; a bad value is one line."""
    if not recall:
        return None
    defaults = _registry_recall()
    blocks = defaults.get("blocks", blocks) if not _given("recall_blocks") else blocks
    bits = defaults.get("bits", bits) if not _given("recall_bits") else bits
    ram_mb = defaults.get("ram_mb", ram_mb) if not _given("recall_ram") else ram_mb
    check_positive(blocks, "--recall-blocks")
    check_positive(ram_mb, "--recall-ram", 0)
    if bits not in (None, 4, 8):
        fail(f"--recall-bits must be 4 or 8 (got {bits})")
    from mlx_stream.recall import RecallSpec
    from mlx_stream.recall.store import check_folder

    if folder is not None:
        check_folder(Path(folder))
    return RecallSpec(blocks=blocks, bits=bits, ram_bytes=ram_mb * 1_000_000,
                      folder=None if folder is None else str(folder))  # fmt: skip


def prefix_store(folder: Path | None, mb: int, off: bool) -> Any:
    """The ``PrefixStore`` of ``--prefix-store``, ``--prefix-store-mb`` and
    ``--no-prefix-store`` (``None`` when off); a bad value is one line. A folder that
    cannot be made or written turns the store off with one log line, the command runs."""
    if off:
        return None
    check_positive(mb, "--prefix-store-mb")
    if folder is not None and Path(folder).expanduser().exists() and not Path(folder).is_dir():
        fail(f"--prefix-store {folder}: not a folder")
    from mlx_stream.prefix_store import open_store

    return open_store(folder, mb)


def _given(param: str) -> bool:
    """Whether the running command's ``param`` came from the command line (or the
    environment), not its default; ``True`` outside a command."""
    from cli.options import command_context

    ctx = command_context()
    if ctx is None:
        return True
    source = ctx.get_parameter_source(param)
    return source is None or source.name not in ("DEFAULT", "DEFAULT_MAP")


def _registry_recall() -> dict:
    """The ``recall:`` defaults of the registry entry the running command's ``--model``
    names (the default model without one); ``{}`` for a folder, a file, a name the
    registry does not know (loading says why) or outside a command."""
    from cli.options import command_context

    ctx = command_context()
    if ctx is None:
        return {}
    name = ctx.params.get("model")
    from mlx_stream.errors import UserError
    from mlx_stream.models import hub, registry

    try:
        if name is not None:
            path = Path(name).expanduser()
            if path.exists() or path.suffix == ".gguf":
                return {}
        reg = registry.load_registry()
        if name is None:
            entry = reg.default_spec()
        elif name in reg.models:
            entry = reg.models[name]
        elif hub.is_repo_id(name):
            entry = hub.spec_for(name, reg)
        else:
            return {}
    except UserError:
        return {}
    return {k: v for k, v in (entry.recall or {}).items() if v is not None}
