"""Hugging Face ids, and the MLX models already on disk (no mlx import at module level).

A model named ``org/name`` that is no registry name and no existing path is a Hugging
Face repo id. It resolves, in order, to:

1. its snapshot in the shared Hugging Face cache (``$HF_HUB_CACHE``, else
   ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``): the copy mlx-lm uses too,
   checked before loading against huggingface_hub's record of the commit's files;
2. LM Studio's copy, ``<LM Studio models folder>/org/name`` (see
   :func:`lmstudio_models_dir`);
3. a download (:func:`pull`): the repo's file list and sizes (``HfApi.model_info``),
   its ``config.json`` and safetensors headers first, so the fit check (weights under
   the dtype policy + the KV cache at the chosen window, against the memory
   available) refuses a model that cannot run before gigabytes are fetched; then
   ``snapshot_download`` of only the files mlx-lm reads
   (``mlx_lm.utils.DEFAULT_ALLOW_PATTERNS``) into the shared cache. huggingface_hub
   writes each file as ``blobs/<hash>.incomplete`` and renames it when whole, and a
   snapshot missing a shard is never taken as loadable (:func:`folder_problem`).

A gated or missing repo, no network (or ``HF_HUB_OFFLINE=1`` with nothing cached), a
repo that is not an MLX model: one :class:`UserError` line each (exit 2).

``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and the cache variables are read from the
environment at each call (huggingface_hub reads them once, at import).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlx_stream.cache import estimate
from mlx_stream.defaults import DEFAULT_SLACK
from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.models.registry import ModelSpec, ProgressCallback, Registry, Source, notify

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


def _read_config(folder: Path) -> dict | None:
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
    config = _read_config(folder)
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
    config = _read_config(folder) or {}
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


# --------------------------------------------------------------------- the Hub


@dataclass(frozen=True)
class RemoteRepo:
    """What the Hub says about a repo before anything is downloaded.

    Attributes:
        id: The repo id.
        sha: The commit the files are taken from.
        files: ``{file: bytes}`` of the files mlx-lm reads.
    """

    id: str
    sha: str | None
    files: dict[str, int]

    @property
    def download_bytes(self) -> int:
        return sum(self.files.values())


@contextlib.contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into one line each (exit 2; a Hub-side
    failure such as a 500 is a :class:`RuntimeFailure`, exit 1)."""
    from huggingface_hub import errors

    try:
        yield
    except errors.GatedRepoError:
        raise UserError(
            f"{repo_id} is gated: accept its conditions on https://huggingface.co/{repo_id} "
            "and log in (hf auth login), then try again"
        ) from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError):
        raise UserError(
            f"{repo_id}: no such model on Hugging Face (or a private one: log in with "
            "hf auth login)"
        ) from None
    except errors.DisabledRepoError:
        raise UserError(f"{repo_id} is disabled on Hugging Face") from None
    except (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError):
        raise _offline_error(repo_id) from None
    except errors.HFValidationError:
        raise UserError(f"'{repo_id}' is not a valid Hugging Face repo id") from None
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise RuntimeFailure(f"Hugging Face answered {status or 'an error'} for {repo_id}: "
                             f"{first[:160]}") from None  # fmt: skip
    except OSError as e:  # no route, DNS, refused: connection errors are OSErrors here
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
            raise
        raise _offline_error(repo_id, f"{type(e).__name__}") from None
    except Exception as e:  # noqa: BLE001 - the HTTP client's own connect/timeout errors
        if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3"):
            raise _offline_error(repo_id, type(e).__name__) from None
        raise


def _offline_error(repo_id: str, why: str | None = None) -> UserError:
    reason = (
        "HF_HUB_OFFLINE is set" if offline() else f"the Hub cannot be reached ({why or 'offline'})"
    )
    return UserError(
        f"{repo_id} is not on this machine (Hugging Face cache {hf_cache_dir()}, LM Studio "
        f"{lmstudio_models_dir()}) and {reason}"
    )


def endpoint() -> str | None:
    """``$HF_ENDPOINT`` (a mirror), read now; ``None``: huggingface_hub's default."""
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint())


def remote_repo(repo_id: str) -> RemoteRepo:
    """The repo's commit and the sizes of the files mlx-lm reads
    (``HfApi.model_info(files_metadata=True)``); not an MLX model: one line."""
    from huggingface_hub.utils import filter_repo_objects

    info = _api().model_info(repo_id, files_metadata=True)
    sizes = {s.rfilename: int(s.size or 0) for s in (info.siblings or [])}
    wanted = set(filter_repo_objects(list(sizes), allow_patterns=allow_patterns()))
    files = {name: size for name, size in sizes.items() if name in wanted}
    weights = [f for f in files if any(fnmatch.fnmatch(f, p) for p in WEIGHT_FILES)]
    if "config.json" not in files or not weights:
        ggufs = any(name.endswith(".gguf") for name in sizes)
        hint = " (a GGUF repo: download the .gguf and use `mlx-stream models import`)" if ggufs else ""  # fmt: skip
        raise UserError(f"{repo_id} is not an MLX model: no config.json and model*.safetensors{hint}")  # fmt: skip
    return RemoteRepo(repo_id, getattr(info, "sha", None), files)


def remote_config(repo: RemoteRepo) -> dict:
    """The repo's ``config.json`` (downloaded into the shared cache: a few KB)."""
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(repo.id, "config.json", cache_dir=hf_cache_dir(), endpoint=endpoint())
    config = _read_config(Path(path).parent)
    if config is None:
        raise UserError(f"{repo.id} is not an MLX model: its config.json is not a JSON object")
    if not mlx_lm_supports(config.get("model_type")):
        raise UserError(
            f"{repo.id} is not a model mlx-lm can load (model type "
            f"{config.get('model_type')!r}; upgrading mlx-lm may add it)"
        )
    return config


def remote_tensors(repo: RemoteRepo) -> dict[str, tuple[str, list[int]]] | None:
    """``{tensor: (dtype, shape)}`` from the repo's safetensors headers (read with
    range requests, nothing downloaded), or ``None`` when the Hub does not give them."""
    try:
        meta = _api().get_safetensors_metadata(repo.id, revision=repo.sha)
    except Exception:  # noqa: BLE001 - optional: the file sizes stand in for it
        return None
    tensors = {}
    for file, header in meta.files_metadata.items():
        if any(fnmatch.fnmatch(file, p) for p in WEIGHT_FILES):
            tensors.update({k: (t.dtype, list(t.shape)) for k, t in header.tensors.items()})
    return tensors or None


def weights_estimate(repo: RemoteRepo, config: dict, policy: str) -> tuple[int, int]:
    """``(weights bytes under ``policy``, bytes per cached element)`` of a remote repo:
    exact from its safetensors headers; else from the weight files' sizes, as stored,
    or for a float policy scaled from a quantized model's bits per weight (its ``bits``
    plus a 16-bit scale and bias per group), an unquantized one taken as bfloat16
    (what MLX repos store)."""
    tensors = remote_tensors(repo)
    quant = config.get("quantization") or {}
    if tensors is None:
        stored = sum(size for f, size in repo.files.items()
                     if any(fnmatch.fnmatch(f, p) for p in WEIGHT_FILES))  # fmt: skip
        if policy == "quantized":
            return stored, 2
        if quant.get("bits"):
            bits = quant["bits"] + 32 / quant.get("group_size", 64)
            stored = int(stored * 8 / bits) * 2  # as bfloat16, then the policy's size
        return stored * estimate.DTYPE_BYTES[policy] // 2, estimate.DTYPE_BYTES[policy]
    weights = estimate.tensors_bytes(tensors, quant, policy)
    if policy != "quantized":
        return weights, estimate.DTYPE_BYTES[policy]
    floats = [k for k, _ in tensors.values() if k in ("F32", "F16", "BF16")]
    return weights, estimate.DTYPE_BYTES[floats[0]] if floats else 2


def fit_summary(
    config: dict, weights: int, dtype_bytes: int, sinks: int, window: int, kv: dict | None = None
) -> dict:
    """Weights + the full KV cache at ``sinks + window`` (+ slack) for ``config``
    (``estimate.summary``); ``kv``: the cache's ``kv_bits``, ``kv_group_size`` and
    ``key_bits``. The cache counts 0 when the config has no attention layout the
    estimate knows."""
    try:
        layout = estimate.config_layout(config, dtype_bytes)
        cache = estimate.cache_bytes(layout, sinks, window, DEFAULT_SLACK, **(kv or {}))
    except (KeyError, TypeError, ZeroDivisionError):
        cache = 0
    return estimate.summary(weights, cache)


def shape_config(config: dict) -> dict:
    """``config`` with what a catalogue entry leaves out filled in by shape: a
    longrope's factor lists (ones, rotary dims / 2 of them; their values do not shape
    the model)."""
    config = dict(config)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("type") == "longrope":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        half = int(head_dim * config.get("partial_rotary_factor", 1.0)) // 2
        config["rope_scaling"] = {"long_factor": [1.0] * half, "short_factor": [1.0] * half,
                                  **scaling}  # fmt: skip
    return config


def model_from_config(config: dict):
    """A model of ``config`` built by mlx-lm, lazily: its parameters have shapes and
    dtypes but no memory until evaluated (sizes without downloading anything)."""
    from mlx_lm.utils import _get_classes

    config = shape_config(config)
    # mlx-lm's own config -> classes (its remapping included; load_model uses it).
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def config_weights(config: dict, policy: str) -> int:
    """Bytes of the weights of a model of ``config`` loaded under ``policy``:
    ``"quantized"`` as mlx-lm's conversion stores a 4-bit model (its own
    ``quantize_model``: group 64, bfloat16 scales and norms, or the config's
    ``quantization``), a float dtype dequantized. Computed from the lazy model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    model = model_from_config(config)
    if policy == "quantized":
        model.set_dtype(mx.bfloat16)
        quant = config.get("quantization") or {}
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its bits per weight
            quantize_model(model, config, quant.get("group_size", 64), quant.get("bits", 4))
    else:
        model.set_dtype(getattr(mx, policy))
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


class DoesNotFit(UserError):
    """The model and its cache need more memory than is available (exit 2)."""


def check_fit(what: str, summary: dict, sinks: int, window: int, policy: str) -> None:
    """One :class:`UserError` line when ``summary`` exceeds the memory available."""
    total, available = summary["total_bytes"], summary["available_bytes"]
    if available is None or total <= available:
        return
    h = estimate.human
    why = " (the CPU backend loads weights as float32)" if policy == "float32" else ""
    raise DoesNotFit(
        f"{what} does not fit: it needs {h(total)} (weights {h(summary['weights_bytes'])}{why} "
        f"+ KV cache {h(summary['kv_cache_bytes'])} at sinks {sinks} + window {window}) but "
        f"only {h(available)} of memory is available: lower --window or choose a smaller model"
    )


def _progress_class(progress: ProgressCallback | None, stage: str):
    """A tqdm class for ``snapshot_download`` that reports the bytes written to disk
    to a :data:`ProgressCallback` (huggingface_hub draws its bars with tqdm)."""
    from tqdm.std import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            self._report = str(kwargs.get("desc") or "").startswith("Reconstructing")
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 - closed with the bar
            kwargs["disable"] = False
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            out = super().update(n)
            if self._report:
                total = int(self.total) if self.total else None
                notify(progress, int(self.n), total, stage)
            return out

        def close(self):
            file = self.fp
            super().close()
            with contextlib.suppress(Exception):
                file.close()

    return Bar


def download(repo: RemoteRepo, progress: ProgressCallback | None = None) -> Path:
    """``snapshot_download`` of the files mlx-lm reads into the shared cache, from
    ``main`` (not pinned to ``repo.sha``: only a branch download records
    ``refs/main``, which mlx-lm and the cache look-ups go by)."""
    from huggingface_hub import snapshot_download

    stage = f"download {repo.id}"
    notify(progress, 0, repo.download_bytes or None, stage)
    try:
        path = snapshot_download(
            repo.id, cache_dir=hf_cache_dir(), allow_patterns=allow_patterns(),
            tqdm_class=_progress_class(progress, stage), endpoint=endpoint(),
        )  # fmt: skip
    except Exception as e:
        if not _transport_error(e):
            raise
        # huggingface_hub keeps what arrived as blobs/*.incomplete and resumes from it.
        raise RuntimeFailure(
            f"the download of {repo.id} broke off ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:120]}); run it again to resume"
        ) from None
    notify(progress, repo.download_bytes, repo.download_bytes or None, stage)
    return Path(path)


def _transport_error(error: BaseException) -> bool:
    """A dropped connection, a timeout or no route: the HTTP client's own errors, or
    the ``OSError`` of the socket (not a file of the cache)."""
    if type(error).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3"):
        return not isinstance(error, UserError)
    return isinstance(error, (ConnectionError, TimeoutError))


def config_mismatches(expected: dict, actual: dict) -> list[str]:
    """``key: expected != actual`` for each key of a catalogue config that the real
    ``config.json`` (its ``text_config`` merged in) contradicts."""
    merged = {**actual, **(actual.get("text_config") or {})}
    out = []
    for key, want in expected.items():
        have = merged.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            bad = {k for k, v in want.items() if have.get(k) != v}
            if bad:
                out.append(f"{key}.{sorted(bad)[0]}: {want[sorted(bad)[0]]!r} != {have.get(sorted(bad)[0])!r}")  # fmt: skip
        elif (
            key != "model_type"
            and have != want
            and not (
                isinstance(want, (int, float)) and isinstance(have, (int, float)) and want == have
            )
        ):
            out.append(f"{key}: {want!r} != {have!r}")
        elif key == "model_type" and want not in (
            actual.get("model_type"),
            merged.get("model_type"),
        ):
            out.append(f"model_type: {want!r} != {actual.get('model_type')!r}")
    return out


def pull(
    repo_id: str,
    policy: str,
    sinks: int,
    window: int,
    progress: ProgressCallback | None = None,
    log=None,
    expected: dict | None = None,
    kv: dict | None = None,
    fit: bool = True,
) -> Path:
    """Download ``repo_id`` into the shared Hugging Face cache after checking that it
    is an MLX model and that it fits (weights under ``policy`` + the KV cache at
    ``sinks + window``).

    Args:
        repo_id: ``org/name``.
        policy: The resolved dtype policy the model will load under.
        sinks, window: The cache it will run with.
        progress: Optional ``progress(done, total, stage)`` callback.
        log: Optional one-line notes callback (a catalogue config the repo contradicts).
        expected: A catalogue entry's config, compared with the repo's.
        kv: The cache's quantization (``kv_bits``, ``kv_group_size``, ``key_bits``).
        fit: Check the fit (not for a model sharded over several machines).

    Returns:
        The snapshot folder.

    Raises:
        UserError: Gated, missing, offline, not an MLX model, does not fit (exit 2).
        RuntimeFailure: The Hub failed, or the download came back incomplete (exit 1).
    """
    if offline():
        raise _offline_error(repo_id)
    with hub_errors(repo_id):
        notify(progress, 0, None, f"look up {repo_id}")
        repo = remote_repo(repo_id)
        config = remote_config(repo)
        for line in config_mismatches(expected or {}, config)[:1]:
            if log is not None:
                log(f"the catalogue entry for {repo_id} differs from its config.json ({line})")
        if fit:
            weights, dtype_bytes = weights_estimate(repo, config, policy)
            check_fit(repo_id, fit_summary(config, weights, dtype_bytes, sinks, window, kv),
                      sinks, window, policy)  # fmt: skip
        folder = download(repo, progress)
    problem = folder_problem(folder)
    if problem is not None:
        raise RuntimeFailure(f"{repo_id}: the download is not loadable ({problem})")
    return folder


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
