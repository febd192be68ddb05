"""Slot-indexed storage of one cached tensor: a float array ``(B, H, slots, D)``, or
mlx's quantized triple ``(packed, scales, biases)`` with the same slot axis; and the
storage classes of a SinkCache layer behind one protocol (:class:`SlotStorage`).

``bits=None`` means float. Every function takes and returns the storage form, so the
cache never branches on ``isinstance(tuple)`` itself. Per-channel keys
(``mlx_stream.cache.kvquant.ChannelKeys``) answer ``get``/``put`` for their float sink slots,
``length`` and ``copy`` here too; their storage class is ``cache.channel.ChannelStorage``.
"""

from __future__ import annotations

import copy as _copy

import mlx.core as mx

from mlx_stream.cache.kvquant import ChannelKeys
from mlx_stream.errors import Unsupported


def pack(x: mx.array, bits: int | None, group_size: int):
    """``x`` in storage form."""
    if bits is None:
        return x
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def unpack(x, bits: int | None, group_size: int) -> mx.array:
    """Storage ``x`` as a float array."""
    if bits is None:
        return x
    return mx.dequantize(*x, group_size=group_size, bits=bits)


def zeros(B: int, H: int, slots: int, D: int, dtype, bits: int | None, group_size: int):
    return pack(mx.zeros((B, H, slots, D), dtype), bits, group_size)


def length(buf) -> int:
    """Number of slots of ``buf``."""
    if isinstance(buf, ChannelKeys):
        return buf.slots
    return (buf[0] if isinstance(buf, tuple) else buf).shape[-2]


def dtype_of(buf):
    """The float dtype of ``buf`` (the scales' dtype when quantized)."""
    return buf[1].dtype if isinstance(buf, tuple) else buf.dtype


def get(buf, start: int, stop: int):
    """Slots ``start:stop`` of ``buf`` (the buffer itself when that is all of it)."""
    if isinstance(buf, ChannelKeys):
        return buf.get(start, stop)
    if start == 0 and stop == length(buf):
        return buf  # the whole buffer: no slice op in the decode graph
    if isinstance(buf, tuple):
        return tuple(b[..., start:stop, :] for b in buf)
    return buf[..., start:stop, :]


def put(buf, start: int, stop: int, src, src_start: int = 0) -> None:
    """Write ``src[src_start : src_start + stop - start]`` into slots ``start:stop``."""
    if isinstance(buf, ChannelKeys):
        return buf.put(start, stop, src, src_start)
    n = stop - start
    pairs = zip(buf, src) if isinstance(buf, tuple) else ((buf, src),)
    for b, x in pairs:
        whole = src_start == 0 and x.shape[-2] == n  # no slice op on the decode path
        b[..., start:stop, :] = x if whole else x[..., src_start : src_start + n, :]


def concat(parts: list):
    """Storage-form buffers joined along the slot axis."""
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate([p[i] for p in parts], axis=-2) for i in range(len(parts[0])))
    return mx.concatenate(parts, axis=-2)


def copy(buf):
    """An independent copy of ``buf`` (later in-place writes to ``buf`` do not show)."""
    if buf is None:
        return None
    if isinstance(buf, ChannelKeys):
        return buf.copy()
    if isinstance(buf, tuple):
        return tuple(mx.array(b) for b in buf)
    return mx.array(buf)


class SlotStorage:
    """The keys and values of one SinkCache layer (``SinkCache.storage``), slot by
    slot, float or quantized per token: the storage protocol every variant speaks
    (``mlx_stream.cache.variants`` picks the class from the cache's settings).

    The protocol: sizes (``ring_slack``, ``in_place``, ``call_limit``, ``check_call``,
    ``check_trim``, ``tails``/``reserve_tail``/``ring_part``), writes (``allocate``,
    ``pack``, ``put``, ``commit``), moves (``bits_of``, ``floats``, ``rotate``),
    attention (``columns``, ``visible``, ``fetch``, ``attended``, ``whole``) and state
    (``state``, ``used_state``, ``load``, ``copy``).
    ``ring`` arguments are the cache's ``mlx_stream.cache.ring.Ring``; ``route``: whether
    the cache attends on packed keys (``packs`` variants only).

    Args:
        key_bits, value_bits (int, optional): Bits of the keys and values (``None``:
            float).
        kv_group_size (int): Quantization group size of the slot-wise tensors.
        sinks (int): The cache's sink slots.
    """

    channel = False  # keys kept per channel (``kvquant.ChannelKeys``)
    tails = False  # may keep slots after the ring for an extension (``reserve_tail``)
    in_place = False  # calls written into the ring before attention (``ring.InPlaceRing``)
    packs = False  # attention may run on the packed keys (``mlx_stream.cache.qattend``)

    def __init__(self, key_bits: int | None, value_bits: int | None, kv_group_size: int,
                 sinks: int):  # fmt: skip
        self.key_bits, self.value_bits = key_bits, value_bits
        self.kv_group_size, self.sinks = kv_group_size, sinks
        self.keys = self.values = None
        self.tail = 0  # slots after the ring an extension writes (the recall region)

    # ----- sizes ----------------------------------------------------------------------

    def ring_slack(self, window: int, slack: int) -> int:
        """The ring's slack for a cache asked for ``slack``."""
        return slack

    def reserve_tail(self, slots: int) -> None:
        """Keep ``slots`` slots after the ring's, written by an extension (the recall
        tier's region, so attention reads the ring and them as one buffer, without a
        copy): allocated with the buffers, never saved (``state``), never counted in
        the cache's bytes (``nbytes`` reads ``state``)."""
        if not self.tails:
            raise Unsupported(f"{type(self).__name__} keeps no slots after its ring")
        if self.keys is not None:  # already allocated: pad (or cut) to the new tail
            T = length(self.keys) - self.tail
            self.keys, self.values = fit(self.keys, T + slots), fit(self.values, T + slots)
        self.tail = slots

    def ring_part(self, buf):
        """``buf`` without the tail: the ring's slots."""
        return get(buf, 0, length(buf) - self.tail) if self.tail else buf

    def call_limit(self, n: int) -> int | None:
        """Most tokens a call at token ``n`` may write (``None``: the ring decides)."""
        return None

    def check_call(self, n: int, N: int) -> None:
        """Refuse an ``N``-token call at ``n`` this storage cannot serve exactly."""

    def check_trim(self, tokens_seen: int, n: int) -> None:
        """Refuse a ``trim(n)`` this storage cannot undo exactly."""

    # ----- writes ---------------------------------------------------------------------

    def allocate(self, keys: mx.array, values: mx.array, ring) -> None:
        """The buffers, shaped after a call's ``keys`` and ``values``."""
        g = self.kv_group_size
        if self.value_bits is not None:
            D = next((x.shape[-1] for x in (keys, values) if x.shape[-1] % g), None)
            if D is not None:
                raise Unsupported(
                    f"kv_group_size {g} does not divide the head dimension {D}; use a group "
                    "size that does"
                )
        self.keys = self._new_keys(keys, ring)
        B, H, _, D = values.shape
        slots = ring.slots_total + self.tail
        self.values = zeros(B, H, slots, D, values.dtype, self.value_bits, g)

    def _new_keys(self, keys: mx.array, ring):
        B, H, _, D = keys.shape
        slots = ring.slots_total + self.tail
        return zeros(B, H, slots, D, keys.dtype, self.key_bits, self.kv_group_size)

    def pack(self, keys: mx.array, values: mx.array) -> tuple:
        """A call's keys and values in storage form (``None`` for what ``put`` skips)."""
        g = self.kv_group_size
        return pack(keys, self.key_bits, g), pack(values, self.value_bits, g)

    def put(self, start: int, stop: int, packed: tuple, src_start: int = 0) -> None:
        """Write the ``pack``ed tokens from ``src_start`` into slots ``start:stop``."""
        put(self.keys, start, stop, packed[0], src_start)
        put(self.values, start, stop, packed[1], src_start)

    def commit(self, keys: mx.array, n: int, N: int, ring, route: bool) -> None:
        """After a call's slots were ``put`` (tokens ``n..n+N-1``, the ring not yet
        advanced): what the storage writes beyond them."""

    # ----- moves ----------------------------------------------------------------------

    def bits_of(self, slot: int) -> int | None:
        """Bits of the slot-wise storage of tensor ``slot`` (0 keys, 1 values)."""
        return (self.key_bits, self.value_bits)[slot]

    def floats(self, slot: int, start: int, stop: int) -> mx.array:
        """Slots ``start:stop`` of tensor ``slot`` (0 keys, 1 values) as floats."""
        buf = (self.keys, self.values)[slot]
        return unpack(get(buf, start, stop), self.bits_of(slot), self.kv_group_size)

    def rotate(self, slot: int, start: int, stop: int, shift) -> None:
        """Apply ``shift`` (float ``(B, H, L, D)`` -> same) to slots ``start:stop`` of
        tensor ``slot``, in place."""
        x = shift(self.floats(slot, start, stop))
        buf = (self.keys, self.values)[slot]
        put(buf, start, stop, pack(x, self.bits_of(slot), self.kv_group_size))

    # ----- attention ------------------------------------------------------------------

    def columns(self, ring, N: int) -> int:
        """Slots the next ``N``-token call attends over (asked before it is written)."""
        return ring.fetched(N)

    def visible(self, ring, N: int, window_size: int | None, route: bool):
        """The boolean mask of the next ``N``-token call, or ``None`` for mlx-lm's own
        causal mask (nothing evicted yet)."""
        return None if ring.in_order(N) else ring.visible(N, window_size)

    def fetch(self, L: int, ring, route: bool, packed: bool = False) -> tuple:
        """The first ``L`` slots of keys and values as attention takes them."""
        return self.attended(get(self.keys, 0, L), get(self.values, 0, L))

    def attended(self, keys, values) -> tuple:
        """Storage-form keys and values as attention takes them."""
        return keys, values

    def whole(self) -> tuple:
        """Every slot, the tail's included, as attention takes them (no slice op)."""
        return self.attended(self.keys, self.values)

    @property
    def dtype(self):
        return dtype_of(self.values)

    # ----- state ----------------------------------------------------------------------

    def state(self) -> list:
        return [self.ring_part(self.keys), self.ring_part(self.values)]

    def used_state(self, filled: int) -> list:
        """``state`` with only the first ``filled`` slots (at least one)."""
        return [self._used(self.keys, filled), self._used(self.values, filled)]

    @staticmethod
    def _used(buf, filled: int):
        n = max(1, filled)
        return buf if n >= length(buf) else get(buf, 0, n)

    def load(self, state: list, slots_total: int) -> None:
        """Take saved ``state`` (``used_state``'s form, or an older one)."""
        keys = tuple(state[0]) if self.key_bits else state[0]
        slots = slots_total + self.tail
        self.keys = fit(keys, slots)
        self.values = fit(tuple(state[1]) if self.value_bits else state[1], slots)

    def copy(self) -> SlotStorage:
        """An independent copy (later in-place writes do not show in it)."""
        clone = _copy.copy(self)
        clone.keys, clone.values = copy(self.keys), copy(self.values)
        return clone


class FloatStorage(SlotStorage):
    """Float keys and values (``kv_bits=None``)."""

    tails = True


class TokenStorage(SlotStorage):
    """Keys and values quantized per token with the same bits: attention takes the
    quantized triples, through mlx-lm's quantized kernel."""

    tails = True

    def __init__(self, key_bits: int, value_bits: int, kv_group_size: int, sinks: int):
        super().__init__(key_bits, value_bits, kv_group_size, sinks)
        # mlx-lm routes attention to its quantized kernel on hasattr(cache, "bits").
        self.bits, self.group_size = value_bits, kv_group_size


class MixedStorage(SlotStorage):
    """Keys and values quantized per token with other bits (8-bit keys, 4-bit values
    of a cache feeding the recall tier): attention runs on dequantized floats."""

    def attended(self, keys, values) -> tuple:
        g = self.kv_group_size
        return unpack(keys, self.key_bits, g), unpack(values, self.value_bits, g)


def fit(buf, slots: int):
    """``buf`` with ``slots`` slots: a buffer saved before spare sink slots existed, given them (zeros); one saved
    while they were slots (before calls concatenated them), without them (they are
    rewritten by every call that needs them)."""
    missing = slots - length(buf)
    if missing < 0:
        return get(buf, 0, slots)
    if missing == 0:
        return buf

    def pad(b):
        return mx.concatenate([b, mx.zeros((*b.shape[:2], missing, b.shape[3]), b.dtype)], 2)

    return tuple(pad(b) for b in buf) if isinstance(buf, tuple) else pad(buf)
