"""One SinkCache layer's sink moves and rebases, as an object the cache owns.

Contract: :class:`Relayout` holds the :class:`Layout` the stored tensors are in, the
full-precision copy of the sinks as first written (moves are re-derived from it, so they
never accumulate error), and the :class:`Undo` that lets a trim go back across a rebase
exactly. It reads the cache's ring, storage and position mover, given at construction.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import mlx.core as mx

from mlx_stream.cache import storage as kvstore
from mlx_stream.errors import Unsupported


class Layout(NamedTuple):
    """Where the stored tensors' positions are: ``base`` (the rebase) and
    ``sink_start`` (where the sinks were moved to)."""

    base: int
    sink_start: int


class Undo(NamedTuple):
    """What a rebase replaced (kept while a rollback can reach back across it): the
    ``token`` it happened at, the ``layout`` and ``stride`` index before, and the
    ``moved`` buffer as it was."""

    token: int
    layout: Layout
    stride: int
    moved: object


#: A loaded layout's stride index when the file does not say: above every stride, so
#: the next call re-derives the layout and a trim that would change it is refused.
UNKNOWN_STRIDE = 2**62


class Relayout:
    """The sink move and rebase of one layer.

    Args:
        ring (Ring): The layer's slot layout.
        storage (SlotStorage): Where its keys and values live.
        move (Move, optional): Which cached tensor carries positions, and how to move it.
    """

    def __init__(self, ring, storage, move):
        self.ring, self.storage, self.move = ring, storage, move
        self.applied = Layout(0, 0)  # the layout the stored tensors are in
        self.stride_index = -1  # token // stride the layout was set for
        self.undo: Undo | None = None  # the layout before the last rebase, to trim back
        self.sink_copy = None  # the moved slot's sinks as first written (full precision)
        # Keep the rebase's moved tensors only once the cache has been rolled back
        # (speculative decoding): plain decoding never trims and keeps its memory flat.
        self.rolls_back = False

    def copy(self, ring, storage) -> Relayout:
        """This state for a copied cache (its own ring and storage; the move is shared)."""
        clone = copy.copy(self)
        clone.ring, clone.storage = ring, storage
        clone.sink_copy = kvstore.copy(self.sink_copy)
        if self.undo is not None:  # a trim adopts this buffer and writes it in place
            clone.undo = self.undo._replace(moved=kvstore.copy(self.undo.moved))
        return clone

    @property
    def moving(self) -> bool:
        """Whether this layer moves its sinks and rebases (cache positions that move)."""
        return self.ring.positions == "cache" and (self.move is None or self.move.moves)

    @property
    def slot(self) -> int:
        """Which of (keys, values) carries positions."""
        return self.move.slot if self.move is not None else 0

    def needs_layout(self, n: int) -> bool:
        """Whether a call starting at token ``n`` first moves the sinks or rebases."""
        return self.moving and n // self.ring.stride != self.stride_index

    def allocate(self, keys: mx.array, values: mx.array) -> None:
        """The sink copy's buffer, beside the storage's first allocation."""
        if self.ring.sinks > 0 and self.moving:
            x = (keys, values)[self.slot]
            self.sink_copy = mx.zeros((*x.shape[:2], self.ring.sinks, x.shape[-1]), x.dtype)

    def record_sinks(self, s: int, length: int, keys: mx.array, values: mx.array, i: int) -> None:
        """Keep the sinks slots ``s:s+length`` are written with (from call row ``i``)."""
        if s < self.ring.sinks and self.sink_copy is not None:
            slot = self.move.slot if self.move is not None and self.move.moves else 0
            kvstore.put(self.sink_copy, s, s + length, (keys, values)[slot], i)

    def _buffers(self) -> list:
        return [self.storage.keys, self.storage.values]

    def _shift(self, x: mx.array, d: int) -> mx.array:
        """Move the positioned tensor ``x`` (B, H, L, D) by ``d`` positions."""
        if d == 0:
            return x
        if self.move is None:
            raise Unsupported(
                "SinkCache needs to know where the layer's positions live to move them "
                "(build it with make_sink_cache, or use positions='absolute')"
            )
        return self.move(x, d)

    def _moved_sinks(self, start: int, base: int):
        """The sinks moved to ``start`` in a buffer rebased at ``base``, stored form."""
        moved = self._shift(self.sink_copy, start - base)
        return kvstore.pack(moved, self.storage.bits_of(self.slot), self.storage.kv_group_size)

    def apply(self, n: int, N: int) -> None:
        """Bring stored tensors into the layout of an ``N``-token call at token ``n``
        (and write the spare sinks of the later layouts a crossing call spans)."""
        ring, S, C = self.ring, self.ring.sinks, self.ring.capacity
        if not self.moving:
            if not ring.in_order(N) and ring.in_place:
                for k in range(1, len(ring.sink_layouts(N))):  # unmoved sink copies
                    lo = C + (k - 1) * S
                    for b in self._buffers():
                        kvstore.put(b, lo, lo + S, kvstore.get(b, 0, S))
            return
        buf = self._buffers()[self.slot]
        if n // ring.stride != self.stride_index:  # it only changes at stride multiples
            base, sink_start = ring.layout(n)
            old = self.applied
            if base != old[0]:
                keep = self.rolls_back  # the moved tensors, for an exact trim back
                moved = kvstore.copy(self.storage.ring_part(buf)) if keep else None
                self.undo = Undo(n, old, self.stride_index, moved) if keep else None
                d = old[0] - base
                self.storage.rotate(self.slot, S, C, lambda x: self._shift(x, d))
            if S > 0 and sink_start - base != old[1] - old[0]:
                kvstore.put(buf, 0, S, self._moved_sinks(sink_start, base))
            self.applied = Layout(base, sink_start)
            self.stride_index = n // ring.stride
        if ring.in_order(N) or not ring.in_place:
            return  # a concatenating call gets its spare sinks as columns (spare_sinks)
        base = ring.layout(n)[0]
        for k, start in enumerate(ring.sink_layouts(N)[1:], 1):
            lo = C + (k - 1) * S
            for b in self._buffers():
                kvstore.put(b, lo, lo + S, kvstore.get(b, 0, S))
            kvstore.put(buf, lo, lo + S, self._moved_sinks(start, base))

    def spare_sinks(self, n: int, N: int) -> list[list]:
        """Storage-form [keys, values] of the sinks of each later layout the next call
        spans (a concatenating call appends them as columns after the buffer)."""
        ring, S = self.ring, self.ring.sinks
        starts = ring.sink_layouts(N)
        if len(starts) < 2:
            return []
        base = ring.layout(n)[0]
        out = []
        for start in starts[1:]:
            pair = [kvstore.get(b, 0, S) for b in self._buffers()]
            if self.moving:
                pair[self.slot] = self._moved_sinks(start, base)
            out.append(pair)
        return out

    def expire_undo(self) -> None:
        """Drop the copy kept to undo a rebase once no rollback can reach back across it."""
        if self.undo is not None and self.ring.tokens_seen >= self.undo.token + self.ring.slack + 2:
            self.undo = None

    def trim(self, keep: int, n: int) -> None:
        """Before forgetting ``n`` tokens down to ``keep``: back across a rebase that
        was applied, restore what it replaced (never re-rotate)."""
        ring = self.ring
        base = ring.layout(keep)[0]
        rebased = keep // ring.stride < self.stride_index and base != self.applied[0]
        if not rebased:
            return
        undo = self.undo
        if undo is None or keep >= undo.token or undo.layout.base != base:
            raise Unsupported(
                f"cannot trim {n} tokens exactly: the rollback crosses the rebase "
                f"at token {ring.rebase_point(ring.tokens_seen)}, whose moved "
                "tensors were not kept (they are, once a cache has been trimmed)"
            )
        _, self.applied, self.stride_index, saved = undo
        if self.storage.tail:  # the ring's slots only: the tail is the extension's
            kvstore.put(self._buffers()[self.slot], 0, kvstore.length(saved), saved)
        elif self.slot == 0:
            self.storage.keys = saved
        else:
            self.storage.values = saved
        self.undo = None
