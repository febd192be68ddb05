"""Many streams decoded in one pass over the weights: one layer's cache for ``B``
sessions, one row each.

Contract: a :class:`BatchSinkCache` row is a session's own
:class:`~mlx_stream.cache.SinkCache` (its ring, sink moves, rebases and rollback copy),
whose keys and values live in one ``(B, H, slots, D)`` buffer while it is in the batch:
one scatter per call writes every row's slot, the rest of a row's write goes through the
row's own calls. Per-row positions are an ``offset`` array and the mask is per row, so a
row sees exactly what its session sees alone. Rows join (:meth:`~BatchSinkCache.add`)
and leave (:meth:`~BatchSinkCache.remove`) between calls; a batched call feeds one token
per row. Refused with a reason (:func:`batch_refusal`, :func:`check_batchable`, once per
model): quantized rows, rows with a client (recall), models whose batched step does not
reproduce the single-session step.
"""

from __future__ import annotations

import copy
import weakref

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_stream.cache.hooks import NONE
from mlx_stream.cache.sink import SinkCache, max_call_tokens
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.errors import Unsupported
from mlx_stream.mlxlm import BaseCache

#: Largest logit difference between a batched row and the same session alone.
TOLERANCE = 1e-3


class BatchSinkCache(BaseCache):
    """One layer's KV cache for several sessions, one row each (mlx-lm's cache protocol
    for one-token calls)."""

    def __init__(self):
        self.rows: list[SinkCache] = []
        self.keys: mx.array | None = None  # (B, H, slots, D): every row's keys
        self.values: mx.array | None = None

    # ----- rows -----------------------------------------------------------------------

    def add(self, row: SinkCache) -> int:
        """Copy the session cache ``row`` in as the last row; returns its index. The
        row's own buffers are released (the batch holds them until :meth:`remove`)."""
        why = batch_refusal(row)
        if why:
            raise Unsupported(why)
        T = row.ring.slots_total
        keys, values = row.keys[..., :T, :], row.values[..., :T, :]
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            L = max(self.keys.shape[2], T)
            self.keys = mx.concatenate([_pad(self.keys, L), _pad(keys, L)])
            self.values = mx.concatenate([_pad(self.values, L), _pad(values, L)])
        row.keys = row.values = None
        self.rows.append(row)
        return len(self.rows) - 1

    def remove(self, i: int) -> SinkCache:
        """Take row ``i`` out: its keys and values copied back to its SinkCache, the
        other rows unchanged (later rows move up by one)."""
        row = self.rows.pop(i)
        row.forget_fetched()  # what it fetched alone is stale: keys_and_values recounts
        T = row.ring.slots_total
        row.keys = mx.contiguous(self.keys[i : i + 1, :, :T])
        row.values = mx.contiguous(self.values[i : i + 1, :, :T])
        if not self.rows:
            self.keys = self.values = None
            mx.eval(row.keys, row.values)
            return row
        keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
        L = max(r.ring.slots_total for r in self.rows)
        self.keys = self.keys[keep, :, :L]
        self.values = self.values[keep, :, :L]
        mx.eval(row.keys, row.values, self.keys, self.values)
        return row

    # ----- mlx-lm cache protocol ------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        """Each row's RoPE position of its next token, shape ``(B,)``."""
        return mx.array([r.offset for r in self.rows], dtype=mx.int32)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """Each row's mask for its next token, ``(B, 1, 1, slots)``: its own ring's
        visible slots, and none of the slots past its own buffer."""
        if N != 1:
            raise Unsupported(f"a batched call feeds one token per row (got {N})")
        B, L = len(self.rows), self.keys.shape[2]
        mask = np.zeros((B, 1, 1, L), dtype=bool)
        for b, row in enumerate(self.rows):
            row.ring.check_call(1)  # refuse before any layer is touched
            seen = row.ring.visible(1, window_size)
            mask[b, 0, :, : seen.shape[1]] = seen
        if return_array or not all(r.additive_mask for r in self.rows):
            return mx.array(mask)
        return mx.array(np.where(mask, 0.0, -np.inf), dtype=self.values.dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write each row's one new key and value into its own next slot (after moving
        its sinks or rebasing where its stream reached a stride boundary)."""
        B, H, N, _ = keys.shape
        if N != 1 or B != len(self.rows):
            raise Unsupported(f"a batched call feeds one token to each of {len(self.rows)} rows")
        slots = []
        for b, row in enumerate(self.rows):
            n = row.ring.tokens_seen
            row.ring.check_call(1)
            if row.needs_layout(n):
                self._relayout(b, row, n)
            slots.append(row.ring.slot(n))
        index = mx.array(slots, dtype=mx.int32).reshape(B, 1, 1, 1)
        self.keys = mx.put_along_axis(
            self.keys, mx.broadcast_to(index, keys.shape), keys.astype(self.keys.dtype), axis=2
        )
        self.values = mx.put_along_axis(
            self.values,
            mx.broadcast_to(index, values.shape),
            values.astype(self.values.dtype),
            axis=2,
        )
        for b, row in enumerate(self.rows):  # the rest of the write, as the row's own
            n = row.ring.tokens_seen
            row.relayout.record_sinks(row.ring.slot(n), 1, keys[b : b + 1], values[b : b + 1], 0)
            row.advance(1)
        return self.keys, self.values

    def _relayout(self, b: int, row: SinkCache, n: int) -> None:
        """Row ``b``'s sink move or rebase, done by its own SinkCache on its slice."""
        T = row.ring.slots_total
        row.keys, row.values = self.keys[b : b + 1, :, :T], self.values[b : b + 1, :, :T]
        row.relayout.apply(n, 1)
        self.keys[b : b + 1, :, :T] = row.keys
        self.values[b : b + 1, :, :T] = row.values
        row.keys = row.values = None

    def is_trimmable(self) -> bool:
        return False  # rows are trimmed on their own SinkCache, after they leave

    def size(self) -> int:
        return max((r.size() for r in self.rows), default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        own = sum(a.nbytes for a in self.state)
        return own + sum(r.sink_copy.nbytes for r in self.rows if r.sink_copy is not None)


def _pad(x: mx.array, L: int) -> mx.array:
    """``x`` (B, H, slots, D) given ``L`` slots (zeros after its own)."""
    missing = L - x.shape[2]
    if missing <= 0:
        return x
    return mx.concatenate([x, mx.zeros((*x.shape[:2], missing, x.shape[3]), x.dtype)], axis=2)


def batch_refusal(row, joining: bool = True) -> str | None:
    """Why the layer cache ``row`` cannot be a batch row (``None``: it can); a row
    ``joining`` now must hold its first token already."""
    if not isinstance(row, SinkCache):
        return (
            f"a layer keeps mlx-lm's {type(row).__name__} (a sliding window or state layer), "
            "which is not batched"
        )
    if row.quantized:
        return "quantized KV caches (kv_bits) are not batched: each session decodes alone"
    if row.hooks is not NONE:  # the batched write never calls the client's hooks
        return f"caches with {row.hooks.what} are not batched: each session decodes alone"
    if joining and row.keys is None:
        return "a session joins a batch after its first token (prefill it first)"
    return None


_VERDICTS: dict[int, str | None] = {}  # by id(model), dropped with the model
# Sizes and prompts the probe uses: window 8, stride 4 (rebase every 16 tokens); the
# rows start decoding at tokens 14, 5 and 11 and within PROBE_STEPS cross a rebase,
# sink moves and the first wrap, each at another step.
PROBE = CacheSpec(sinks=2, window=8, slack=4, stride=4)
PROBE_PROMPTS = (
    (7, 3, 11, 5, 2, 9, 4, 6, 8, 12, 10, 13, 2, 5),
    (4, 9, 2, 8, 6),
    (6, 1, 8, 3, 7, 5, 9, 2, 4, 10, 11),
)
PROBE_STEPS = 6


def check_batchable(model: nn.Module) -> str | None:
    """Why ``model`` cannot decode sessions in one batch (``None``: it can), checked on
    the model itself once: three rows at different offsets, across a rebase, sink
    moves and a wrap at different steps, decoded together must give the logits each
    gives alone."""
    key = id(model)
    if key not in _VERDICTS:
        try:
            verdict = _probe(model)
        except Exception as exc:  # noqa: BLE001 - any failure is a reason not to batch
            verdict = f"its batched step fails ({type(exc).__name__}: {exc})"
        _VERDICTS[key] = verdict
        weakref.finalize(model, _VERDICTS.pop, key, None)
    return _VERDICTS[key]


def _probe(model: nn.Module) -> str | None:
    for c in PROBE.build(model, check_memory=False):
        if not isinstance(c, SinkCache):
            return batch_refusal(c)
    singles, batch = [], [BatchSinkCache() for _ in model.layers]
    for prompt in PROBE_PROMPTS:
        own = PROBE.build(model, check_memory=False)
        rest = list(prompt[:-1])
        while rest:  # chunks that cross no layout change: exact
            n = min(len(rest), max_call_tokens(own))
            model(mx.array(rest[:n])[None], cache=own)
            rest = rest[n:]
        mine = copy.deepcopy(own)
        for layer, c in zip(batch, mine, strict=True):
            layer.add(c)
        singles.append(own)
    tokens = [p[-1] for p in PROBE_PROMPTS]
    for _ in range(PROBE_STEPS):
        together = model(mx.array(tokens)[:, None], cache=batch)[:, -1]
        alone = mx.concatenate(
            [model(mx.array([[t]]), cache=c)[:, -1] for t, c in zip(tokens, singles, strict=True)]
        )
        error = mx.abs(together - alone).max().item()
        if not error <= TOLERANCE * max(1.0, mx.abs(alone).max().item()):
            return f"its batched step differs from single-session decoding (by {error:.2g})"
        tokens = mx.argmax(alone, axis=-1).tolist()
    return None
