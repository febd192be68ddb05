"""The storage of a SinkCache layer whose keys are quantized per channel
(``kvquant.ChannelKeys``: float sinks, 4- or 8-bit ring groups, a float residual of the
newest tokens), with its mask over the residual columns and its packed attention form
(``mlx_stream.cache.qattend``). Speaks ``storage.SlotStorage``'s protocol; values stay
slot-wise (float or quantized per token). Scheme and contract: ``cache.kvquant``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_stream.cache import kvquant, qattend
from mlx_stream.cache import storage as kvstore
from mlx_stream.cache.storage import SlotStorage
from mlx_stream.errors import Unsupported


class ChannelStorage(SlotStorage):
    """Per-channel keys and slot-wise values (see the module docstring). ``recent``:
    the residual columns the last call attended (``_residual_slots``' answer)."""

    channel = in_place = packs = True
    #: The last ``_residual_slots`` answer: every layer of a model asks the same at a step.
    _memo: tuple = (None, None)

    def __init__(self, key_bits: int, value_bits: int | None, kv_group_size: int, sinks: int):
        super().__init__(key_bits, value_bits, kv_group_size, sinks)
        self.recent = None

    # ----- sizes ----------------------------------------------------------------------

    def ring_slack(self, window: int, slack: int) -> int:
        return kvquant.ring_slack(window, slack, self.key_bits)

    def call_limit(self, n: int) -> int:
        """No more floats than the residual holds."""
        return kvquant.call_limit(n, self.sinks)

    def check_call(self, n: int, N: int) -> None:
        limit = kvquant.call_limit(n, self.sinks)
        if N > limit:
            raise Unsupported(
                f"a call of {N} tokens at token {n} needs more float keys than "
                f"{self.key_bits}-bit keys keep (at most {limit} here); feed at most "
                "max_call_tokens() tokens"
            )

    def check_trim(self, tokens_seen: int, n: int) -> None:
        if not kvquant.trim_limit(tokens_seen, self.sinks, n):
            raise Unsupported(
                f"cannot trim {n} tokens exactly: {self.key_bits}-bit keys keep the floats "
                f"of the last {kvquant.RECENT} tokens only, and this rollback reopens a "
                "group older than that"
            )

    # ----- writes ---------------------------------------------------------------------

    def _new_keys(self, keys: mx.array, ring):
        B, H, _, D = keys.shape
        R = ring.capacity - self.sinks
        return kvquant.ChannelKeys.zeros(B, H, ring.slots_total, R, D, keys.dtype, self.sinks,
                                         self.key_bits)  # fmt: skip

    def pack(self, keys: mx.array, values: mx.array) -> tuple:
        """Values only: keys are written by ``commit``."""
        return None, kvstore.pack(values, self.value_bits, self.kv_group_size)

    def put(self, start: int, stop: int, packed: tuple, src_start: int = 0) -> None:
        kvstore.put(self.values, start, stop, packed[1], src_start)

    def commit(self, keys: mx.array, n: int, N: int, ring, route: bool) -> None:
        """The call's keys: sinks in float, ring tokens into the residual, every group
        they complete quantized into the ring."""
        self.keys.write(keys, n)
        self.recent = self._residual_slots(ring, n, N, route)

    def step(self, keys: mx.array, values: mx.array, n: int, ring) -> None:
        """A plain decode step on the packed route: token ``n``'s value slot, its key."""
        s = ring.slot(n)
        kvstore.put(self.values, s, s + 1,
                    kvstore.pack(values, self.value_bits, self.kv_group_size))  # fmt: skip
        self.keys.write_one(keys, n)
        self.recent = self._residual_slots(ring, n, 1, True)

    # ----- moves ----------------------------------------------------------------------

    def bits_of(self, slot: int) -> int | None:
        """The key slots (sinks, spare sinks) are float."""
        return None if slot == 0 else self.value_bits

    def rotate(self, slot: int, start: int, stop: int, shift) -> None:
        """Keys: the whole ring and residual (dequantized, moved, quantized again)."""
        if slot == 0:
            self.keys.shift_ring(shift)
        else:
            super().rotate(slot, start, stop, shift)

    # ----- attention ------------------------------------------------------------------

    def columns(self, ring, N: int) -> int:
        return ring.slots_total

    def _residual(self, ring, n: int, N: int, route: bool):
        """The residual columns ``lo:hi`` a call at ``n`` attends, the value slot of the
        token each holds, and (``qattend``'s single-token step) the first of the
        contiguous slots their keys are spliced into, else ``None``."""
        S, R = self.sinks, ring.capacity - self.sinks
        lo, hi = kvquant.recent_range(n, N, S)
        tokens = kvquant.recent_tokens(n, N, S)[lo:hi]
        slots = np.where(tokens >= S, S + (tokens - S) % R, 0)  # Ring.slot, or 0 for none
        splice = None
        if route and N == 1 and hi > lo and slots[-1] - slots[0] == hi - lo - 1:
            splice = int(slots[0])
        return lo, hi, slots, splice

    def _residual_slots(self, ring, n: int, N: int, route: bool):
        key = (self.sinks, ring.capacity, n, N, route)
        memo = ChannelStorage._memo
        if memo[0] != key:
            lo, hi, slots, splice = self._residual(ring, n, N, route)
            memo = ChannelStorage._memo = (key, (lo, hi, mx.array(slots, mx.int32), splice))
        return memo[1]

    def visible(self, ring, N: int, window_size: int | None, route: bool) -> np.ndarray:
        """The boolean mask over every slot and the float residual."""
        n = ring.tokens_seen
        seen = ring.visible(N, window_size)
        visible = np.zeros((N, ring.slots_total), dtype=bool)
        visible[:, : seen.shape[1]] = seen
        if N == 1 and route and not ring.in_order(1):
            # A decode step sees its open group's floats in their own slots: its mask
            # is the ring's (tests/test_qattend.py checks it against the general form, step by step).
            return visible
        slots = ring.slots.copy()
        for slot, i, length in ring.runs(n, N):
            slots[slot : slot + length] = np.arange(n + i, n + i + length)
        mask = kvquant.mask(visible, slots, n, self.sinks, ring.window, window_size)
        lo, hi, _, splice = self._residual(ring, n, N, route)
        if splice is None:
            return mask
        # qattend splices the residual keys into their own slots: one column a token.
        L = ring.slots_total
        out = mask[:, :L].copy()
        out[:, splice : splice + hi - lo] |= mask[:, L:]
        return out

    def fetch(self, L: int, ring, route: bool, packed: bool = False) -> tuple:
        """Keys for every slot and the residual columns; the residual columns' values
        are the same tokens' values, gathered (``route``: through ``qattend``'s packed
        pair, returned as it is when ``packed``)."""
        g = self.kv_group_size
        if self.recent is None:  # loaded, not yet called
            self.recent = self._residual_slots(ring, ring.tokens_seen, 0, route)
        lo, hi, idx, splice = self.recent
        if route:
            pair = qattend.pack(self.keys, self.values, lo, hi, idx, splice, self.value_bits, g)
            return pair if packed else qattend.unpack(*pair)
        values = kvstore.unpack(self.values, self.value_bits, g)
        recent = mx.take(values, idx, axis=2)
        return self.keys.fetch(lo, hi), mx.concatenate([values, recent], axis=2)

    # ----- state ----------------------------------------------------------------------

    def state(self) -> list:
        return [self.keys.state, self.values]

    def used_state(self, filled: int) -> list:
        """The keys whole (their groups follow the ring, not the slots written)."""
        return [self.keys.state, self._used(self.values, filled)]

    def load(self, state: list, slots_total: int) -> None:
        if not isinstance(state[0], dict):
            raise Unsupported(
                f"this cache was saved with per-token {self.key_bits}-bit keys, which "
                f"mlx-stream no longer reads ({self.key_bits}-bit keys are now per "
                "channel): start the session again"
            )
        self.keys = kvquant.ChannelKeys.from_state(state[0], self.sinks, self.key_bits)
        values = tuple(state[1]) if self.value_bits else state[1]
        self.values = kvstore.fit(values, slots_total)
