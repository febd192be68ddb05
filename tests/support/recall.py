"""A small recall cache for tests: its sizes, its spec, a feeder and a full disk."""

from __future__ import annotations

import errno
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_stream.cache import make_sink_cache, max_call_tokens
from mlx_stream.recall import RecallSpec, tier_of

SINKS, WINDOW, BLOCK = 2, 16, 8


def spec(**kw) -> RecallSpec:
    return RecallSpec(**{"blocks": 4, "block": BLOCK, **kw})


def recall_cache(model, index: str = "reuse", shortlist: int = 0, rescan: int = 0, **kw):
    """A recall cache of :func:`spec`; ``index="flat"`` (every refresh scans every
    block), ``shortlist`` and ``rescan``: its tier's shortlist made so (:func:`reindex`)."""
    cache = make_sink_cache(model, SINKS, WINDOW, stride=BLOCK, recall=spec(**kw))
    return reindex(cache, index, shortlist, rescan)


def reindex(cache, index: str = "reuse", shortlist: int = 0, rescan: int = 0):
    """``cache`` with its tier's shortlist changed (its state kept): none for
    ``index="flat"``; ``shortlist`` blocks kept, a scan every ``rescan`` refreshes
    (``0``: the tier's own)."""
    tier = tier_of(cache)
    if index == "flat":
        tier.shortlist = None
    elif shortlist or rescan:
        tier.shortlist.size = shortlist or tier.shortlist.size
        tier.shortlist.rescan = rescan or tier.shortlist.rescan
    return cache


def feed(model, cache, tokens, chunk: int = 8) -> mx.array:
    """Logits of every token, fed in calls of at most ``chunk`` tokens."""
    out, i = [], 0
    while i < len(tokens):
        n = min(chunk, max_call_tokens(cache), len(tokens) - i)
        logits = model(mx.array([tokens[i : i + n]]), cache=cache)[0]
        mx.eval(logits)
        out.append(logits)
        i += n
    return mx.concatenate(out, axis=0)


def full_disk(monkeypatch, part: str = "") -> list[Path]:
    """A disk that is full for every new file whose name holds ``part`` (``""``: all):
    numpy's ``open_memmap``, which the recall store allocates its spill files with,
    fails there with ENOSPC. Returns the new files let through, as they open."""
    real, opened = np.lib.format.open_memmap, []

    def open_memmap(filename, mode="r+", *args, **kwargs):
        if mode == "w+" and part in Path(filename).name:
            raise OSError(errno.ENOSPC, "No space left on device")
        if mode == "w+":
            opened.append(Path(filename))
        return real(filename, mode, *args, **kwargs)

    monkeypatch.setattr(np.lib.format, "open_memmap", open_memmap)
    return opened
