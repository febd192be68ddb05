"""``mlx-stream models``: list, inspect, pull, import and remove registry models, and
models named by their Hugging Face id (``org/name``): the shared Hugging Face cache's,
LM Studio's, and any repo on the Hub.

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

from . import options as opt
from .common import handle_errors, stderr_console
from .groups import Only, grouped

app = typer.Typer(
    help=(
        "The model registry (models.yaml): list, info, pull, import, rm.\n\n"
        "Examples:\n\n"
        "  mlx-stream models\n\n"
        "  mlx-stream models pull\n\n"
        "  mlx-stream models list --available\n\n"
        "  mlx-stream models pull mlx-community/Qwen3-4B-4bit\n\n"
        "  mlx-stream models import ./my-model.Q4_0.gguf --name my-model"
    ),
    invoke_without_command=True,
    no_args_is_help=False,
)

Name = Annotated[
    str,
    typer.Argument(help="A model name from `mlx-stream models list`, or a Hugging Face id."),
]


@contextlib.contextmanager
def _progress(console) -> Iterator[tuple[Any, Any]]:
    """``(progress, log)`` callbacks drawing one rich bar per stage on stderr
    (``cli.common.pull_bars``: bytes as bytes, steps as steps, finished steps ``done``);
    on failure only the one-line error stays."""
    from .common import pull_bars

    bars, progress = pull_bars(console)

    def log(message: str) -> None:
        bars.console.print(message, markup=False, highlight=False, soft_wrap=True)

    with bars:
        yield progress, log


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _where(path: Path, home: Path) -> str:
    from mlx_stream.models import hub

    if path.is_relative_to(hub.hf_cache_dir()):
        return hub.HF_CACHE
    if path.is_relative_to(hub.lmstudio_models_dir()):
        return hub.LMSTUDIO
    return "mlx-stream" if path.is_relative_to(home) else "path"


def _rows() -> list[dict[str, Any]]:
    """The registry's models, then the MLX models on disk that no entry names."""
    from mlx_stream.models import hub, loader, registry

    reg = registry.load_registry()
    home = registry.home_dir()
    rows, named = [], set()
    for name, spec in reg.models.items():
        pulled = loader.is_pulled(name)
        path = loader.model_path(name) if pulled else None
        named |= {repo.lower() for repo in spec.hf_repos}
        rows.append(
            {
                "name": name,
                "default": name == reg.default,
                "pulled": pulled,
                "where": _where(path, home) if path else None,
                "path": str(path) if path else None,
                "size_bytes": _size(path) if path else None,
                "description": spec.description,
                "sinks": spec.sinks,
                "window": spec.window,
                "sources": [str(s) for s in spec.sources],
            }
        )
    for model in hub.local_models():
        if model.id.lower() in named:
            continue  # a registry entry's source: shown as that entry, pulled
        spec = hub.spec_for(model.id, reg)
        rows.append(
            {
                "name": model.id,
                "default": False,
                "pulled": True,
                "where": model.where,
                "path": str(model.path),
                "size_bytes": model.size,
                "description": f"{model.model_type}, {model.quantization}",
                "sinks": spec.sinks,
                "window": spec.window,
                "sources": [f"{model.where}: {model.path}"],
            }
        )
    return rows


def _config_summary(spec, policy: str) -> dict:
    """What a catalogue entry needs under ``policy`` (weights + KV cache at its
    window), from its config's shapes: nothing downloaded."""
    from mlx_stream.cache.estimate import DTYPE_BYTES
    from mlx_stream.models import hub

    weights = hub.config_weights(spec.config, policy)
    dtype_bytes = 2 if policy == "quantized" else DTYPE_BYTES[policy]  # bfloat16 scales
    return hub.fit_summary(spec.config, weights, dtype_bytes, spec.sinks, spec.window)


def _available() -> list[dict[str, Any]]:
    """The registry's models that can be pulled from Hugging Face, with what each
    needs under this backend's dtype policy (weights + KV cache at its window)."""
    from mlx_stream.cache import estimate
    from mlx_stream.models import loader, registry

    reg = registry.load_registry()
    policy = loader.resolve_dtype("auto")
    rows = []
    for name, spec in reg.models.items():
        if not spec.hf_repos:
            continue
        pulled = loader.is_pulled(name)
        summary = disk = None
        if pulled:
            folder = loader.model_path(name)
            summary = estimate.folder_estimate(folder, policy, spec.sinks, spec.window)
            disk = _size(folder)
        elif spec.config is not None:
            summary = _config_summary(spec, policy)
        fits = None
        if summary is not None and summary["available_bytes"] is not None:
            fits = summary["total_bytes"] <= summary["available_bytes"]
        rows.append(
            {
                "name": name,
                "hf": spec.hf_repos[0],
                "pulled": pulled,
                "size_bytes": spec.size,
                "disk_bytes": disk,
                "context": spec.context,
                "sinks": spec.sinks,
                "window": spec.window,
                "dtype": policy,
                "needs_bytes": summary["total_bytes"] if summary else None,
                "available_bytes": summary["available_bytes"] if summary else None,
                "fits": fits,
                "description": spec.description,
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
    available: Annotated[
        bool,
        typer.Option(
            "--available",
            help="The catalogue: what can be pulled, its size and context, and whether it "
            "fits this machine (weights + KV cache at its window).",
        ),
    ] = False,
) -> None:
    """List the registry's models and whether each is pulled, then the MLX models
    already in the Hugging Face cache and LM Studio's folder (load them by id)."""
    rows = _available() if available else _rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    from mlx_stream.cache.estimate import human

    from .common import print_table

    table = Table(box=None, pad_edge=False)
    if available:
        columns = (
            "name",
            "hugging face id",
            "size",
            "context",
            "window",
            "needs",
            "fits",
            "pulled",
        )
        for column in columns:
            right = column in ("size", "context", "needs")
            table.add_column(column, justify="right" if right else "left",
                             overflow="left" if right else "fold")  # fmt: skip
        for row in rows:
            fits = {True: "yes", False: "no", None: "?"}[row["fits"]]
            size = row["disk_bytes"] or row["size_bytes"]  # pulled: on disk; else the download
            table.add_row(
                row["name"], row["hf"], human(size) if size else "?",
                f"{row['context']:,}" if row["context"] else "?",
                f"{row['sinks']} + {row['window']:,}",
                human(row["needs_bytes"]) if row["needs_bytes"] else "?", fits,
                "yes" if row["pulled"] else "no",
            )  # fmt: skip
        print_table(table)
        policy = rows[0]["dtype"] if rows else "auto"
        avail = next((r["available_bytes"] for r in rows if r["available_bytes"]), None)
        Console(stderr=True).print(
            f"size: on disk once pulled, else the download; needs: weights as this "
            f"backend loads them ({policy}) + the KV cache reserved at the window; "
            f"{human(avail) if avail else 'unknown'} available",
            style="dim", highlight=False, soft_wrap=True,
        )  # fmt: skip
        return
    for column in ("name", "pulled", "size", "description"):
        right = column == "size"
        table.add_column(column, justify="right" if right else "left",
                         overflow="left" if right else "fold")  # fmt: skip
    for row in rows:
        name = row["name"] + (" (default)" if row["default"] else "")
        where = row["where"] if row["where"] not in (None, "mlx-stream", "path") else "yes"
        size = human(row["size_bytes"]) if row["size_bytes"] else ""
        table.add_row(name, where if row["pulled"] else "no", size, row["description"])
    print_table(table)


def _recall_line(config: dict, folder, policy: str, sinks: int, recall: dict | None = None) -> str:
    """``--recall``'s costs: the device region it reserves, and what its store uses per
    1k evicted tokens (RAM, then disk) and reserves at a time, at the registry entry's
    recall defaults (``recall``) where it has them."""
    from mlx_stream.cache.estimate import activation_bytes, config_layout, human, recall_bytes
    from mlx_stream.defaults import DEFAULT_RECALL_BLOCKS

    recall = recall or {}
    blocks, bits = recall.get("blocks") or DEFAULT_RECALL_BLOCKS, recall.get("bits")
    layout = config_layout(config, activation_bytes(folder, policy))
    mine = recall_bytes(layout, sinks, blocks, bits=bits)
    other = recall_bytes(layout, sinks, blocks, bits=None if bits else 8)
    return (
        f"recall:      region {human(mine['region_bytes'])} reserved (device, {blocks} "
        f"blocks); store uses {human(mine['store_bytes_per_1k_tokens'])} per 1k evicted "
        f"tokens (RAM, then disk), reserved {human(mine['store_segment_bytes'])} at a time"
        + (f", at --recall-bits {bits}" if bits else "")
        + f" ({human(other['store_bytes_per_1k_tokens'])} per 1k "
        + ("in the model's dtype)" if bits else "at --recall-bits 8)")
    )


def _recall_defaults(recall: dict) -> str:
    """An entry's recall defaults as the flags they stand for."""
    flags = {"blocks": "--recall-blocks", "bits": "--recall-bits", "ram_mb": "--recall-ram"}
    return ", ".join(f"{f} {recall[k]}" for k, f in flags.items() if recall.get(k) is not None)


def _is_repo(name: str | None, reg) -> bool:
    from mlx_stream.models import hub

    return name is not None and name not in reg.models and hub.is_repo_id(name)


def _folder_lines(folder: Path, sinks: int, window: int, recall: dict | None = None) -> list[str]:
    """What a model folder on disk is and what it will take to run (``recall``: the
    entry's recall defaults)."""
    from mlx_stream.cache.estimate import describe, folder_estimate
    from mlx_stream.models import loader

    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization")
    stored = f"{quant['bits']}-bit, group {quant['group_size']}" if quant else "float"
    policy = loader.resolve_dtype("auto")
    estimate = folder_estimate(folder, policy, sinks, window)
    return [
        f"model:       {config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
        f"width {config.get('hidden_size')}, vocab {config.get('vocab_size')}",
        f"stored as:   {stored}",
        f"loads as:    {policy} (auto on this backend)",
        f"memory:      {describe(estimate)} at sinks {sinks} + window {window}",
        _recall_line(config, folder, policy, sinks, recall),
    ]


def _catalogue_lines(spec) -> list[str]:
    from mlx_stream.cache.estimate import human

    lines = []
    if spec.context:
        lines.append(f"context:     {spec.context:,} tokens (trained)")
    if spec.size:
        lines.append(f"size:        {human(spec.size)} download")
    return lines


def _info_repo(repo_id: str, reg) -> list[str]:
    """``models info org/name``: on disk, else what the Hub says (sizes, fit)."""
    from mlx_stream.cache.estimate import describe, human
    from mlx_stream.models import hub, loader

    spec = hub.spec_for(repo_id, reg)
    entry = hub.catalogue_entry(repo_id, reg)
    lines = [f"id:          {repo_id}"]
    if entry is not None:
        lines += [f"catalogue:   {entry.name}: {entry.description}", *_catalogue_lines(entry)]
    lines += [f"sinks:       {spec.sinks}", f"window:      {spec.window}"]
    found = hub.find_local(repo_id)
    if found is not None:
        folder, where = found
        lines.append(f"on disk:     {where}: {folder} ({_size(folder) / 1e6:.1f} MB)")
        return lines + _folder_lines(folder, spec.sinks, spec.window, spec.recall)
    if hub.offline():
        return lines + [f"on disk:     no (HF_HUB_OFFLINE is set; online: mlx-stream models pull {repo_id})"]  # fmt: skip
    policy = loader.resolve_dtype("auto")
    with hub.hub_errors(repo_id):
        repo = hub.remote_repo(repo_id)
        config = hub.remote_config(repo)
        weights, dtype_bytes = hub.weights_estimate(repo, config, policy)
    summary = hub.fit_summary(config, weights, dtype_bytes, spec.sinks, spec.window)
    return lines + [
        f"on disk:     no (run: mlx-stream models pull {repo_id})",
        f"download:    {human(repo.download_bytes)} in {len(repo.files)} files (commit {str(repo.sha)[:12]})",
        f"model:       {config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
        f"width {config.get('hidden_size')}, vocab {config.get('vocab_size')}",
        f"loads as:    {policy} (auto on this backend)",
        f"memory:      {describe(summary)} at sinks {spec.sinks} + window {spec.window}",
    ]  # fmt: skip


@app.command()
@handle_errors
def info(
    name: Annotated[
        str | None,
        typer.Argument(
            help="A model name from `mlx-stream models list`, or a Hugging Face id. "
            "Default: the registry default.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Show a model's registry entry, sources and, once pulled, its folder and config;
    for a Hugging Face id, where it is on disk or what the Hub says it needs."""
    from mlx_stream.errors import UserError
    from mlx_stream.models import loader, registry

    reg = registry.load_registry()
    if name is None:
        if not reg.default:
            raise UserError("no default model: name one (see: mlx-stream models list)")
        name = reg.default
    if _is_repo(name, reg):
        typer.echo("\n".join(_info_repo(name, reg)))
        return
    spec = registry.get(name)
    lines = [
        f"name:        {spec.name}",
        f"description: {spec.description}",
        *_catalogue_lines(spec),
        f"sinks:       {spec.sinks}",
        f"window:      {spec.window}",
        *(
            [f"recall:      defaults {_recall_defaults(spec.recall)} (flags override)"]
            if spec.recall
            else []
        ),  # fmt: skip
        f"registry:    {spec.origin}",
        "sources:",
        *(f"  - {source}" for source in spec.sources),
    ]
    folder = loader.model_path(name)
    if loader.is_pulled(name):
        lines.append(f"pulled:      {folder} ({_size(folder) / 1e6:.1f} MB)")
        lines += _folder_lines(folder, spec.sinks, spec.window, spec.recall)
        origin = loader.provenance(folder)
        if origin:
            lines.append(f"pulled from: {origin.get('source')} in {origin.get('seconds')} s")
    else:
        lines.append(f"pulled:      no (run: mlx-stream models pull {name})")
        if spec.config is not None:  # the catalogue's shape: what it will take, offline
            from mlx_stream.cache.estimate import describe

            policy = loader.resolve_dtype("auto")
            summary = _config_summary(spec, policy)
            lines.append(f"memory:      {describe(summary)} at sinks {spec.sinks} + window "
                         f"{spec.window}, loaded as {policy}")  # fmt: skip
    typer.echo("\n".join(lines))


@app.command()
@handle_errors
@grouped
def pull(
    name: Annotated[
        str | None,
        typer.Argument(help="Model name or Hugging Face id. Default: the registry default."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Pull again even if present.")] = False,
    *,
    model: Annotated[opt.ModelOptions, Only("dtype")],
    sizes: Annotated[opt.CacheOptions, Only("sinks", "window")],
) -> None:
    """Download (and convert) a model: a registry model into the user cache, its
    Hugging Face source or a Hugging Face id into the shared Hugging Face cache (only
    the files mlx-lm reads, after checking it fits this machine at --window, loaded
    as --dtype)."""
    import time

    from mlx_stream.models import hub, loader, registry

    from .common import check_positive

    sinks, window, dtype = sizes.sinks, sizes.window, model.dtype
    check_positive(sinks, "--sinks", 0)
    check_positive(window, "--window")
    policy = loader.resolve_dtype(dtype)

    reg = registry.load_registry()
    start = time.perf_counter()
    if _is_repo(name, reg):
        found = hub.find_local(name)
        if found is not None and not force:
            typer.echo(f"{name} is already on disk ({found[1]}): {found[0]}")
            return
        spec = hub.spec_for(name, reg)
        with _progress(stderr_console()) as (progress, log):
            folder = hub.pull(name, policy, spec.sinks if sinks is None else sinks,
                              spec.window if window is None else window, progress, log,
                              spec.config)  # fmt: skip
        typer.echo(f"pulled {name} in {time.perf_counter() - start:.1f} s: {folder}")
        return
    spec = registry.get(name)
    if loader.is_pulled(spec.name) and not force:
        typer.echo(f"{spec.name} is already pulled: {loader.model_path(spec.name)}")
        return
    with _progress(stderr_console()) as (progress, log):
        folder = loader.pull(spec.name, force=force, progress=progress, log=log, dtype=dtype,
                             sinks=sinks, window=window)  # fmt: skip
    typer.echo(f"pulled {spec.name} in {time.perf_counter() - start:.1f} s: {folder}")


@app.command("import")
@handle_errors
def import_gguf(
    file: Annotated[Path, typer.Argument(help="A llama-architecture .gguf file.")],
    name: Annotated[str, typer.Option("--name", help="The registry name to give it.")],
    description: Annotated[str | None, typer.Option(help="One line for `models list`.")] = None,
) -> None:
    """Convert a GGUF file into the user cache and register it in the user models.yaml."""
    from mlx_stream.errors import UserError
    from mlx_stream.models import gguf, registry

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
    """Delete a pulled model from the user cache (and an imported model's entry); a
    Hugging Face id, or a registry model pulled from Hugging Face, from the shared
    Hugging Face cache."""
    from mlx_stream.errors import UserError
    from mlx_stream.models import hub, loader, registry

    if _is_repo(name, registry.load_registry()):
        found = hub.find_local(name)
        if found is not None and found[1] == hub.LMSTUDIO:
            raise UserError(f"{name} is LM Studio's copy ({found[0]}): remove it in LM Studio")
        if not hub.remove_cached(name):
            raise UserError(f"'{name}' is not in the Hugging Face cache ({hub.hf_cache_dir()})")
        typer.echo(f"removed {name} from the Hugging Face cache")
        return
    spec = registry.get(name)
    was_default = registry.load_registry().default == name
    removed = loader.remove(name)
    if not removed:  # its Hugging Face source, in the shared cache
        removed = any(hub.remove_cached(repo) for repo in spec.hf_repos)
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

    from mlx_stream.cache.positions import check_model, model_type
    from mlx_stream.cache.sink import make_sink_cache

    from .common import load_model

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
