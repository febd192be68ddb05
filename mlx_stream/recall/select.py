"""Which stored blocks come back: block summaries and query-driven scoring (numpy).

Scoring (measured on the default model: averaging heads loses the needle, a vote of
per-head scores across layers finds it): for each layer, each query head and each
query token, the softmax mass every block would receive; a layer's score of a block
is its largest mass over heads and tokens; the selection is the ``k`` blocks with the
highest sum over layers, one selection shared by all layers. Ties go to the earlier
block, so a selection is a pure function of the queries and the store.

How a block's logits are estimated is the selector:

* ``exact``: every stored key (the softmax over all stored tokens, summed per block;
  ``mlx_stream.recall.score``), O(stored tokens) per refresh;
* ``token``: every stored key, a block's largest single-token probability
  (``mlx_stream.recall.score``), O(stored tokens) per refresh;
* ``quest``: Quest's per-channel bound ``sum_c max(q_c min_c, q_c max_c)`` of the
  block's keys, a softmax over blocks;
* ``mean``: the block's mean key (InfLLM's simplest summary), a softmax over blocks.

Queries arrive moved to the frame where a block's key ``i`` sits at position ``i``
(block-relative keys, as the store keeps them), so a dot product here is the score
the block would get placed right before the sinks.
"""

from __future__ import annotations

import numpy as np


class Summaries:
    """Per layer and block: the mean, minimum and maximum of the keys per head and
    channel (float32, host memory, ``3 * H * D`` numbers per block and layer)."""

    def __init__(self, layers: int):
        self.mean = [None] * layers
        self.lo = [None] * layers
        self.hi = [None] * layers
        self.count = 0  # blocks summarised in every layer

    def add(self, layer: int, j: int, keys: np.ndarray) -> None:
        """Summarise block ``j`` of ``layer`` from its valid keys ``(H, tokens, D)``."""
        keys = keys.astype(np.float32)
        for name, value in (("mean", keys.mean(1)), ("lo", keys.min(1)), ("hi", keys.max(1))):
            table = getattr(self, name)
            if table[layer] is None or table[layer].shape[0] <= j:
                grown = np.zeros((max(16, 2 * (j + 1)), *value.shape), np.float32)
                if table[layer] is not None:
                    grown[: table[layer].shape[0]] = table[layer]
                table[layer] = grown
            table[layer][j] = value

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for table in (self.mean, self.lo, self.hi) for t in table
                   if t is not None)  # fmt: skip


def _gqa(q: np.ndarray, kv_heads: int) -> np.ndarray:
    """Queries ``(Hq, L, D)`` as ``(kv_heads, Hq // kv_heads * L, D)``: each KV head's
    query heads side by side (mlx-lm's grouping: query head ``h`` reads KV head
    ``h // (Hq // kv_heads)``)."""
    Hq, L, D = q.shape
    return q.reshape(kv_heads, (Hq // kv_heads) * L, D)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def layer_scores_summary(q: np.ndarray, summaries: Summaries, layer: int, blocks: int,
                         selector: str, scale: float, empty: np.ndarray) -> np.ndarray:  # fmt: skip
    """Per block: the largest softmax mass over heads and tokens, from summaries."""
    return head_scores_summary(q, summaries, layer, blocks, selector, scale, empty).max(0)


def head_scores_summary(q: np.ndarray, summaries: Summaries, layer: int, blocks: int,
                        selector: str, scale: float, empty: np.ndarray) -> np.ndarray:  # fmt: skip
    """Per KV head and block ``(H, blocks)``: the largest softmax mass over the head's
    query heads and tokens, from summaries."""
    g = _gqa(q.astype(np.float32), summaries.mean[layer].shape[1])  # (H, R, D)
    if selector == "mean":
        logits = np.einsum("hrd,bhd->hrb", g, summaries.mean[layer][:blocks])
    else:  # quest: an upper bound of q . k over the block's keys, channel by channel
        lo, hi = summaries.lo[layer][:blocks], summaries.hi[layer][:blocks]
        pos, neg = np.maximum(g, 0), np.minimum(g, 0)
        logits = np.einsum("hrd,bhd->hrb", pos, hi) + np.einsum("hrd,bhd->hrb", neg, lo)
    logits = np.where(empty[None, None, :], -np.inf, logits * scale)
    return _softmax(logits, -1).max(axis=1)


def top_k(scores: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[int, ...]:
    """The ``k`` best blocks in stream order (ties: the earlier block wins)."""
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    order = np.argsort(-scores, kind="stable")[:k]
    order = [int(b) for b in order if np.isfinite(scores[b])]
    return tuple(sorted(order))
