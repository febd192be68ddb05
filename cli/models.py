"""``mlx-stream models``: list, inspect, pull, import and remove registry models.

Only typer is imported at module level; the engine (and rich) inside the commands, so
``mlx-stream --help`` stays instant.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import handle_errors, stderr_console

app = typer.Typer(
    help=(
        "The model registry (models.yaml): list, info, pull, import, rm.\n\n"
        "Examples:\n\n"
        "  mlx-stream models\n\n"
        "  mlx-stream models pull\n\n"
        "  mlx-stream models import ./my-model.Q4_0.gguf --name my-model"
    ),
    invoke_without_command=True,
    no_args_is_help=False,
)

Name = Annotated[str, typer.Argument(help="A model name from `mlx-stream models list`.")]


@contextlib.contextmanager
def _progress(console) -> Iterator[tuple[Any, Any]]:
    """``(progress, log)`` callbacks drawing one rich bar per stage on stderr."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,  # on failure only the one-line error stays
    )
    tasks: dict[str, Any] = {}

    def progress(done: int, total: int | None, stage: str) -> None:
        if stage not in tasks:
            _close_open_stages()
            tasks[stage] = bars.add_task(stage, total=total)
        bars.update(tasks[stage], completed=done, total=total)

    def _close_open_stages() -> None:
        for task in bars.tasks:  # a stage of unknown length is over when the next begins
            if task.total is None and task.visible:
                bars.update(task.id, visible=False)

    def log(message: str) -> None:
        bars.console.print(message, markup=False, highlight=False, soft_wrap=True)

    with bars:
        yield progress, log
        _close_open_stages()


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _rows() -> list[dict[str, Any]]:
    from mlx_stream import loader, registry

    reg = registry.load_registry()
    rows = []
    for name, spec in reg.models.items():
        pulled = loader.is_pulled(name)
        rows.append(
            {
                "name": name,
                "default": name == reg.default,
                "pulled": pulled,
                "path": str(loader.model_path(name)) if pulled else None,
                "description": spec.description,
                "sinks": spec.sinks,
                "window": spec.window,
                "sources": [str(s) for s in spec.sources],
            }
        )
    return rows


@app.callback()
def models(ctx: typer.Context) -> None:
    """The model registry. Without a subcommand: list the models."""
    if ctx.invoked_subcommand is None:
        list_models(as_json=False)


@app.command("list")
@handle_errors
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the registry's models and whether each is pulled."""
    rows = _rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("name", "pulled", "description"):
        table.add_column(column)
    for row in rows:
        name = row["name"] + (" (default)" if row["default"] else "")
        table.add_row(name, "yes" if row["pulled"] else "no", row["description"])
    Console().print(table)


def _recall_line(config: dict, folder, policy: str, sinks: int) -> str:
    """``--recall``'s costs: the fixed device region and the store per 1k tokens."""
    from mlx_stream.defaults import DEFAULT_RECALL_BLOCKS
    from mlx_stream.estimate import activation_bytes, config_layout, human, recall_bytes

    layout = config_layout(config, activation_bytes(folder, policy))
    plain = recall_bytes(layout, sinks, DEFAULT_RECALL_BLOCKS)
    eight = recall_bytes(layout, sinks, DEFAULT_RECALL_BLOCKS, bits=8)
    return (
        f"recall:      region {human(plain['region_bytes'])} on the device "
        f"({DEFAULT_RECALL_BLOCKS} blocks); store {human(plain['store_bytes_per_1k_tokens'])} "
        f"per 1k tokens ({human(eight['store_bytes_per_1k_tokens'])} at --recall-bits 8)"
    )


@app.command()
@handle_errors
def info(name: Name) -> None:
    """Show a model's registry entry, sources and, once pulled, its folder and config."""
    from mlx_stream import loader, registry

    spec = registry.get(name)
    lines = [
        f"name:        {spec.name}",
        f"description: {spec.description}",
        f"sinks:       {spec.sinks}",
        f"window:      {spec.window}",
        f"registry:    {spec.origin}",
        "sources:",
        *(f"  - {source}" for source in spec.sources),
    ]
    folder = loader.model_path(name)
    if loader.is_pulled(name):
        config = json.loads((folder / "config.json").read_text())
        quant = config.get("quantization")
        stored = f"{quant['bits']}-bit, group {quant['group_size']}" if quant else "float"
        from mlx_stream.estimate import describe, folder_estimate

        policy = loader.resolve_dtype("auto")
        estimate = folder_estimate(folder, policy, spec.sinks, spec.window)
        lines += [
            f"pulled:      {folder} ({_size(folder) / 1e6:.1f} MB)",
            f"model:       {config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
            f"width {config.get('hidden_size')}, vocab {config.get('vocab_size')}",
            f"stored as:   {stored}",
            f"loads as:    {policy} (auto on this backend)",
            f"memory:      {describe(estimate)} at sinks {spec.sinks} + window {spec.window}",
            _recall_line(config, folder, policy, spec.sinks),
        ]
        origin = loader.provenance(folder)
        if origin:
            lines.append(f"pulled from: {origin.get('source')} in {origin.get('seconds')} s")
    else:
        lines.append(f"pulled:      no (run: mlx-stream models pull {name})")
    typer.echo("\n".join(lines))


@app.command()
@handle_errors
def pull(
    name: Annotated[
        str | None, typer.Argument(help="Model name. Default: the registry default.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Pull again even if present.")] = False,
) -> None:
    """Download (and convert) a model into the user cache."""
    import time

    from mlx_stream import loader, registry

    spec = registry.get(name)
    if loader.is_pulled(spec.name) and not force:
        typer.echo(f"{spec.name} is already pulled: {loader.model_path(spec.name)}")
        return
    start = time.perf_counter()
    with _progress(stderr_console()) as (progress, log):
        folder = loader.pull(spec.name, force=force, progress=progress, log=log)
    typer.echo(f"pulled {spec.name} in {time.perf_counter() - start:.1f} s: {folder}")


@app.command("import")
@handle_errors
def import_gguf(
    file: Annotated[Path, typer.Argument(help="A llama-architecture .gguf file.")],
    name: Annotated[str, typer.Option("--name", help="The registry name to give it.")],
    description: Annotated[str | None, typer.Option(help="One line for `models list`.")] = None,
) -> None:
    """Convert a GGUF file into the user cache and register it in the user models.yaml."""
    from mlx_stream import gguf, registry
    from mlx_stream.errors import UserError

    if name in registry.load_registry().models:
        raise UserError(f"'{name}' is already a model (choose another --name or `models rm` it)")
    if not file.is_file():
        raise UserError(f"{file}: no such file")
    entry = {
        "description": description or f"imported from {file.name}",
        "sources": [{"path": str(file.resolve())}],
    }
    registry.parse_entry(
        name, entry, registry.user_registry_path()
    )  # bad names fail before converting
    with _progress(stderr_console()) as (progress, _):
        folder = gguf.convert(file, registry.models_dir() / name, progress=progress)
    path = registry.add_user_entry(name, entry)
    typer.echo(f"imported {name}: {folder} (registered in {path})")


@app.command("rm")
@handle_errors
def remove(name: Name) -> None:
    """Delete a pulled model from the user cache (and an imported model's entry)."""
    from mlx_stream import loader, registry
    from mlx_stream.errors import UserError

    spec = registry.get(name)
    was_default = registry.load_registry().default == name
    removed = loader.remove(name)
    packaged = registry.load_registry(use_user=False).models
    forgotten = name not in packaged and registry.remove_user_entry(name)
    if not removed and not forgotten:
        raise UserError(f"'{spec.name}' is not pulled")
    note = ""
    if forgotten:
        note = f" and its registry entry in {registry.user_registry_path()}"
        if was_default:
            note += f"; the default is now {registry.load_registry().default or 'unset'}"
    typer.echo(f"removed {name}{note}")


@app.command("check")
@handle_errors
def check(
    model: Annotated[str, typer.Argument(help="A model name from `models list`, or a folder.")],
) -> None:
    """Run the position self-check on a model and print the verdict per layer type.

    Exit 0 when the sink cache serves the model exactly, 2 (one line) when it refuses.
    """
    from mlx_lm.models import cache as mlx_cache

    from cli.common import load_model
    from mlx_stream.cache import make_sink_cache
    from mlx_stream.positions import check_model, model_type

    net, _, spec = load_model(model)
    caches = mlx_cache.make_prompt_cache(net)
    verdict = check_model(net, caches)
    kinds: dict[str, list[int]] = {}
    for i, c in enumerate(caches):
        move = verdict.moves.get(i)
        if type(c) is mlx_cache.KVCache:
            what = "SinkCache: " + (move.describe() if move is not None else "no rope move fits")
        else:
            what = f"kept as {type(c).__name__}"
        kinds.setdefault(what, []).append(i)
    typer.echo(f"model:  {model_type(net)}, {len(caches)} cache layers")
    for what, layers in kinds.items():
        span = f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"
        typer.echo(f"layers {span} ({len(layers)}): {what}")
    typer.echo(f"mask:   {'additive' if verdict.additive_mask else 'boolean'}")
    kwargs = {"sinks": spec.sinks, "window": spec.window} if spec is not None else {}
    make_sink_cache(net, **kwargs)  # refuses (exit 2, one line) what it cannot serve
    typer.echo("verdict: exact (positions within the cache)")
