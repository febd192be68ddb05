"""The recall tier's device region: the selected blocks laid out for attention, one
per layer, and attention over the region and the window together.

Where the cache's storage can keep slots after its ring (``storage.tail``: float, or
quantized with the same bits for keys and values, the format the region is laid in),
the region *is* those slots: a call that attends the ring's slots in place attends the
ring and the region as one buffer, with no copy (the concatenation of a region of its
own and the ring was half of what recall added to a decode step). Elsewhere (keys and
values quantized with other bits) the region is a buffer of its own, joined to the
ring at each call, as are the calls that attend a concatenation of the ring and their
own tokens (a prefill chunk that crosses the window). Attention does not depend on
the order of its keys; the mask says which slots a row sees.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_causal_mask

from mlx_stream.cache import storage as kvstore
from mlx_stream.cache.positions import Move
from mlx_stream.errors import RuntimeFailure
from mlx_stream.mlxlm import takes_quantized_attention


def _shift_tokens(move: Move, x: mx.array, offsets: mx.array) -> mx.array:
    """``x`` (1, H, L, D) with token ``i`` moved by ``offsets[i]`` positions."""
    B, H, L, D = x.shape
    moved = move.rope(x.transpose(2, 1, 0, 3), offset=offsets).transpose(2, 1, 0, 3)
    scale = move.scale(D)
    return (moved / scale if scale != 1.0 else moved).astype(x.dtype)


class Regions:
    """Every layer's region of one tier (``tier.region``): ``top`` slots for a moved
    copy of the sinks (``stream`` placement; a ``near`` one leaves them unread),
    then ``blocks * block`` slots of recalled blocks.

    Args:
        tier: The ``Recall`` it serves (its selection, placement and store).
    """

    def __init__(self, tier):
        self.tier = tier
        L = len(tier.layers)
        self.own = [None] * L  # per layer: [keys, values] of a region of its own
        self.applied = [None] * L  # per layer: (selection, anchor, placement) it holds
        self._masks = {}  # the constant columns of a call's mask, per layout
        self._extended = None  # (what it was made from, the last call's extended mask)

    def slots(self, cache) -> int:
        """Region slots per layer: the sink copy's, then the blocks'."""
        return self.tier.lead_max(cache) + self.tier.region_slots

    def reserve(self, caches: list) -> None:
        """Ask each layer's storage for the region as slots after its ring, where it
        keeps them (before its buffers are allocated, or padded)."""
        for c in caches:
            if c.storage.tails:
                c.storage.reserve_tail(self.slots(c))

    def reset(self) -> None:
        """Every region is stale (caches restored or replaced): rebuilt at the next call."""
        self.own = [None] * len(self.tier.layers)
        self.applied = [None] * len(self.tier.layers)

    def buffers(self, cache) -> tuple:
        """``(keys, values, start)``: the buffers the region of ``cache``'s layer lives
        in, and its first slot there (allocated on first use when it has its own)."""
        st = cache.storage
        if st.tail:
            return st.keys, st.values, kvstore.length(st.keys) - st.tail
        i = cache.hook_index
        if self.own[i] is None:
            (H, kd, dtype), (_, vd, _) = self.tier.store.shapes
            bits, g = _format(cache)
            R = self.slots(cache)
            self.own[i] = [kvstore.zeros(1, H, R, kd, dtype, bits, g),
                           kvstore.zeros(1, H, R, vd, dtype, bits, g)]  # fmt: skip
        return (*self.own[i], 0)

    @property
    def nbytes(self) -> int:
        """Device bytes of the regions (fixed once allocated)."""
        total = 0
        for c, own in zip(self.tier.layers, self.own):
            if own is not None:
                total += sum(a.nbytes for _, a in tree_flatten(own))
            elif c.storage.tail and c.keys is not None:
                pair = sum(a.nbytes for _, a in tree_flatten([c.keys, c.values]))
                total += pair * c.storage.tail // kvstore.length(c.keys)
        return total

    def build(self, cache, n: int) -> None:
        """Lay the selected blocks into this layer's region for a call at ``n``
        (nothing when the selection and its place are unchanged)."""
        tier = self.tier
        sel = tier.selection
        if not sel:
            return
        i = cache.hook_index
        anchor, placement = tier.region_anchor(cache, n), tier.placement
        if self.applied[i] == (sel, anchor, placement):
            return
        bs, k, R = tier.block, tier.spec.blocks, tier.region_slots
        lead, top = tier.lead_slots(cache), tier.lead_max(cache)  # blocks start at top
        bits, g = _format(cache)
        rk, rv, base = self.buffers(cache)
        move = cache.move if cache.moving and cache.move is not None else None
        if lead:  # the sinks, moved back by the region so the blocks follow them
            cg = cache.kv_group_size
            sk = kvstore.unpack(kvstore.get(cache.keys, 0, lead), cache.key_bits, cg)
            sv = kvstore.unpack(kvstore.get(cache.values, 0, lead), cache.value_bits, cg)
            if move is not None:
                sk = move(sk, -R)
            kvstore.put(rk, base, base + lead, kvstore.pack(sk, bits, g))
            kvstore.put(rv, base, base + lead, kvstore.pack(sv, bits, g))
        # The blocks fill the last len(sel) block slots, all moved and written at once
        # (one rope and one write, not one per block: a rebuild per block boundary)
        blocks = [tier.store.get(i, j) for j in sel]
        keys, values = (mx.concatenate([b[x] for b in blocks], axis=2) for x in (0, 1))
        first = k - len(sel)
        if move is not None:  # block slot r from position anchor - R + lead + r * bs
            shift = np.repeat(anchor - R + lead + np.arange(first, k) * bs, bs)
            keys = _shift_tokens(move, keys, mx.array(shift))
        lo = base + top + first * bs
        kvstore.put(rk, lo, lo + len(sel) * bs, kvstore.pack(keys, bits, g))
        kvstore.put(rv, lo, lo + len(sel) * bs, kvstore.pack(values, bits, g))
        self.applied[i] = (sel, anchor, placement)

    def _valid(self, cache) -> np.ndarray:
        """Which region slots a row sees: the sink copy when this placement has one,
        then each selected block's own tokens."""
        tier = self.tier
        bs, k, sel = tier.block, tier.spec.blocks, tier.selection
        lead, top = tier.lead_slots(cache), tier.lead_max(cache)
        valid = np.zeros(top + tier.region_slots, bool)
        valid[:lead] = True
        for r, j in enumerate(sel, k - len(sel)):
            valid[top + r * bs + tier.first[j] : top + (r + 1) * bs] = True
        return valid

    def _columns(self, cache, gap: int, dtype) -> mx.array:
        """The constant end of a call's mask: ``gap`` unwritten ring slots, then the
        region's slots (cached per selection and layout)."""
        tier = self.tier
        key = (tier.selection, tier.lead_slots(cache), tier.lead_max(cache), gap, dtype)
        if key not in self._masks:
            cols = np.concatenate([np.zeros(gap, bool), self._valid(cache)])
            if dtype != mx.bool_:
                cols = np.where(cols, 0.0, -np.inf)
            self._masks = {key: mx.array(cols, dtype=dtype)}  # one layout at a time
        return self._masks[key]

    def attend(self, cache, queries, keys, values, scale, mask, sinks, original):
        """Attention of one layer's call over the ring and the region (built)."""
        N = queries.shape[2]
        if not isinstance(mask, mx.array):  # mlx-lm's None / "causal": every slot is written
            K = (keys[0] if isinstance(keys, tuple) else keys).shape[2]
            if mask is None:
                mask = mx.ones((N, K), dtype=mx.bool_)
            elif mask == "causal":
                mask = create_causal_mask(N, K - N)
            else:
                raise RuntimeFailure(
                    f"recall: the model gave attention a mask it cannot extend ({mask!r})"
                )
        lead = self.tier.lead_slots(cache)  # the ring's own sinks: the region's copy instead
        whole = cache.with_tail()
        if whole is not None:  # the ring's first L slots, in place: the buffer as it is
            keys, values, L, T = whole
            gap = T - L  # the ring's unwritten slots, then the region's
        else:  # a concatenation: the region's slots first, then the ring's columns
            rk, rv, base = self.buffers(cache)
            skip = self.tier.lead_max(cache) - lead  # slots of a sink copy it lacks
            lo, hi = base + skip, base + self.slots(cache)
            rk, rv = kvstore.get(rk, lo, hi), kvstore.get(rv, lo, hi)
            keys, values = _join(rk, keys, lead), _join(rv, values, lead)
            gap = None
        mask = self._extend(cache, mask, lead, gap)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def _extend(self, cache, mask: mx.array, lead: int, gap: int | None) -> mx.array:
        """``mask`` with the region's columns: after the ring's (``gap`` unwritten ring
        slots between), or before them (``gap=None``: a concatenation, the region
        first); the ring's own sinks hidden when the region holds their copy. The
        model hands every layer of a call the same mask object, so the first layer's
        result serves the others."""
        cols = self._columns(cache, gap or 0, mask.dtype)
        key = (mask, cols, lead, gap)
        last = self._extended
        if last and last[0][0] is mask and last[0][1] is cols and last[0][2:] == key[2:]:
            return last[1]
        ring = mask[..., lead:] if lead else mask
        if gap is None:
            parts = [cols[self.tier.lead_max(cache) - lead :], ring]
        else:
            parts = [_off(mask, lead), ring, cols] if lead else [ring, cols]
        shape = mask.shape[:-1]
        parts = [p if p.ndim == mask.ndim else mx.broadcast_to(p, (*shape, p.shape[-1]))
                 for p in parts]  # fmt: skip
        self._extended = (key, mx.concatenate(parts, axis=-1))
        return self._extended[1]


def _join(region, ring, lead: int):
    """The region's slots, then the ring's from ``lead`` on (storage form)."""
    if isinstance(ring, tuple):
        return tuple(mx.concatenate([a, b[:, :, lead:]], axis=2) for a, b in zip(region, ring))
    return mx.concatenate([region, ring[:, :, lead:]], axis=2)


def _off(mask: mx.array, lead: int) -> mx.array:
    """``lead`` columns no row sees, in ``mask``'s form."""
    if mask.dtype == mx.bool_:
        return mx.zeros((lead,), mx.bool_)
    return mx.full((lead,), -np.inf, mask.dtype)


def _format(cache) -> tuple:
    """``(bits, group_size)`` of the region: the cache's when attention takes its
    quantized tuples, else float."""
    if takes_quantized_attention(cache):
        return cache.bits, cache.group_size
    return None, 64
