"""Hugging Face repo ids, and the MLX models already on disk: the shared Hugging Face
cache and LM Studio's models folder (read from the environment at each call)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlx_stream.models.registry import ModelSpec, Registry, Source

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ENV_LMSTUDIO = "LMSTUDIO_MODELS_DIR"
HF_CACHE = "hf-cache"
LMSTUDIO = "lmstudio"
# The weight files mlx-lm loads (a sharded repo has several).
WEIGHT_FILES = ("model*.safetensors",)


def is_repo_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hugging Face repo id (``org/name``)."""
    return bool(REPO_ID.match(text)) and ".." not in text


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "on", "yes", "true")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set: no network look-up."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(
        os.environ.get("TRANSFORMERS_OFFLINE")
    )


def hf_cache_dir() -> Path:
    """The shared Hugging Face cache, by huggingface_hub's own rules, read now."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.path.expandvars(os.environ[name])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def lmstudio_home() -> Path:
    """LM Studio's home, found the way its own SDK (lmstudio-js ``findLMStudioHome``)
    finds it: the path in ``~/.lmstudio-home-pointer``, else ``~/.cache/lm-studio`` if
    it exists (older versions), else ``~/.lmstudio``."""
    home = Path(os.path.expanduser("~"))
    pointer = home / ".lmstudio-home-pointer"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = pointer.read_text(encoding="utf-8").strip()
        if text:
            return Path(text).expanduser()
    legacy = home / ".cache" / "lm-studio"
    return legacy if legacy.is_dir() else home / ".lmstudio"


def _lmstudio_settings(home: Path) -> list[Path]:
    """Where LM Studio's ``settings.json`` may be: its home, else the app's own
    settings folder (macOS, Linux, Windows), as versions have kept it in either."""
    user = Path(os.path.expanduser("~"))
    places = [home / "settings.json",
              user / "Library" / "Application Support" / "LM Studio" / "settings.json",
              user / ".config" / "LM Studio" / "settings.json"]  # fmt: skip
    if os.environ.get("APPDATA"):
        places.append(Path(os.environ["APPDATA"]) / "LM Studio" / "settings.json")
    return places


def lmstudio_models_dir() -> Path:
    """LM Studio's models folder: ``$LMSTUDIO_MODELS_DIR`` (mlx-stream's override;
    LM Studio has no such variable), else the ``downloadsFolder`` of LM Studio's
    ``settings.json`` (its "Models Directory" setting), else ``<home>/models``."""
    if os.environ.get(ENV_LMSTUDIO):
        return Path(os.environ[ENV_LMSTUDIO]).expanduser()
    home = lmstudio_home()
    for settings in _lmstudio_settings(home):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            folder = json.loads(settings.read_text(encoding="utf-8")).get("downloadsFolder")
            if isinstance(folder, str) and folder.strip():
                return Path(folder).expanduser()
    return home / "models"


def allow_patterns() -> list[str]:
    """The files mlx-lm reads from a repo (its own download patterns)."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS)


def mlx_lm_supports(model_type: str | None) -> bool:
    """Whether the installed mlx-lm has a model for ``model_type`` (its remapping
    applied), found without importing mlx-lm."""
    if not model_type:
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    roots = [Path(root) / "models" for root in spec.submodule_search_locations]
    if any((root / f"{model_type}.py").is_file() for root in roots):
        return True
    from mlx_lm.utils import MODEL_REMAPPING  # only for a remapped type (mistral -> llama)

    name = MODEL_REMAPPING.get(model_type)
    return name is not None and any((root / f"{name}.py").is_file() for root in roots)


def read_config(folder: Path) -> dict | None:
    """``folder``'s ``config.json`` as a dict, or ``None`` where it is missing or not one."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None


def folder_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` is not an MLX model mlx-lm can load, or ``None`` when it is: a
    ``config.json`` with a model type mlx-lm has, and every weight shard present (all
    files the ``model.safetensors.index.json`` names)."""
    folder = Path(folder)
    config = read_config(folder)
    if config is None:
        return "no config.json"
    if not mlx_lm_supports(config.get("model_type")):
        return f"model type {config.get('model_type')!r} is not one mlx-lm has"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return "unreadable model.safetensors.index.json"
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            return f"incomplete: {len(missing)} weight file(s) missing ({missing[0]})"
    elif not any(folder.glob("model*.safetensors")):
        return "no model*.safetensors weights"
    return None


# ------------------------------------------------------------------ models on disk


@dataclass(frozen=True)
class LocalModel:
    """An MLX model found on disk outside mlx-stream's registry.

    Attributes:
        id: The repo id it loads by (``org/name``).
        where: ``"hf-cache"`` or ``"lmstudio"``.
        path: The folder mlx-lm loads.
        size: Bytes on disk (the files the folder's links point at).
        model_type: Its config's ``model_type``.
        quantization: E.g. ``"4-bit"``, or ``"float"``.
    """

    id: str
    where: str
    path: Path
    size: int
    model_type: str
    quantization: str


def _folder_size(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if f.is_file():
                total += f.stat().st_size  # follows the cache's links to its blobs
    return total


def _describe_quant(config: dict) -> str:
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return f"{bits}-bit" if bits else "float"


def _local(repo_id: str, where: str, folder: Path) -> LocalModel | None:
    if folder_problem(folder) is not None:
        return None
    config = read_config(folder) or {}
    return LocalModel(repo_id, where, folder, _folder_size(folder),
                      str(config.get("model_type")), _describe_quant(config))  # fmt: skip


def cached_snapshot(repo_id: str) -> Path | None:
    """The loadable snapshot of ``repo_id`` (revision ``main``) in the shared Hugging
    Face cache, or ``None``; located with huggingface_hub's own cache lookup."""
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(repo_id, "config.json", cache_dir=hf_cache_dir())
    except (ValueError, OSError):  # not a valid id for the Hub
        return None
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    return folder if folder_problem(folder) is None else None


def verified_snapshot(repo_id: str) -> Path | None:
    """:func:`cached_snapshot`, also checked against huggingface_hub's own record of
    the commit's files (its tree cache): a snapshot an interrupted download left
    without, say, its tokenizer is not loadable. Imports mlx-lm (its file patterns)."""
    from huggingface_hub import errors, snapshot_download

    try:
        path = snapshot_download(repo_id, cache_dir=hf_cache_dir(), local_files_only=True,
                                 allow_patterns=allow_patterns())  # fmt: skip
    except (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError,
            errors.HFValidationError, OSError, ValueError):  # fmt: skip
        return None
    return Path(path) if folder_problem(path) is None else None


def scan_hf_cache() -> list[LocalModel]:
    """The loadable MLX models in the shared Hugging Face cache (``main`` revisions,
    else the newest snapshot), found with ``huggingface_hub.scan_cache_dir``."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hf_cache_dir())
    except (CacheNotFound, OSError, ValueError):
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revisions = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        model = _local(repo.repo_id, HF_CACHE, Path(revisions[-1].snapshot_path))
        if model is not None:
            found.append(model)
    return found


def scan_lmstudio() -> list[LocalModel]:
    """The loadable MLX models in LM Studio's folder (``<org>/<name>/`` with a
    ``config.json`` and safetensors; its GGUF models are not MLX and are skipped)."""
    root = lmstudio_models_dir()
    found = []
    with contextlib.suppress(OSError):
        for org in sorted(p for p in root.iterdir() if p.is_dir()):
            for folder in sorted(p for p in org.iterdir() if p.is_dir()):
                model = _local(f"{org.name}/{folder.name}", LMSTUDIO, folder)
                if model is not None:
                    found.append(model)
    return found


def local_models() -> list[LocalModel]:
    """Every MLX model on disk: the Hugging Face cache's, then LM Studio's."""
    return scan_hf_cache() + scan_lmstudio()


def find_local(repo_id: str, verify: bool = False) -> tuple[Path, str] | None:
    """``(folder, where)`` of ``repo_id`` already on disk: the Hugging Face cache
    first, then LM Studio's folder; ``None`` when neither has a loadable copy.
    ``verify``: check the cached snapshot against huggingface_hub's file list too
    (:func:`verified_snapshot`; before loading, not for listing)."""
    cached = verified_snapshot(repo_id) if verify else cached_snapshot(repo_id)
    if cached is not None:
        return cached, HF_CACHE
    folder = lmstudio_models_dir() / repo_id
    if folder_problem(folder) is None:
        return folder, LMSTUDIO
    return None


def remove_cached(repo_id: str) -> bool:
    """Delete ``repo_id`` (every revision) from the shared Hugging Face cache; ``True``
    if it was there. The repo's folder is moved aside first, so it disappears at once.

    By hand, not ``HFCacheInfo.delete_revisions``: that one is keyed by commit hashes
    alone and would take another repo's snapshot of the same commit.
    """
    import shutil
    import tempfile

    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from mlx_stream import files

    try:
        info = scan_cache_dir(hf_cache_dir())
    except (CacheNotFound, OSError, ValueError):
        return False
    folders = [Path(repo.repo_path) for repo in info.repos
               if repo.repo_type == "model" and repo.repo_id.lower() == repo_id.lower()]  # fmt: skip
    for folder in folders:
        trash = Path(tempfile.mkdtemp(prefix=files.temp_prefix(folder, "rm"), dir=folder.parent))
        os.replace(folder, trash / "x")
        shutil.rmtree(trash, ignore_errors=True)
    return bool(folders)


def describe_local(model: LocalModel) -> str:
    """One line for ``models list``: ``hf-cache · qwen3 4-bit``."""
    return f"{model.where} · {model.model_type} {model.quantization} · {model.path}"


def as_dict(model: LocalModel) -> dict[str, Any]:
    """A :class:`LocalModel` for ``--json``."""
    return {"id": model.id, "where": model.where, "path": str(model.path), "size_bytes": model.size,
            "model_type": model.model_type, "quantization": model.quantization}  # fmt: skip


# ------------------------------------------------------------ registry entries


def catalogue_entry(repo_id: str, registry: Registry) -> ModelSpec | None:
    """The registry entry whose Hugging Face source is ``repo_id`` (case ignored)."""
    for spec in registry.models.values():
        if any(r.lower() == repo_id.lower() for r in spec.hf_repos):
            return spec
    return None


def spec_for(repo_id: str, registry: Registry) -> ModelSpec:
    """A spec for a model named by its repo id: the catalogue entry's window, sinks
    and config when one has this repo as its source, else the defaults. Its name is
    the id (what ``serve`` serves it as)."""
    entry = catalogue_entry(repo_id, registry)
    source = (Source("hf", repo_id),)
    if entry is None:
        return ModelSpec(name=repo_id, description=f"Hugging Face: {repo_id}", sources=source)
    return replace(entry, name=repo_id, sources=source)


def aliases(spec: ModelSpec, registry: Registry) -> set[str]:
    """Every name a served model answers to: its name, its repo ids and the registry
    entries that have one of them as a source."""
    names = {spec.name, *spec.hf_repos}
    for repo in list(names):
        entry = catalogue_entry(repo, registry)
        if entry is not None:
            names |= {entry.name, *entry.hf_repos}
    return names
