"""A SinkCache's sink moves and rebases: the :class:`Layout` its stored tensors are in,
bringing them into a call's layout, and the :class:`Undo` that lets a trim go back
across a rebase exactly. Mixed into ``SinkCache`` (``cache.layer``)."""

from __future__ import annotations

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


class Relayout:
    """SinkCache's layout methods (its ring, buffers, move and stride are its own)."""

    @property
    def moving(self) -> bool:
        """Whether this layer moves its sinks and rebases (cache positions that move)."""
        return self.positions == "cache" and (self.move is None or self.move.moves)

    @property
    def layout(self) -> Layout:
        """The sink move and rebase the stored tensors are in."""
        return self._layout_applied

    def needs_layout(self, n: int) -> bool:
        """Whether a call starting at token ``n`` first moves the sinks or rebases."""
        return self.moving and n // self.stride != self._layout_stride

    def _buffers(self) -> list:
        return [self.keys, self.values]

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

    def apply_layout(self, n: int, N: int) -> None:
        """Bring stored tensors into the layout of an ``N``-token call at token ``n``
        (and write the spare sinks of the later layouts a crossing call spans)."""
        ring, S, C = self.ring, self.sinks, self.capacity
        if not self.moving:
            if not ring.in_order(N) and ring.in_place:
                for k in range(1, len(ring.sink_layouts(N))):  # unmoved sink copies
                    lo = C + (k - 1) * S
                    for b in self._buffers():
                        kvstore.put(b, lo, lo + S, kvstore.get(b, 0, S))
            return
        slot = self.move.slot if self.move is not None else 0
        bits, g = self.storage.bits_of(slot), self.kv_group_size
        buf = self._buffers()[slot]
        if n // self.stride != self._layout_stride:  # it only changes at stride multiples
            base, sink_start = ring.layout(n)
            old = self._layout_applied
            if base != old[0]:
                keep = self.rolls_back  # the moved tensors, for an exact trim back
                moved = kvstore.copy(self.storage.ring_part(buf)) if keep else None
                self._undo = Undo(n, old, self._layout_stride, moved) if keep else None
                d = old[0] - base
                self.storage.rotate(slot, S, C, lambda x: self._shift(x, d))
            if S > 0 and sink_start - base != old[1] - old[0]:
                # Re-derived from the full-precision first-written copy: moves never
                # accumulate rounding or quantization error, and undo exactly.
                moved = self._shift(self.sink_copy, sink_start - base)
                kvstore.put(buf, 0, S, kvstore.pack(moved, bits, g))
            self._layout_applied = Layout(base, sink_start)
            self._layout_stride = n // self.stride
        if ring.in_order(N) or not ring.in_place:
            return  # a concatenating call gets its spare sinks as columns (_spare_sinks)
        base = ring.layout(n)[0]
        for k, start in enumerate(ring.sink_layouts(N)[1:], 1):
            lo = C + (k - 1) * S
            for b in self._buffers():
                kvstore.put(b, lo, lo + S, kvstore.get(b, 0, S))
            moved = self._shift(self.sink_copy, start - base)
            kvstore.put(buf, lo, lo + S, kvstore.pack(moved, bits, g))

    def _spare_sinks(self, n: int, N: int) -> list[list]:
        """Storage-form [keys, values] of the sinks of each later layout the next call
        spans (a concatenating call appends them as columns after the buffer)."""
        ring, S, g = self.ring, self.sinks, self.kv_group_size
        starts = ring.sink_layouts(N)
        if len(starts) < 2:
            return []
        base = ring.layout(n)[0]
        out = []
        for start in starts[1:]:
            pair = [kvstore.get(b, 0, S) for b in self._buffers()]
            if self.moving:
                slot = self.move.slot if self.move is not None else 0
                moved = self._shift(self.sink_copy, start - base)
                pair[slot] = kvstore.pack(moved, self.storage.bits_of(slot), g)
            out.append(pair)
        return out

    def expire_undo(self) -> None:
        """Drop the copy kept to undo a rebase once no rollback can reach back across it."""
        if self._undo is not None and self.ring.tokens_seen >= self._undo.token + self.slack + 2:
            self._undo = None

    def _trim_layout(self, keep: int, n: int) -> None:
        """Before forgetting ``n`` tokens down to ``keep``: back across a rebase that
        was applied, restore what it replaced (never re-rotate)."""
        ring = self.ring
        base = ring.layout(keep)[0]
        rebased = keep // self.stride < self._layout_stride and base != self._layout_applied[0]
        if rebased:  # back across a rebase that was applied: restore, never re-rotate
            undo = self._undo
            if undo is None or keep >= undo.token or undo.layout.base != base:
                raise Unsupported(
                    f"cannot trim {n} tokens exactly: the rollback crosses the rebase "
                    f"at token {ring.rebase_point(ring.tokens_seen)}, whose moved "
                    "tensors were not kept (they are, once a cache has been trimmed)"
                )
            _, self._layout_applied, self._layout_stride, saved = undo
            slot = self.move.slot if self.move is not None else 0
            if self.storage.tail:  # the ring's slots only: the tail is the extension's
                kvstore.put(self._buffers()[slot], 0, kvstore.length(saved), saved)
            elif slot == 0:
                self.keys = saved
            else:
                self.values = saved
            self._undo = None
