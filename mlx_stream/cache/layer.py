"""One layer's rolling KV buffer: attention sinks + a window of recent tokens
(StreamingLLM) behind mlx-lm's prompt-cache protocol. Every query sees the first
``sinks`` tokens and the last ``window`` up to itself; positions stay bounded
(``positions="cache"``). Design: docs/cache.md.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache import qattend, variants
from mlx_stream.cache import storage as kvstore
from mlx_stream.cache.hooks import NONE, Hooks
from mlx_stream.cache.positions import Move
from mlx_stream.cache.relayout import UNKNOWN_STRIDE, Layout, Relayout
from mlx_stream.cache.ring import InPlaceRing, Ring
from mlx_stream.cache.settings import FIELDS, checked, read_json
from mlx_stream.errors import Unsupported
from mlx_stream.mlxlm import BaseCache


class SinkCache(BaseCache):
    """A fixed-size KV cache keeping ``sinks`` first tokens and a ``window`` of recent ones.

    A thin glue of four parts: the slot layout (``mlx_stream.cache.ring.Ring``), the
    storage of keys and values (``storage``: one class per variant, chosen from the
    settings by ``mlx_stream.cache.variants``), the sink moves and rebases
    (``relayout``: ``mlx_stream.cache.relayout.Relayout``, which moves positions with
    ``mlx_stream.cache.positions.Move``) and the client told of its events (``hooks``:
    ``mlx_stream.cache.hooks.Hooks``, none by default).

    Args:
        spec (CacheSpec, optional): The eight settings (``mlx_stream.cache.spec``):
            sinks, window, slack (extra ring slots: ``trim(n)`` is exact for ``n <=
            slack + 1``), stride (sinks move and the buffer rebases only at its
            multiples), positions (``"cache"``: bounded StreamingLLM positions;
            ``"absolute"``: mlx-lm's), kv_bits / key_bits / kv_group_size (keys and
            values quantized with ``mx.quantize``: keys per channel with a float
            residual, ``mlx_stream.cache.kvquant``, or per token with ``token_keys``;
            attention on the packed keys where ``mlx_stream.cache.qattend`` is proven).
            Default: ``CacheSpec()``.
        move (Move, optional): Where the layer's cached tensors carry positions
            (``make_sink_cache`` finds and verifies it). Required for
            ``positions="cache"`` once the window starts sliding.
        additive_mask (bool): Whether ``make_mask`` may return the additive (0/-inf)
            form to a model that did not ask for an array; ``False`` for models that
            combine masks themselves. Default: ``True``.
        token_keys (bool): Keep 8-bit keys per token (mlx-lm's quantized attention;
            the recall tier reads that storage). Default: ``False``.
        hooks (Hooks, optional): The client told of this layer's writes, trims and
            attention (``mlx_stream.cache.hooks``). Default: none.
    """

    def __init__(
        self,
        spec: Any = None,
        move: Move | None = None,
        *,
        additive_mask: bool = True,
        token_keys: bool = False,
        hooks: Hooks | None = None,
    ):
        self.move, self.additive_mask = move, additive_mask
        self.hooks, self.hook_index = hooks if hooks is not None else NONE, 0
        self._configure(spec if spec is not None else checked(), token_keys)

    def _configure(self, spec: Any, token_keys: bool) -> None:
        """An empty cache of ``spec`` (the constructor's, or a loaded file's)."""
        s = spec  # checked when it was made
        self.storage = variants.storage_for(s.key_bits, s.kv_bits, s.kv_group_size, s.sinks,
                                            token_keys)  # fmt: skip
        self.token_keys = token_keys and s.key_bits == 8
        self._asked_slack = s.slack  # the spec's: per-channel keys round the ring's up
        # Per-channel keys write a call into the ring before attending (their mask
        # picks float or quantized columns per row): the older in-place layout.
        ring = InPlaceRing if self.storage.in_place else Ring
        self.ring = ring(s.sinks, s.window, self.storage.ring_slack(s.window, s.slack), s.stride,
                         s.positions)  # fmt: skip
        self.relayout = Relayout(self.ring, self.storage, self.move)
        # Attention on the packed keys (mlx_stream.cache.qattend), once proven on the model
        self.fast_route = self.storage.packs and qattend.proven(self.move)
        self._last_fetched = 0  # slots the last update_and_fetch returned
        self._shared = False  # another layer reads keys_and_values (kv-shared layers)
        self._returned = None  # what a concatenating call returned, kept when shared
        self._concatenated = False  # whether the last call concatenated

    def attach(self, hooks: Hooks, index: int) -> None:
        """Make ``hooks`` this layer's client, as layer ``index`` of those it serves."""
        self.hooks, self.hook_index = hooks, index

    # ----- the storage's settings ---------------------------------------------------

    key_bits = property(lambda self: self.storage.key_bits)
    value_bits = property(lambda self: self.storage.value_bits)
    kv_group_size = property(lambda self: self.storage.kv_group_size)
    channel_keys = property(lambda self: self.storage.channel)  # kvquant.ChannelKeys storage

    @property
    def bits(self) -> int:
        """Present (``hasattr``) only where attention takes the quantized tuples as
        stored: mlx-lm routes attention to its quantized kernel on hasattr(cache, "bits")."""
        return self.storage.bits

    @property
    def group_size(self) -> int:
        return self.storage.group_size

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

    # ----- the sink moves and rebases (``relayout``) ------------------------------------

    moving = property(lambda self: self.relayout.moving)
    layout = property(lambda self: self.relayout.applied)  # the tensors' sink move and rebase
    sink_copy = property(lambda self: self.relayout.sink_copy)

    @property
    def rolls_back(self) -> bool:
        """Whether a rebase keeps what it moved (for an exact trim back across it)."""
        return self.relayout.rolls_back

    @rolls_back.setter
    def rolls_back(self, value: bool) -> None:
        self.relayout.rolls_back = value

    def needs_layout(self, n: int) -> bool:
        """Whether a call starting at token ``n`` first moves the sinks or rebases."""
        return self.relayout.needs_layout(n)

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

    def max_call_tokens(self) -> int:
        """Most tokens the next model call may feed: no overwritten token a row still
        needs, and no stride boundary where the sink/rebase layout changes (and, for
        per-channel keys, no more floats than the residual holds)."""
        ring, n = self.ring, self.tokens_seen
        limits = [ring.max_call_tokens(), self.storage.call_limit(n)]
        fill = self.sinks + self.window
        if not ring.in_place and n < fill:  # the first eviction starts a call of its own:
            limits.append(fill - n)  # the calls before it are in order (see below)
        return min(x for x in limits if x is not None)

    def _check_call(self, N: int) -> None:
        """Refuse, before anything is written, a call this cache cannot serve exactly."""
        self.ring.check_call(N)
        self.storage.check_call(self.tokens_seen, N)

    @property
    def _packed(self) -> bool:
        """Whether attention runs on the packed keys (``qattend``; a client that takes
        the attention attends on floats)."""
        return self.fast_route and not self.hooks.attends and self.storage.packs

    def forget_fetched(self) -> None:
        """What the last ``update_and_fetch`` returned is stale (its buffers changed)."""
        self._last_fetched = 0

    # ----- storage ----------------------------------------------------------------

    @property
    def keys(self):
        return self.storage.keys

    @keys.setter
    def keys(self, value) -> None:
        # mlx-lm's pipeline models set ``cache[-1].keys = mx.depends(cache[-1].keys, h)``:
        # a quantized buffer (a tuple) comes back a list.
        self.storage.keys = tuple(value) if isinstance(value, list) else value

    @property
    def values(self):
        return self.storage.values

    @values.setter
    def values(self, value) -> None:
        self.storage.values = value

    @property
    def quantized(self) -> bool:
        """Whether keys or values are stored quantized."""
        return self.value_bits is not None

    def _allocate(self, keys: mx.array, values: mx.array) -> None:
        self.storage.allocate(keys, values, self.ring)
        self.relayout.allocate(keys, values)

    # ----- mlx-lm cache protocol ---------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        N = keys.shape[2]
        ring, n = self.ring, self.ring.tokens_seen
        if N == 1 and self._steady(n):
            return self._decode_step(keys, values, n)
        self._check_call(N)
        if self.hooks is not NONE and keys.shape[0] != 1:  # at the first call, not later
            raise Unsupported(f"{self.hooks.what} serves one sequence per cache (batch 1)")
        if self.keys is None:
            self._allocate(keys, values)
        self.relayout.apply(n, N)
        self.hooks.before_write(self, n, N)  # e.g. store what leaves the window
        L = self.storage.columns(ring, N)
        packed = self.storage.pack(keys, values)
        concat = self._concatenated_call(keys, values, packed, n, N)
        self._write(keys, values, packed, n, N)
        self.storage.commit(keys, n, N, ring, self._packed)
        self.advance(N)
        self._last_fetched = L
        self._concatenated = concat is not None
        if concat is not None:
            out = self.storage.attended(*concat)
            self._returned = out if self._shared else None
            return out
        self._returned = None
        return self.storage.fetch(L, ring, self._packed, packed=True)

    def _concatenated_call(self, keys, values, packed, n: int, N: int) -> list | None:
        """What a concatenating call attends (``Ring.concatenates``), else ``None``."""
        if not self.ring.concatenates(N):
            return None
        if n < self.sinks and len(self.ring.sink_layouts(N)) > 1:
            # The later layouts' sinks are copies of sinks this call writes: write
            # them first (slots no row of this call reads from the buffer yet).
            self._write(keys, values, packed, n, N, sinks_only=True)
        # The buffer as it was (taken before the writes that follow), the later
        # layouts' sinks, then the call's own tokens: no row needs a slot this call
        # overwrites.
        spares = self.relayout.spare_sinks(n, N)
        ring_part = self.storage.ring_part
        pairs = ((ring_part(self.keys), packed[0]), (ring_part(self.values), packed[1]))
        return [
            kvstore.concat([buf, *(pair[i] for pair in spares), new])
            for i, (buf, new) in enumerate(pairs)
        ]

    def _write(self, keys, values, packed, n: int, N: int, sinks_only: bool = False) -> None:
        """Write the call's tokens into their slots (per-channel keys: values only)."""
        for s, i, length in self.ring.runs(n, N):
            if sinks_only and s >= self.sinks:
                continue
            self.storage.put(s, s + length, packed, i)
            self.relayout.record_sinks(s, length, keys, values, i)

    def advance(self, N: int) -> None:
        """Count ``N`` written tokens (after their slots were written, here or by a
        batch holding this row's buffers)."""
        self.ring.write(N)
        self.relayout.expire_undo()

    def _steady(self, n: int) -> bool:
        """Whether a one-token call at ``n`` is a plain decode step on the packed route:
        past the first eviction, in the layout already applied, nothing but its own
        slot and residual slot to write (``update_and_fetch``'s general path would do
        the same, with more bookkeeping: the step is most of decoding's Python time)."""
        return (
            self._packed
            and self.keys is not None
            and not self.ring.in_order(1)
            and not self.relayout.needs_layout(n)
        )

    def _decode_step(self, keys: mx.array, values: mx.array, n: int):
        ring = self.ring
        self.storage.step(keys, values, n, ring)
        self.advance(1)
        self._last_fetched, self._concatenated, self._returned = ring.slots_total, False, None
        return self.storage.fetch(ring.slots_total, ring, True, packed=True)

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
        L = self._last_fetched or self.ring.fetched(0)
        return self.storage.fetch(L, self.ring, self._packed)

    def tokens(self, lo: int, hi: int) -> tuple[mx.array, mx.array] | None:
        """Tokens ``lo:hi`` as float ``(keys, values)`` in stream order (no columns when
        ``hi <= lo``), or ``None`` when one of them left its slot already."""
        g = self.kv_group_size
        pairs = ((self.keys, self.key_bits), (self.values, self.value_bits))
        if hi <= lo:
            one = [kvstore.unpack(kvstore.get(b, 0, 1), bits, g) for b, bits in pairs]
            return tuple(mx.zeros_like(x[:, :, :0, :]) for x in one)
        slots = [self.ring.slot(t) for t in range(lo, hi)]
        if any(self.ring.slots[s] != t for s, t in zip(slots, range(lo, hi))):
            return None
        idx = mx.array(slots)

        def take(buf, bits):
            part = tuple(mx.take(b, idx, axis=2) for b in buf) if isinstance(buf, tuple) else (
                mx.take(buf, idx, axis=2))  # fmt: skip
            return kvstore.unpack(part, bits, g)

        return take(*pairs[0]), take(*pairs[1])

    def with_tail(self) -> tuple | None:
        """``(keys, values, L, T)``: when the last ``update_and_fetch`` returned the
        first ``L`` slots of the buffers as they are (not a concatenation), every slot
        of them, the ring's ``T`` then the storage's tail (``storage.reserve_tail``),
        as attention takes them, without a copy; else ``None``."""
        if self._concatenated or not self.storage.tail or not self._last_fetched:
            return None
        keys, values = self.storage.whole()
        return keys, values, self._last_fetched, self.ring.slots_total

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
        visible = self.storage.visible(ring, N, window_size, self._packed)
        if visible is None:  # nothing evicted yet
            return mlx_cache.create_attention_mask(
                N, offset=ring.tokens_seen, return_array=return_array, window_size=window_size
            )
        if return_array or not self.additive_mask or self.values is None:
            return mx.array(visible)  # the model combines masks (&): boolean form
        # Additive form for a model that only hands the mask to attention: MLX's CPU
        # attention adds it in one pass where a boolean mask costs a select (same
        # scores: +0 or -inf).
        return mx.array(np.where(visible, 0.0, -np.inf), dtype=self.storage.dtype)

    def _all_seen(self) -> bool:
        """Whether the next single token sees every slot: no slack (per-channel keys
        always have some), past the first eviction, no slot empty but the one it writes
        (cheaper than the mask itself)."""
        ring = self.ring
        if self.slack or ring.in_order(1) or ring.filled < self.capacity:
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
        self.storage.check_trim(ring.tokens_seen, n)
        keep = ring.tokens_seen - n
        self.rolls_back = self.rolls_back or n > 0
        if n and self.moving and self.keys is not None:
            self.relayout.trim(keep, n)
        ring.forget(n)
        self.hooks.trimmed(self, ring.tokens_seen)
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
    def meta_state(self) -> dict:
        """The eight settings (``CacheSpec``'s JSON form, with the slack asked for:
        ``slack`` is the ring's, which per-channel keys round up) and the position in
        the stream."""
        settings = (self.sinks, self.window, self._asked_slack, self.stride, self.positions,
                    self.value_bits, self.kv_group_size, self.key_bits)  # fmt: skip
        return {
            **dict(zip(FIELDS, settings)),
            "token_keys": self.token_keys,
            "tokens_seen": self.tokens_seen,
            "filled": self.ring.filled,
            "layout_applied": list(self.relayout.applied),
            "layout_stride": self.relayout.stride_index,
            "slots": self.ring.slots.tolist(),
        }

    @meta_state.setter
    def meta_state(self, meta: dict) -> None:
        s = read_json(meta)  # also a file from before kv_bits existed
        # Files from before 8-bit keys went per channel kept them per token.
        key_bits = s.get("kv_bits") if s.get("key_bits") is None else s["key_bits"]
        token_keys = meta.get("token_keys", key_bits == 8)
        self._configure(checked(**s), token_keys)
        self.ring.tokens_seen = meta["tokens_seen"]
        self.ring.filled = meta["filled"]
        self.relayout.applied = Layout(*meta["layout_applied"])
        # The stride the layout was set for: a trim back across a rebase is refused
        # after a load as it is live. A file without it: unknown, above every stride,
        # so the next call re-derives the layout and any trim that changes it is refused.
        self.relayout.stride_index = int(meta.get("layout_stride", UNKNOWN_STRIDE))
        self.ring.slots = np.array(meta["slots"], dtype=np.int64)

    def __deepcopy__(self, memo):
        # The move (and its rope) is shared: it belongs to the model. Everything else
        # is copied.
        clone = copy.copy(self)
        clone.ring = copy.deepcopy(self.ring)
        clone.storage = self.storage.copy()
        clone.relayout = self.relayout.copy(clone.ring, clone.storage)
        return clone

    # ----- mlx-lm's state: what save_cache writes ---------------------------------------

    @property
    def state(self):
        if self.keys is None:
            return []
        return self.storage.state() + self._sink_state()

    @state.setter
    def state(self, v):
        v = list(v)
        self.storage.load(v[:2], self.ring.slots_total)
        self.relayout.sink_copy = v[2] if len(v) > 2 else None

    @property
    def used_state(self):
        """``state`` with only the slots ever written (``ring.filled``): what
        ``save_cache`` writes, so a chat of 400 tokens in a 2k window saves 400 slots.
        The setter pads the rest with zeros, as they were before any write (spare sink
        slots after the ring are rewritten by every call that reads them); per-channel
        keys are kept whole."""
        if self.keys is None:
            return []
        return self.storage.used_state(self.ring.filled) + self._sink_state()

    def _sink_state(self) -> list:
        sink_copy = self.relayout.sink_copy
        return [sink_copy] if sink_copy is not None else []
