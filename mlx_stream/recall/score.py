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

import mlx_stream.recall.index as index
import mlx_stream.recall.select as select
from mlx_stream.recall.select import _gqa


def keys_of(store) -> Callable[[int, list[int]], np.ndarray]:
    """``(layer, blocks) -> keys (len(blocks), H, block, D)`` (float32) of a
    ``BlockStore``."""

    def keys(layer: int, blocks: list[int]) -> np.ndarray:
        stacked = mx.stack([store.get(layer, j)[0][0] for j in blocks]).astype(mx.float32)
        return np.asarray(stacked)

    return keys


def _probs(q: np.ndarray, keys: np.ndarray, valid: np.ndarray, scale: float) -> np.ndarray:
    """``(H, R, blocks, block)``: each (KV head, query row)'s softmax over every
    candidate token (``q``: ``(Hq, L, D)``; ``keys``: ``(blocks, H, block, D)``;
    ``valid``: ``(blocks, block)`` bool, the tokens that belong to the store)."""
    nb, H, bs, D = keys.shape
    g = _gqa(q.astype(np.float32), H)  # (H, R, D)
    k = keys.astype(np.float32).transpose(1, 0, 2, 3).reshape(H, nb * bs, D)
    logits = np.einsum("hrd,htd->hrt", g, k) * scale
    logits = np.where(valid.reshape(1, 1, -1), logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    return p.reshape(H, -1, nb, bs)


def layer_peaks(q: np.ndarray, keys: np.ndarray, valid: np.ndarray, scale: float) -> np.ndarray:
    """Per block: the largest probability any of its tokens gets, over query heads and
    query tokens (arguments: :func:`_probs`)."""
    return _probs(q, keys, valid, scale).max(axis=(0, 1, 3))


def layer_mass(q: np.ndarray, keys: np.ndarray, valid: np.ndarray, scale: float) -> np.ndarray:
    """Per block: the largest softmax mass its tokens get together, over query heads
    and query tokens (the ``exact`` selector; arguments: :func:`_probs`)."""
    return _probs(q, keys, valid, scale).sum(-1).max(axis=(0, 1))


def _over_layers(layer_fn, queries, keys_of, blocks, first, block, scale) -> np.ndarray:
    total = np.zeros(len(blocks))
    if not blocks:
        return total
    valid = np.arange(block)[None, :] >= np.array([first[j] for j in blocks])[:, None]
    for i, q in enumerate(queries):
        total += layer_fn(q, keys_of(i, blocks), valid, scale)
    return total


def peak_scores(queries: list[np.ndarray], keys_of: Callable[[int, list[int]], np.ndarray],
                blocks: list[int], first: list[int], block: int,
                scale: float) -> np.ndarray:  # fmt: skip
    """The sum over layers of :func:`layer_peaks` for ``blocks`` (stream indices):
    ``queries[i]`` is layer ``i``'s ``(Hq, L, D)``, ``keys_of(layer, blocks)`` gives
    their keys ``(len(blocks), H, block, D)`` and ``first[j]`` is block ``j``'s first
    token that belongs to it."""
    return _over_layers(layer_peaks, queries, keys_of, blocks, first, block, scale)


def mass_scores(queries: list[np.ndarray], keys_of: Callable[[int, list[int]], np.ndarray],
                blocks: list[int], first: list[int], block: int,
                scale: float) -> np.ndarray:  # fmt: skip
    """The sum over layers of :func:`layer_mass` (arguments: :func:`peak_scores`)."""
    return _over_layers(layer_mass, queries, keys_of, blocks, first, block, scale)


def block_scores(selector: str, queries: list[np.ndarray], store, summaries, first: list[int],
                 block: int, scale: float) -> np.ndarray:  # fmt: skip
    """Every stored block's score under ``selector`` (``-inf``: a block with no token
    of its own), for blocks ``0 .. len(first) - 1`` of ``store`` (a ``BlockStore``)
    summarised in ``summaries``; ``queries[i]``: layer ``i``'s ``(Hq, L, D)``."""
    nb = len(first)
    empty = np.array([f >= block for f in first])
    if selector in ("exact", "token"):
        blocks = [j for j in range(nb) if not empty[j]]
        fn = peak_scores if selector == "token" else mass_scores
        total = np.full(nb, -np.inf)
        total[blocks] = fn(queries, keys_of(store), blocks, first, block, scale)
        return total
    if selector == "quest" and isinstance(summaries, index.Indexed) and summaries.searches_quest:
        return summaries.search(queries, nb, empty, scale)
    total = np.zeros(nb)
    for i, q in enumerate(queries):
        total += select.layer_scores_summary(q, summaries, i, nb, selector, scale, empty)
    return np.where(empty, -np.inf, total)
