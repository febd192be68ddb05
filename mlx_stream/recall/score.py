"""Token-level scoring of stored blocks (numpy): what a question's queries pick.

A block summary bounds or averages a block's keys; one key that the question matches
(the needle's tokens) hides among 64 that it does not. The ``token`` selector scores
the stored keys themselves: for each layer, each query head and each query token, the
softmax over every candidate token; a block's score in a layer is the largest
probability any of its tokens gets from any head and query token (its *peak*, not its
mass: a block of many lukewarm keys does not outscore one key that the query picks
out); the selection is the ``k`` blocks with the highest sum over layers. Ties go to
the earlier block.

Its cost is every candidate key of every layer read once per refresh (O(stored
tokens)): the tier uses it at a prompt's end, where the question's queries choose.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

import mlx_stream.recall.select as select
from mlx_stream.recall.select import group_queries


def keys_of(store) -> Callable[[int, list[int]], np.ndarray]:
    """``(layer, blocks) -> keys (len(blocks), H, block, D)`` (float32) of a
    ``BlockStore``."""

    def keys(layer: int, blocks: list[int]) -> np.ndarray:
        stacked = mx.stack([store.get(layer, j)[0][0] for j in blocks]).astype(mx.float32)
        return np.asarray(stacked)

    return keys


#: Blocks whose keys one step of a layer's scan reads (64 x 64 tokens): the scan's
#: memory is this chunk's logits and ``(KV heads, query rows, blocks)`` statistics,
#: not a softmax over every stored token (gigabytes a layer over a long stream).
CHUNK = 64


def _chunk_stats(g: np.ndarray, keys: np.ndarray, valid: np.ndarray,
                 scale: float) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """For grouped queries ``g`` ``(H, R, D)`` and a chunk of blocks ``keys``
    ``(blocks, H, block, D)`` (``valid``: ``(blocks, block)``, the tokens that belong to
    the store): per (KV head, query row, block) the largest logit and the log of the
    sum of ``exp(logit)`` over the block's tokens, ``(H, R, blocks)`` each (``-inf``
    for a block with no valid token)."""
    nb, H, bs, D = keys.shape
    k = keys.astype(np.float32).transpose(1, 0, 2, 3).reshape(H, nb * bs, D)
    logits = select.matmul(g, k.transpose(0, 2, 1))  # BLAS, the model's threads
    logits *= np.float32(scale)  # in place, as below: the scan is memory-bound
    logits = logits.reshape(H, -1, nb, bs)
    if not valid.all():
        logits = np.where(valid[None, None], logits, -np.inf)
    top = logits.max(-1)
    with np.errstate(invalid="ignore"):  # blocks with no valid token: -inf - -inf
        logits -= top[..., None]
        sums = np.exp(logits, out=logits).sum(-1)
    return top, np.where(np.isfinite(top), top + np.log(np.maximum(sums, 1e-38)), -np.inf)


def _layer(q: np.ndarray, chunks, kind: str, scale: float) -> np.ndarray:
    """Per block: the largest probability (``kind="peak"``: of one of its tokens;
    ``"mass"``: of its tokens together) that a (query head, query token) of ``q``
    ``(Hq, L, D)`` gives it in a softmax over every candidate token, ``chunks``
    yielding ``(keys, valid)`` as :func:`_chunk_stats` takes them, block after block."""
    g, tops, lses = None, [], []
    for keys, valid in chunks:
        if g is None:
            g = group_queries(q.astype(np.float32), keys.shape[1])
        top, lse = _chunk_stats(g, keys, valid, scale)
        tops.append(top)
        lses.append(lse)
    lse = np.concatenate(lses, axis=-1)  # (H, R, blocks)
    norm = np.logaddexp.reduce(lse, axis=-1, keepdims=True)  # over every candidate token
    value = np.concatenate(tops, axis=-1) if kind == "peak" else lse
    return np.exp(value - norm).max(axis=(0, 1))


def layer_peaks(q: np.ndarray, keys: np.ndarray, valid: np.ndarray, scale: float) -> np.ndarray:
    """Per block: the largest probability any of its tokens gets, over query heads and
    query tokens (``q``: ``(Hq, L, D)``; ``keys``: ``(blocks, H, block, D)``;
    ``valid``: ``(blocks, block)`` bool, the tokens that belong to the store)."""
    return _layer(q, [(keys, valid)], "peak", scale)


def layer_mass(q: np.ndarray, keys: np.ndarray, valid: np.ndarray, scale: float) -> np.ndarray:
    """Per block: the largest softmax mass its tokens get together, over query heads
    and query tokens (the ``exact`` selector; arguments: :func:`layer_peaks`)."""
    return _layer(q, [(keys, valid)], "mass", scale)


def _over_layers(kind, queries, keys_of, blocks, first, block, scale) -> np.ndarray:
    total = np.zeros(len(blocks))
    if not blocks:
        return total
    valid = np.arange(block)[None, :] >= np.array([first[j] for j in blocks])[:, None]
    for i, q in enumerate(queries):  # a chunk's keys read when reached (spilled: from files)
        chunks = ((keys_of(i, blocks[a : a + CHUNK]), valid[a : a + CHUNK])
                  for a in range(0, len(blocks), CHUNK))  # fmt: skip
        total += _layer(q, chunks, kind, scale)
    return total


def peak_scores(queries: list[np.ndarray], keys_of: Callable[[int, list[int]], np.ndarray],
                blocks: list[int], first: list[int], block: int,
                scale: float) -> np.ndarray:  # fmt: skip
    """The sum over layers of :func:`layer_peaks` for ``blocks`` (stream indices):
    ``queries[i]`` is layer ``i``'s ``(Hq, L, D)``, ``keys_of(layer, blocks)`` gives
    their keys ``(len(blocks), H, block, D)`` and ``first[j]`` is block ``j``'s first
    token that belongs to it."""
    return _over_layers("peak", queries, keys_of, blocks, first, block, scale)


def mass_scores(queries: list[np.ndarray], keys_of: Callable[[int, list[int]], np.ndarray],
                blocks: list[int], first: list[int], block: int,
                scale: float) -> np.ndarray:  # fmt: skip
    """The sum over layers of :func:`layer_mass` (arguments: :func:`peak_scores`)."""
    return _over_layers("mass", queries, keys_of, blocks, first, block, scale)


def block_scores(selector: str, queries: list[np.ndarray], store, summaries, first: list[int],
                 block: int, scale: float,
                 candidates: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """Every stored block's score under ``selector`` (``-inf``: a block with no token
    of its own), for blocks ``0 .. len(first) - 1`` of ``store`` (a ``BlockStore``)
    summarised in ``summaries``; ``queries[i]``: layer ``i``'s ``(Hq, L, D)``;
    ``candidates`` (``quest`` and ``mean``, block numbers ascending): score those
    alone, the softmax over them, the rest ``-inf`` (``mlx_stream.recall.reuse``)."""
    nb = len(first)
    if candidates is not None:  # only their own tokens read: the refresh stays off O(nb)
        part = np.array([first[j] >= block for j in candidates], bool)
        out = np.full(nb, -np.inf)
        out[candidates] = _summary_scores(selector, queries, summaries, candidates, scale, part)
        return out
    empty = np.array([f >= block for f in first])
    if selector in ("exact", "token"):
        blocks = [j for j in range(nb) if not empty[j]]
        total = np.full(nb, -np.inf)
        if selector == "token":
            total[blocks] = peak_scores(queries, keys_of(store), blocks, first, block, scale)
        else:
            total[blocks] = mass_scores(queries, keys_of(store), blocks, first, block, scale)
        return total
    return _summary_scores(selector, queries, summaries, nb, scale, empty)


def _summary_scores(selector: str, queries: list[np.ndarray], summaries, blocks, scale: float,
                    empty: np.ndarray) -> np.ndarray:  # fmt: skip
    """The sum over layers of ``select.layer_scores_summary`` for ``blocks`` (a count or
    block numbers), ``-inf`` where ``empty``."""
    total = np.zeros(len(empty))
    for i, q in enumerate(queries):
        total += select.layer_scores_summary(q, summaries, i, blocks, selector, scale, empty)
    return np.where(empty, -np.inf, total)
