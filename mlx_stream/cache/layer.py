"""One layer's rolling KV buffer: attention sinks + a window of recent tokens
(StreamingLLM) behind mlx-lm's prompt-cache protocol. Every query sees the first
``sinks`` tokens and the last ``window`` up to itself; positions stay bounded
(``positions="cache"``). Design: docs/cache.md.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache import kvquant, qattend
from mlx_stream.cache import storage as kvstore
from mlx_stream.cache.positions import Move
from mlx_stream.cache.relayout import Layout, Relayout, Undo  # noqa: F401
from mlx_stream.cache.ring import Ring
from mlx_stream.cache.settings import validate_sizes
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.cache.stored import Stored
from mlx_stream.errors import Unsupported
from mlx_stream.mlxlm import BaseCache, takes_quantized_attention, use_quantized_attention

POSITIONS = ("cache", "absolute")


DEFAULT_SINKS = 4
DEFAULT_WINDOW = 1024
DEFAULT_STRIDE = 64
DEFAULT_SLACK = 0
UNKNOWN_STRIDE = 2**62  # a loaded layout's stride when the file does not say


class SinkCache(Relayout, Stored, BaseCache):
    """A fixed-size KV cache keeping ``sinks`` first tokens and a ``window`` of recent ones.

    A thin glue of three parts: the slot layout (``mlx_stream.cache.ring.Ring``), the
    storage of keys and values (``mlx_stream.cache.storage``: float or quantized) and the
    position mover (``mlx_stream.cache.positions.Move``: which cached part carries
    positions).

    Args:
        sinks (int): Number of first tokens kept forever. Default: ``4``.
        window (int): Number of most recent tokens each query sees. Default: ``1024``.
        slack (int): Extra ring slots for rollback: ``trim(n)`` is exact for ``n <=
            slack + 1`` (a speculative verify block needs ``num_draft_tokens + 1``).
            A multi-token call attends over the buffer as it was before it plus its
            own tokens, so it needs no slack; a single-token step attends over
            ``sinks + window + slack`` slots (with ``slack=0`` all of them visible:
            no mask, as mlx-lm's rotating cache). Default: ``0``.
        stride (int): Sinks move and the buffer rebases only at multiples of this
            token index. Default: ``64``.
        rope (nn.Module, optional): Shorthand for ``move=Move(0, rope)``: the layer's
            rope rotated all of the keys.
        positions (str): ``"cache"`` (bounded StreamingLLM positions) or
            ``"absolute"`` (mlx-lm's behaviour: positions grow with the stream).
            Default: ``"cache"``.
        kv_bits (int, optional): Store keys and values quantized to 4 or 8 bits with
            ``mx.quantize``. 8-bit keys and values are grouped per token (attention then
            runs mlx-lm's quantized path); 4-bit keys are grouped per channel along the
            tokens with a float residual of the newest tokens (``mlx_stream.cache.kvquant``:
            ``slack`` is rounded up to fit its groups) and attention runs on dequantized
            floats. Sinks are re-derived from a full-precision copy whenever they move.
            8-bit keys are per channel too (unless ``token_keys``): attention then runs
            on the packed keys where ``mlx_stream.cache.qattend`` is installed, else on
            dequantized floats. Default: ``None``.
        kv_group_size (int): Quantization group size (32, 64 or 128; divides the
            head dimension). Default: ``64``.
        key_bits (int, optional): Bits for the keys when they differ from ``kv_bits``
            (keys carry most of the quantization error: 8-bit keys with 4-bit values
            cost little perplexity). Attention then runs on dequantized float keys and
            values. Default: ``kv_bits``.
        move (Move, optional): Where the layer's cached tensors carry positions
            (``make_sink_cache`` finds and verifies it). Required for
            ``positions="cache"`` once the window starts sliding.
        additive_mask (bool): Whether ``make_mask`` may return the additive (0/-inf)
            form to a model that did not ask for an array; ``False`` for models that
            combine masks themselves. Default: ``True``.
        token_keys (bool): Keep 8-bit keys per token (mlx-lm's quantized attention;
            the recall tier reads that storage). Default: ``False``.
    """

    def __init__(
        self,
        sinks: int = DEFAULT_SINKS,
        window: int = DEFAULT_WINDOW,
        slack: int = DEFAULT_SLACK,
        stride: int = DEFAULT_STRIDE,
        rope: nn.Module | None = None,
        positions: str = "cache",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        key_bits: int | None = None,
        move: Move | None = None,
        additive_mask: bool = True,
        token_keys: bool = False,
    ):
        key_bits = kv_bits if key_bits is None else key_bits
        validate_sizes(sinks, window, slack, stride, positions, kv_bits, kv_group_size, key_bits)
        # kvquant.ChannelKeys storage
        self.channel_keys = kvquant.per_channel(key_bits, token_keys)
        self.token_keys = token_keys and key_bits == 8
        self._asked_slack = slack  # the spec's: per-channel keys round the ring's up
        slack = kvquant.ring_slack(window, slack, key_bits, token_keys)
        # Per-channel keys write a call into the ring before attending (their mask
        # picks float or quantized columns per row): the older in-place layout.
        self.ring = Ring(sinks, window, slack, stride, positions, in_place=self.channel_keys)
        self.move = move if move is not None else (Move(0, rope) if rope is not None else None)
        # Attention on the packed keys (mlx_stream.cache.qattend), once proven on the model
        self.fast_route = self.channel_keys and qattend.proven(self.move)
        self.additive_mask = additive_mask
        self.keys = None
        self.values = None
        self.sink_copy = None  # the moved slot's sinks as first written (full precision)
        self._layout_applied = Layout(0, 0)  # the layout the stored tensors are in
        self._layout_stride = -1  # stride index (token // stride) the layout was set for
        self._undo: Undo | None = None  # the layout before the last rebase, to trim back
        # Keep that copy only once the cache has been rolled back (speculative decoding):
        # plain decoding never trims and keeps its memory flat.
        self.rolls_back = False  # keep what a rebase moved, for an exact trim back
        self._last_fetched = 0  # slots the last update_and_fetch returned
        self._recent_slots = None  # per-channel keys: value slot of each residual column
        self._shared = False  # another layer reads keys_and_values (kv-shared layers)
        self._returned = None  # what a concatenating call returned, kept when shared
        self._concatenated = False  # whether the last call concatenated
        self.kv_group_size = kv_group_size
        self.key_bits, self.value_bits = key_bits, kv_bits
        if kv_bits is not None and key_bits == kv_bits and not self.channel_keys:
            # Only a cache that returns quantized tuples has ``bits``: mlx-lm routes
            # attention to its quantized kernel on hasattr(cache, "bits").
            use_quantized_attention(self, kv_bits, kv_group_size)

    # ----- the layout's numbers -----------------------------------------------------

    sinks = property(lambda self: self.ring.sinks)
    window = property(lambda self: self.ring.window)
    slack = property(lambda self: self.ring.slack)
    stride = property(lambda self: self.ring.stride)
    positions = property(lambda self: self.ring.positions)
    capacity = property(lambda self: self.ring.capacity)

    @property
    def rebase_every(self) -> int:
        return self.ring.rebase_every

    @rebase_every.setter
    def rebase_every(self, value: int) -> None:
        self.ring.rebase_every = value

    @property
    def tokens_seen(self) -> int:
        return self.ring.tokens_seen

    recall = None  # the recall tier (mlx_stream.recall) this layer feeds, if any
    recall_index = 0  # this layer's index among the tier's layers

    @property
    def rope(self) -> nn.Module | None:
        return self.move.rope if self.move is not None else None

    @property
    def offset(self) -> int:
        """RoPE position of the next token (``< max_offset`` for ``positions="cache"``)."""
        return self.ring.offset

    @property
    def max_offset(self) -> int:
        """Upper bound of ``offset`` (exclusive) when ``positions="cache"``."""
        return self.ring.max_offset

    def _layout(self, n: int) -> tuple[int, int]:
        return self.ring.layout(n)

    def max_call_tokens(self) -> int:
        """Most tokens the next model call may feed: no overwritten token a row still
        needs, and no stride boundary where the sink/rebase layout changes (and, for
        per-channel keys, no more floats than the residual holds)."""
        if self.channel_keys:
            limit = kvquant.call_limit(self.tokens_seen, self.sinks)
            return min(self.ring.max_call_tokens(), limit)
        n, fill = self.tokens_seen, self.sinks + self.window
        if n < fill:  # the first eviction starts a call of its own: the calls before it
            return min(self.ring.max_call_tokens(), fill - n)  # are in order (see below)
        return self.ring.max_call_tokens()

    def _check_call(self, N: int) -> None:
        """Refuse, before anything is written, a call this cache cannot serve exactly."""
        self.ring.check_call(N)
        n = self.tokens_seen
        if self.channel_keys and N > kvquant.call_limit(n, self.sinks):
            raise Unsupported(
                f"a call of {N} tokens at token {n} needs more float keys than "
                f"{self.key_bits}-bit keys "
                f"keep (at most {kvquant.call_limit(n, self.sinks)} here); feed at most "
                "max_call_tokens() tokens"
            )

    @property
    def _packed(self) -> bool:
        """Whether attention runs on the packed keys (``qattend``; the recall tier
        attends on floats)."""
        return self.fast_route and self.recall is None

    #: The last ``_residual_slots`` answer: every layer of a model asks the same at a step.
    _residual_memo: tuple = (None, None)

    def _residual(self, n: int, N: int) -> tuple[int, int, np.ndarray, int | None]:
        """The residual columns ``lo:hi`` a call at ``n`` attends, the value slot of the
        token each holds, and (``qattend``'s single-token step) the first of the
        contiguous slots their keys are spliced into, else ``None``."""
        S, R = self.sinks, self.capacity - self.sinks
        lo, hi = kvquant.recent_range(n, N, S)
        tokens = kvquant.recent_tokens(n, N, S)[lo:hi]
        slots = np.where(tokens >= S, S + (tokens - S) % R, 0)  # Ring.slot, or 0 for none
        splice = None
        if self._packed and N == 1 and hi > lo and slots[-1] - slots[0] == hi - lo - 1:
            splice = int(slots[0])
        return lo, hi, slots, splice

    def _residual_slots(self, n: int, N: int) -> tuple[int, int, mx.array, int | None]:
        key = (self.sinks, self.capacity, n, N, self._packed)
        memo = SinkCache._residual_memo
        if memo[0] != key:
            lo, hi, slots, splice = self._residual(n, N)
            memo = SinkCache._residual_memo = (key, (lo, hi, mx.array(slots, mx.int32), splice))
        return memo[1]

    def _channel_mask(self, N: int, window_size: int | None) -> np.ndarray:
        """The boolean mask over every slot and the float residual (per-channel keys)."""
        ring, n = self.ring, self.tokens_seen
        seen = ring.visible(N, window_size)
        visible = np.zeros((N, ring.slots_total), dtype=bool)
        visible[:, : seen.shape[1]] = seen
        if N == 1 and self._packed and not ring.in_order(1):
            # A decode step sees its open group's floats in their own slots: its mask
            # is the ring's (tests/test_qattend.py checks it against the general form, step by step).
            return visible
        slots = ring.slots.copy()
        for slot, i, length in ring.runs(n, N):
            slots[slot : slot + length] = np.arange(n + i, n + i + length)
        mask = kvquant.mask(visible, slots, n, self.sinks, self.window, window_size)
        lo, hi, _, splice = self._residual(n, N)
        if splice is None:
            return mask
        # qattend splices the residual keys into their own slots: one column a token.
        L = ring.slots_total
        out = mask[:, :L].copy()
        out[:, splice : splice + hi - lo] |= mask[:, L:]
        return out

    def forget_fetched(self) -> None:
        """What the last ``update_and_fetch`` returned is stale (its buffers changed)."""
        self._last_fetched = 0

    def _attended(self, keys, values):
        """Storage-form keys and values as attention takes them (mixed bits: floats)."""
        if self.quantized and not takes_quantized_attention(self):
            g = self.kv_group_size
            return kvstore.unpack(keys, self.key_bits, g), kvstore.unpack(
                values, self.value_bits, g
            )
        return keys, values

    # ----- storage ----------------------------------------------------------------

    @property
    def keys(self):
        return self._keys

    @keys.setter
    def keys(self, value) -> None:
        # mlx-lm's pipeline models set ``cache[-1].keys = mx.depends(cache[-1].keys, h)``:
        # a quantized buffer (a tuple) comes back a list.
        self._keys = tuple(value) if isinstance(value, list) else value

    @property
    def quantized(self) -> bool:
        """Whether keys or values are stored quantized."""
        return self.value_bits is not None

    def _allocate(self, keys: mx.array, values: mx.array) -> None:
        B, H, _, D = keys.shape
        if self.quantized and (D % self.kv_group_size or values.shape[-1] % self.kv_group_size):
            raise Unsupported(
                f"kv_group_size {self.kv_group_size} does not divide the head dimension "
                f"{D if D % self.kv_group_size else values.shape[-1]}; use a group size "
                "that does"
            )
        g, L = self.kv_group_size, self.ring.slots_total
        if self.channel_keys:
            R = self.capacity - self.sinks
            self.keys = kvquant.ChannelKeys.zeros(
                B, H, L, R, D, keys.dtype, self.sinks, self.key_bits
            )
        else:
            self.keys = kvstore.zeros(B, H, L, D, keys.dtype, self.key_bits, g)
        self.values = kvstore.zeros(
            B, values.shape[1], L, values.shape[-1], values.dtype, self.value_bits, g
        )
        if self.sinks > 0 and self.moving:
            slot = self.move.slot if self.move is not None else 0
            x = (keys, values)[slot]
            self.sink_copy = mx.zeros((B, x.shape[1], self.sinks, x.shape[-1]), x.dtype)

    # ----- mlx-lm cache protocol ---------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        N = keys.shape[2]
        ring, g = self.ring, self.kv_group_size
        n = ring.tokens_seen
        if N == 1 and self._steady(n):
            return self._decode_step(keys, values, n)
        self._check_call(N)
        if self.recall is not None and keys.shape[0] != 1:  # at the first call, not later
            raise Unsupported("recall serves one sequence per cache (batch 1)")
        if self.keys is None:
            self._allocate(keys, values)
        self.apply_layout(n, N)
        if self.recall is not None:  # store what leaves the window before it is overwritten
            self.recall.before_write(self, n, N)
        L = ring.fetched(N)
        channel = self.channel_keys
        packed_keys = None if channel else kvstore.pack(keys, self.key_bits, g)
        packed_values = kvstore.pack(values, self.value_bits, g)
        concat = None
        if ring.concatenates(N):
            if n < self.sinks and len(ring.sink_layouts(N)) > 1:
                # The later layouts' sinks are copies of sinks this call writes: write
                # them first (slots no row of this call reads from the buffer yet).
                self._write(keys, values, packed_keys, packed_values, n, N, sinks_only=True)
            # The buffer as it was (taken before the writes below), the later layouts'
            # sinks, then the call's own tokens: no row needs a slot this call overwrites.
            spares = self._spare_sinks(n, N)
            pairs = ((self.keys, packed_keys), (self.values, packed_values))
            concat = [
                kvstore.concat([buf, *(pair[i] for pair in spares), new])
                for i, (buf, new) in enumerate(pairs)
            ]
        self._write(keys, values, packed_keys, packed_values, n, N)
        if channel:
            self.keys.write(keys, n)
            self._recent_slots = self._residual_slots(n, N)
            L = ring.slots_total
        ring.write(N)
        self.expire_undo()
        self._last_fetched = L
        self._concatenated = concat is not None
        if concat is not None:
            out = self._attended(*concat)
            self._returned = out if self._shared else None
            return out
        self._returned = None
        return self._fetch(L, packed=self._packed)

    def _write(self, keys, values, packed_keys, packed_values, n: int, N: int,
               sinks_only: bool = False) -> None:  # fmt: skip
        """Write the call's tokens into their slots (per-channel keys: values only)."""
        slot = self.move.slot if self.move is not None and self.move.moves else 0
        for s, i, length in self.ring.runs(n, N):
            if sinks_only and s >= self.sinks:
                continue
            if not self.channel_keys:
                kvstore.put(self.keys, s, s + length, packed_keys, i)
            kvstore.put(self.values, s, s + length, packed_values, i)
            if s < self.sinks and self.sink_copy is not None:
                kvstore.put(self.sink_copy, s, s + length, (keys, values)[slot], i)

    def _steady(self, n: int) -> bool:
        """Whether a one-token call at ``n`` is a plain decode step on the packed route:
        past the first eviction, in the layout already applied, nothing but its own
        slot and residual slot to write (``update_and_fetch``'s general path would do
        the same, with more bookkeeping: the step is most of decoding's Python time)."""
        return (
            self._packed
            and self.keys is not None
            and not self.ring.in_order(1)
            and (not self.moving or n // self.ring.stride == self._layout_stride)
        )

    def _decode_step(self, keys: mx.array, values: mx.array, n: int):
        ring = self.ring
        s = ring.slot(n)
        kvstore.put(
            self.values, s, s + 1, kvstore.pack(values, self.value_bits, self.kv_group_size)
        )
        self.keys.write_one(keys, n)
        self._recent_slots = self._residual_slots(n, 1)
        ring.write(1)
        self.expire_undo()
        self._last_fetched, self._concatenated, self._returned = ring.slots_total, False, None
        return self._fetch(ring.slots_total, packed=True)

    def _fetch(self, L: int, packed: bool = False):
        """The first ``L`` slots of keys and values, as attention takes them (``packed``:
        per-channel keys as ``qattend``'s packed form)."""
        g = self.kv_group_size
        if self.channel_keys:
            # Per-channel keys: keys for every slot and the residual columns; the
            # residual columns' values are the same tokens' values, gathered.
            if self._recent_slots is None:  # loaded, not yet called
                self._recent_slots = self._residual_slots(self.tokens_seen, 0)
            lo, hi, idx, splice = self._recent_slots
            if self._packed:
                pair = qattend.pack(self.keys, self.values, lo, hi, idx, splice,
                                    self.value_bits, g)  # fmt: skip
                return pair if packed else qattend.unpack(*pair)
            values = kvstore.unpack(self.values, self.value_bits, g)
            recent = mx.take(values, idx, axis=2)
            return self.keys.fetch(lo, hi), mx.concatenate([values, recent], axis=2)
        keys, values = kvstore.get(self.keys, 0, L), kvstore.get(self.values, 0, L)
        if self.quantized and not takes_quantized_attention(self):
            # Mixed key/value bits: attention runs on dequantized floats.
            return kvstore.unpack(keys, self.key_bits, g), kvstore.unpack(
                values, self.value_bits, g
            )
        return keys, values

    def keys_and_values(self):
        """The keys and values the last ``update_and_fetch`` returned."""
        # Kept from the next concatenating call on: only models whose layers share a
        # cache ask, and a buffer-sized copy per layer is not kept for the others.
        self._shared = True
        if self._returned is not None:
            return self._returned
        if self._concatenated:  # a foreign loop's first call went past the window
            raise Unsupported(
                "a layer sharing this cache read it after a call that went past the window "
                "before any in-order call; feed at most max_call_tokens() tokens per call"
            )
        if self.keys is None:
            return None, None
        return self._fetch(self._last_fetched or self.ring.fetched(0))

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """The mask for the next ``N`` tokens, describing the buffer after they are
        written. Before the first eviction it is mlx-lm's own causal mask; after it, a
        boolean array when ``return_array`` or when the model combines masks itself
        (``additive_mask=False``), else the same mask in additive form (0 or -inf, the
        cache's dtype)."""
        ring = self.ring
        self._check_call(N)  # refuse before any layer of the model is touched
        if N == 1 and window_size is None and self._all_seen():
            return None  # every slot is seen (slack 0): no mask, as mlx-lm's own
        if self.channel_keys:
            visible = self._channel_mask(N, window_size)
        elif ring.in_order(N):
            return mlx_cache.create_attention_mask(
                N, offset=ring.tokens_seen, return_array=return_array, window_size=window_size
            )
        else:
            visible = ring.visible(N, window_size)
        if return_array or not self.additive_mask or self.values is None:
            return mx.array(visible)  # the model combines masks (&): boolean form
        # Additive form for a model that only hands the mask to attention: MLX's CPU
        # attention adds it in one pass where a boolean mask costs a select; same
        # scores (+0 or -inf); decode attention 1.15x -> 1.13x mlx-lm's rotating cache
        # at window 1024 here (benchmarks/attention.py).
        dtype = kvstore.dtype_of(self.values)
        return mx.array(np.where(visible, 0.0, -np.inf), dtype=dtype)

    def _all_seen(self) -> bool:
        """Whether the next single token sees every slot: no slack, past the first
        eviction, no slot empty but the one it writes (cheaper than the mask itself)."""
        ring = self.ring
        if self.slack or self.channel_keys or ring.in_order(1) or ring.filled < self.capacity:
            return False
        empty = np.flatnonzero(ring.slots < 0)
        return len(empty) == 0 or (len(empty) == 1 and empty[0] == ring.slot(ring.tokens_seen))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens, restoring exactly the state before they were
        added (also across a sink move or a rebase). Exact for ``n <= slack + 1`` at
        any point of the stream; a deeper rollback is refused, and so is one back across
        a rebase that happened before the cache was first trimmed (the tensors the
        rebase moved are kept only once a cache rolls back)."""
        ring = self.ring
        n = ring.check_trim(n)
        if self.channel_keys and not kvquant.trim_limit(ring.tokens_seen, self.sinks, n):
            raise Unsupported(
                f"cannot trim {n} tokens exactly: {self.key_bits}-bit keys keep the floats "
                "of the last "
                f"{kvquant.RECENT} tokens only, and this rollback reopens a group older "
                "than that"
            )
        keep = ring.tokens_seen - n
        self.rolls_back = self.rolls_back or n > 0
        if n and self.moving and self.keys is not None:
            self._trim_layout(keep, n)
        ring.forget(n)
        if self.recall is not None:
            self.recall.trimmed(self, ring.tokens_seen)
        return n

    def size(self) -> int:
        """Tokens the next query sees (at most ``sinks + window``)."""
        return min(self.tokens_seen, self.sinks + self.window)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in tree_flatten(self.state))

    @property
    def spec(self) -> CacheSpec:
        """The cache's policy as one value (the slack asked for: ``slack`` is the ring's,
        which per-channel keys round up)."""
        return CacheSpec(self.sinks, self.window, self._asked_slack, self.stride, self.positions,
                         self.value_bits, self.kv_group_size, self.key_bits)  # fmt: skip

    @property
    def meta_state(self) -> dict:
        return {
            **self.spec.to_json(),
            "token_keys": self.token_keys,
            "tokens_seen": self.tokens_seen,
            "filled": self.ring.filled,
            "layout_applied": list(self._layout_applied),
            "layout_stride": self._layout_stride,
            "slots": self.ring.slots.tolist(),
        }

    @meta_state.setter
    def meta_state(self, meta: dict) -> None:
        s = CacheSpec.from_json(meta)  # also a file from before kv_bits existed
        # Files from before 8-bit keys went per channel kept them per token.
        token_keys = meta.get("token_keys", s.key_bits == 8)
        self.__init__(
            s.sinks, s.window, s.slack, s.stride, None, s.positions, s.kv_bits,
            s.kv_group_size, s.key_bits, self.move, self.additive_mask, token_keys,
        )  # fmt: skip
        self.ring.tokens_seen = meta["tokens_seen"]
        self.ring.filled = meta["filled"]
        self._layout_applied = Layout(*meta["layout_applied"])
        # The stride the layout was set for: a trim back across a rebase is refused
        # after a load as it is live. A file without it: unknown, above every stride,
        # so the next call re-derives the layout and any trim that changes it is refused.
        self._layout_stride = int(meta.get("layout_stride", UNKNOWN_STRIDE))
        self.ring.slots = np.array(meta["slots"], dtype=np.int64)

    def __deepcopy__(self, memo):
        # The move (and its rope) is shared: it belongs to the model. Everything else
        # is copied.
        clone = copy.copy(self)
        clone.ring = copy.deepcopy(self.ring)
        for name in ("keys", "values", "sink_copy"):
            setattr(clone, name, kvstore.copy(getattr(self, name)))
        if self._undo is not None:  # a trim adopts this buffer and writes it in place
            clone._undo = self._undo._replace(moved=kvstore.copy(self._undo.moved))  # noqa: SLF001
        return clone
