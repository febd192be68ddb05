"""The Hub: what a repo holds before anything is downloaded, its fit checked from
that, then the download into the shared cache; its failures as one line each."""

from __future__ import annotations

import contextlib
import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mlx_stream.cache import estimate
from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.models.hub.fit import check_fit, config_mismatches, fit_summary
from mlx_stream.models.hub.local import (
    WEIGHT_FILES,
    allow_patterns,
    folder_problem,
    hf_cache_dir,
    lmstudio_models_dir,
    mlx_lm_supports,
    offline,
    read_config,
)
from mlx_stream.models.registry import ProgressCallback, notify


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
    config = read_config(Path(path).parent)
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


def progress_class(progress: ProgressCallback | None, stage: str):
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
            tqdm_class=progress_class(progress, stage), endpoint=endpoint(),
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
