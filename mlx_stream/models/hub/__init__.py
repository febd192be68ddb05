"""Hugging Face ids, and the MLX models already on disk (no mlx import at module level).

A model named ``org/name`` that is no registry name and no existing path is a Hugging
Face repo id. It resolves, in order, to its snapshot in the shared Hugging Face cache,
LM Studio's copy (:func:`lmstudio_models_dir`), or a download (:func:`pull`) whose fit
is checked from the repo's file list, config and safetensors headers before any weight
is fetched; a snapshot missing a shard is never taken as loadable
(:func:`folder_problem`). A gated or missing repo, no network, or a repo that is not an
MLX model: one :class:`UserError` line each (exit 2). ``HF_HUB_OFFLINE``,
``HF_ENDPOINT`` and the cache variables are read at each call.

The parts: :mod:`~mlx_stream.models.hub.local`, :mod:`~mlx_stream.models.hub.fit` and
:mod:`~mlx_stream.models.hub.remote`; every public name is importable from here. In
full: docs/development.md ("Hugging Face ids").
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
