"""Model loading for the commands: a progress bar on stderr while a first use pulls,
the cache, recall and prefix-store specs of the options (the registry entry's
defaults under them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .checks import check_positive
from .failures import fail
from .streams import stderr_console


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
    from .options import command_context

    ctx = command_context()
    if ctx is None:
        return True
    source = ctx.get_parameter_source(param)
    return source is None or source.name not in ("DEFAULT", "DEFAULT_MAP")


def _registry_recall() -> dict:
    """The ``recall:`` defaults of the registry entry the running command's ``--model``
    names (the default model without one); ``{}`` for a folder, a file, a name the
    registry does not know (loading says why) or outside a command."""
    from .options import command_context

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
