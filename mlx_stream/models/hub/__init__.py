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

The parts: :mod:`~mlx_stream.models.hub.local` (ids, the copies on disk, registry
entries for an id), :mod:`~mlx_stream.models.hub.fit` (sizes and the fit check) and
:mod:`~mlx_stream.models.hub.remote` (the Hub and the download); every public name is
importable from here.
"""

from __future__ import annotations

from mlx_stream.models.hub.fit import (
    DoesNotFit,
    check_fit,
    config_mismatches,
    config_weights,
    fit_summary,
    model_from_config,
    shape_config,
)
from mlx_stream.models.hub.local import (
    ENV_LMSTUDIO,
    HF_CACHE,
    LMSTUDIO,
    REPO_ID,
    WEIGHT_FILES,
    LocalModel,
    aliases,
    allow_patterns,
    as_dict,
    cached_snapshot,
    catalogue_entry,
    describe_local,
    find_local,
    folder_problem,
    hf_cache_dir,
    is_repo_id,
    lmstudio_home,
    lmstudio_models_dir,
    local_models,
    mlx_lm_supports,
    offline,
    remove_cached,
    scan_hf_cache,
    scan_lmstudio,
    spec_for,
    verified_snapshot,
)
from mlx_stream.models.hub.remote import (
    RemoteRepo,
    download,
    endpoint,
    hub_errors,
    pull,
    remote_config,
    remote_repo,
    remote_tensors,
    weights_estimate,
)

__all__ = [
    "DoesNotFit",
    "ENV_LMSTUDIO",
    "HF_CACHE",
    "LMSTUDIO",
    "LocalModel",
    "REPO_ID",
    "RemoteRepo",
    "WEIGHT_FILES",
    "aliases",
    "allow_patterns",
    "as_dict",
    "cached_snapshot",
    "catalogue_entry",
    "check_fit",
    "config_mismatches",
    "config_weights",
    "describe_local",
    "download",
    "endpoint",
    "find_local",
    "fit_summary",
    "folder_problem",
    "hf_cache_dir",
    "hub_errors",
    "is_repo_id",
    "lmstudio_home",
    "lmstudio_models_dir",
    "local_models",
    "mlx_lm_supports",
    "model_from_config",
    "offline",
    "pull",
    "remote_config",
    "remote_repo",
    "remote_tensors",
    "remove_cached",
    "scan_hf_cache",
    "scan_lmstudio",
    "shape_config",
    "spec_for",
    "verified_snapshot",
    "weights_estimate",
]
