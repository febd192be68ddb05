"""The recall tier of ``serve``'s sessions (``serve --recall``): one store per session,
in a folder of its own, rewound with the session's checkpoints, counted by bytes.

Contract: every session's caches get their own tier (:func:`for_session`), its folder
removed by :func:`release` when the session goes (a killed run's, by
:func:`remove_stale` at start); such sessions decode alone, interleaved. A checkpoint
rewinds the tier with the caches and is never restored into another session (a fork
is rebuilt). Admission counts a recall session's caches, its checkpoint's copy, its
retrieval region and its whole ``ram_bytes`` (:func:`fixed_bytes`); what spills to
disk is not counted. In full: ``docs/serve.md``.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from pathlib import Path
from typing import Any

from mlx_stream.recall import tier_of

PREFIX = "serve-"  # subfolders of --recall-dir made here (one per session)


def for_session(spec: Any) -> Any:
    """A session's own ``RecallSpec``: ``spec`` with a fresh subfolder of its folder
    (``spec`` itself without a folder: the store then makes a temporary one)."""
    if spec is None or spec.folder is None:
        return spec
    folder = Path(spec.folder) / f"{PREFIX}{uuid.uuid4().hex[:16]}"
    return dataclasses.replace(spec, folder=str(folder))


def release(session: Any) -> None:
    """Close ``session``'s store and remove its folder (idempotent)."""
    tier = tier_of(session.caches) if session is not None else None
    if tier is None:
        return
    tier.close()
    folder = tier.store.folder
    if folder is not None and folder.name.startswith(PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def remove_stale(spec: Any) -> None:
    """Remove the session subfolders a previous run left in ``spec.folder``."""
    if spec is None or spec.folder is None or not Path(spec.folder).is_dir():
        return
    for sub in Path(spec.folder).iterdir():
        if sub.name.startswith(PREFIX) and sub.is_dir():
            shutil.rmtree(sub, ignore_errors=True)


STATS = ("device_bytes", "region_bytes", "store_bytes", "store_ram_bytes", "store_disk_bytes",
         "summary_bytes", "store_reserved_bytes", "blocks_stored", "blocks_recalled")  # fmt: skip
TOTALS = STATS[:1] + STATS[2:7]  # summed over sessions in /health and /v1/sessions


def stats(session: Any) -> dict[str, Any]:
    """A session's bytes (zeros for ``None``: a session on disk), in the CLI's words:
    ``device_bytes`` (caches + region: flat); the store's bytes used, blocks and index
    together, ``store_bytes`` = ``store_ram_bytes`` (at most ``--recall-ram``) +
    ``store_disk_bytes`` (growing), of which ``summary_bytes`` the index (the block
    summaries), and the room it has reserved (``store_reserved_bytes``, a segment at a
    time); the blocks stored and recalled (in attention now); and ``recall``: the
    tier's counters as ``stream-run --json`` gives them (``Recall.usage``; ``None``
    without a tier)."""
    out: dict[str, Any] = {**dict.fromkeys(STATS, 0), "recall": None}
    if session is None:
        return out
    out["device_bytes"] = sum(int(getattr(c, "nbytes", 0) or 0) for c in session.caches)
    tier = tier_of(session.caches)
    if tier is None:
        return out
    out["device_bytes"] += tier.device_nbytes
    use = tier.usage()
    out.update(region_bytes=use["region_bytes"], store_bytes=use["ram_bytes"] + use["disk_bytes"],
               store_ram_bytes=use["ram_bytes"], store_disk_bytes=use["disk_bytes"],
               summary_bytes=use["index_bytes"], store_reserved_bytes=use["reserved_bytes"],
               blocks_stored=use["stored_blocks"], blocks_recalled=use["recalled_blocks"],
               recall=use)  # fmt: skip
    return out


def fixed_bytes(model: Any, spec: Any, sinks: int) -> int:
    """What a recall session costs once, beside its caches and their checkpoint copy:
    its region (device) and its store's host memory cap (``ram_bytes``)."""
    from mlx_stream.cache.estimate import model_layout, recall_bytes

    layout = model_layout(model)
    if spec is None or layout is None:
        return 0
    region = recall_bytes(
        layout, sinks, spec.blocks, spec.block, spec.bits, spec.group_size, spec.copies_sinks
    )
    return int(region["region_bytes"]) + int(spec.ram_bytes)


def config(spec: Any) -> dict | None:
    """The recall settings saved sessions depend on (not where the store lives)."""
    if spec is None:
        return None
    from mlx_stream.recall.persist import CHECKED

    settings = spec.settings()
    return {k: settings[k] for k in CHECKED}
