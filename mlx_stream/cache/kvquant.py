"""Per-channel 4-bit and 8-bit keys for the sink + window ring (KIVI's scheme, fitted to a ring).

Contract (``ChannelKeys``, the key storage of a SinkCache whose keys are quantized per
channel): ring token ``t >= sinks`` belongs to group ``(t - sinks) // GROUP``, and a
group always lands on the same ``GROUP`` ring slots (the ring is rounded up to a
multiple of ``GROUP``: ``ring_slack``). The newest tokens wait as floats in ``RECENT``
residual slots until their group is complete, then the group is quantized into the
ring; each row of a call sees a token through the ring or the residual as a decode step
at its token would, so chunks and verify blocks see exactly what decoding sees
(``call_limit`` and ``trim_limit`` bound a call and a trim by what the residual holds).
Sinks stay in float; a rebase re-rotates the ring (dequantize, rotate, quantize). Every
array is in the cache's ``state``. In full, and why per-channel keys: docs/cache.md
("Per-channel keys in the ring", "Why per-channel keys").
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: Tokens per per-channel key group (mx.quantize's smallest group size).
GROUP = 32
#: Float slots of the residual: the group being filled and the one before it.
RECENT = 2 * GROUP
#: Smallest slack: a call of ``N`` tokens written into the ring first needs ``N - 1``
#: free slots, and the residual admits calls of at least ``GROUP + 1`` (``call_limit``).
MIN_SLACK = GROUP
#: Key bits stored per channel (4: quality; 8: the fast quantized attention route).
CHANNEL_BITS = (4, 8)


def per_channel(key_bits: int | None, token_keys: bool = False) -> bool:
    """Whether keys of ``key_bits`` are stored per channel (``ChannelKeys``);
    ``token_keys`` keeps 8-bit keys per token (caches feeding the recall tier)."""
    return key_bits in CHANNEL_BITS and not (token_keys and key_bits == 8)


def ring_slack(window: int, slack: int, key_bits: int | None, token_keys: bool = False) -> int:
    """The slack of a cache asked for ``slack``: with per-channel keys, calls are
    written into the ring before attention, so it covers a call of ``MIN_SLACK + 1``
    tokens, and ``window + slack`` is a multiple of ``GROUP`` (fixed ring slots)."""
    if not per_channel(key_bits, token_keys):
        return slack
    slack = max(slack, MIN_SLACK)
    return slack + (-(window + slack)) % GROUP


def residual_dtype(dtype):
    """The residual's dtype for keys of ``dtype``: float16 for float32 keys."""
    return mx.float16 if dtype == mx.float32 else dtype


def group_start(t: int, sinks: int) -> int:
    """First token of the group holding ring token ``t`` (``sinks`` for ``t < sinks``)."""
    return sinks if t < sinks else sinks + (t - sinks) // GROUP * GROUP


def call_limit(n: int, sinks: int) -> int:
    """Most tokens a call at token ``n`` may write: the floats of ``[group_start(n),
    n + N)`` must all fit in the residual."""
    return RECENT - (max(n, sinks) - group_start(n, sinks)) + max(0, sinks - n)


def trim_limit(tokens_seen: int, sinks: int, n: int) -> bool:
    """Whether ``trim(n)`` keeps the floats of the group it reopens."""
    keep = tokens_seen - n
    start = group_start(keep, sinks)
    return n == 0 or keep <= start or tokens_seen - start <= RECENT


class ChannelKeys:
    """Key storage of one SinkCache layer: float sinks, per-channel 4/8-bit ring groups,
    and a float residual of the newest tokens.

    Args:
        edge (mx.array): ``(B, H, slots_total - ring, D)`` float: the sink slots, then
            the spare sink slots.
        ring (tuple): ``mx.quantize`` of ``(B, H, D, ring)`` keys along the tokens.
        recent (mx.array): ``(B, H, RECENT, D)`` float residual.
        sinks (int): Number of sink slots.
        bits (int): Bits of the ring.
    """

    def __init__(self, edge: mx.array, ring: tuple, recent: mx.array, sinks: int, bits: int = 4):
        self.edge, self.ring, self.recent = edge, tuple(ring), recent
        self.sinks, self.bits = sinks, bits

    @classmethod
    def zeros(
        cls, B: int, H: int, slots_total: int, ring: int, D: int, dtype, sinks: int, bits: int
    ):
        edge = mx.zeros((B, H, slots_total - ring, D), dtype)
        packed = mx.quantize(mx.zeros((B, H, D, ring), dtype), group_size=GROUP, bits=bits)
        recent = mx.zeros((B, H, RECENT, D), residual_dtype(dtype))
        return cls(edge, packed, recent, sinks, bits)

    # ----- shapes and state ------------------------------------------------------------

    @property
    def ring_slots(self) -> int:
        return self.ring[1].shape[-1] * GROUP

    @property
    def slots(self) -> int:
        """Slots of the cache layout (sinks, ring, spare sinks): the values' slot count."""
        return self.edge.shape[-2] + self.ring_slots

    @property
    def dtype(self):
        return self.edge.dtype

    @property
    def state(self) -> dict:
        return {"edge": self.edge, "ring": list(self.ring), "recent": self.recent}

    @classmethod
    def from_state(cls, state: dict, sinks: int, bits: int) -> ChannelKeys:
        return cls(state["edge"], tuple(state["ring"]), state["recent"], sinks, bits)

    def copy(self) -> ChannelKeys:
        """An independent copy (later in-place writes do not show in it)."""
        ring = tuple(mx.array(a) for a in self.ring)
        return ChannelKeys(mx.array(self.edge), ring, mx.array(self.recent), self.sinks, self.bits)

    # ----- slot access for sinks and spare sinks (float) -------------------------------

    def _edge(self, start: int, stop: int) -> tuple[int, int]:
        S, R = self.sinks, self.ring_slots
        if stop <= S:
            return start, stop
        if start >= S + R:
            return start - R, stop - R
        raise ValueError(f"slots {start}:{stop} are ring slots; move them with shift_ring")

    def get(self, start: int, stop: int) -> mx.array:
        a, b = self._edge(start, stop)
        return self.edge[..., a:b, :]

    def put(self, start: int, stop: int, src: mx.array, src_start: int = 0) -> None:
        a, b = self._edge(start, stop)
        n = b - a
        self.edge[..., a:b, :] = (
            src if src.shape[-2] == n and src_start == 0 else src[..., src_start : src_start + n, :]
        )

    # ----- writes ------------------------------------------------------------------------

    def write(self, keys: mx.array, n: int) -> None:
        """Store float ``keys`` (B, H, N, D) of tokens ``n..n+N-1``: sinks in float, ring
        tokens in the residual, and every group completed by them quantized into the ring."""
        S, N = self.sinks, keys.shape[-2]
        if n < S:
            k = min(N, S - n)
            self.edge[..., n : n + k, :] = keys[..., :k, :] if k < N else keys
        lo = max(n, S)
        i = lo - n
        while lo < n + N:  # contiguous runs of the residual ring
            r = (lo - S) % RECENT
            length = min(n + N - lo, RECENT - r)
            whole = i == 0 and length == N
            x = keys if whole else keys[..., i : i + length, :]
            self.recent[..., r : r + length, :] = x.astype(self.recent.dtype)
            lo, i = lo + length, i + length
        # Groups whose last token is in this call: quantize them from the residual.
        first = max(0, (max(n, S) - S) // GROUP)
        last_done = (n + N - S) // GROUP  # groups 0..last_done-1 are complete after the call
        for k in range(first, last_done):
            if S + (k + 1) * GROUP - 1 >= n:
                self._quantize_group(k)

    def write_one(self, key: mx.array, n: int) -> None:
        """``write`` of one ring token (``n >= sinks``): the decode step's path."""
        t = n - self.sinks
        r = t % RECENT
        self.recent[..., r : r + 1, :] = key.astype(self.recent.dtype)
        if (t + 1) % GROUP == 0:
            self._quantize_group(t // GROUP)

    def _quantize_group(self, k: int) -> None:
        """Quantize group ``k`` from its floats in the residual into its ring slots."""
        r = (k * GROUP) % RECENT
        floats = self.recent[..., r : r + GROUP, :].swapaxes(-1, -2).astype(self.dtype)
        packed = mx.quantize(floats, group_size=GROUP, bits=self.bits)
        c = (k * GROUP) % self.ring_slots
        words = GROUP * self.bits // 32
        self.ring[0][..., c // GROUP * words : (c // GROUP + 1) * words] = packed[0]
        self.ring[1][..., c // GROUP : c // GROUP + 1] = packed[1]
        self.ring[2][..., c // GROUP : c // GROUP + 1] = packed[2]

    def shift_ring(self, shift) -> None:
        """Apply ``shift`` ((B, H, L, D) -> same) to every ring key and the residual: the
        ring is dequantized, moved and quantized again."""
        x = mx.dequantize(*self.ring, group_size=GROUP, bits=self.bits).swapaxes(-1, -2)
        moved = shift(x.astype(self.dtype)).swapaxes(-1, -2)
        self.ring = tuple(mx.quantize(moved, group_size=GROUP, bits=self.bits))
        self.recent = shift(self.recent.astype(self.dtype)).astype(self.recent.dtype)

    # ----- reads ---------------------------------------------------------------------------

    def fetch(self, lo: int = 0, hi: int = RECENT) -> mx.array:
        """Float keys for every column: sinks, ring, spare sinks, then the residual
        slots ``lo:hi``."""
        S = self.sinks
        ring = mx.dequantize(*self.ring, group_size=GROUP, bits=self.bits).swapaxes(-1, -2)
        recent = self.recent[..., lo:hi, :].astype(self.dtype)
        parts = [self.edge[..., :S, :], ring.astype(self.dtype), self.edge[..., S:, :], recent]
        return mx.concatenate([p for p in parts if p.shape[-2]], axis=2)


def recent_tokens(n: int, N: int, sinks: int) -> np.ndarray:
    """Token held by each residual slot for the rows of an ``N``-token call at ``n``
    (``-1``: none a row may need): the tokens ``[group_start(n), n + N)``."""
    tokens = np.full(RECENT, -1, dtype=np.int64)
    lo = group_start(n, sinks)
    t = np.arange(lo, n + N)
    t = t[t >= sinks]
    tokens[(t - sinks) % RECENT] = t
    return tokens


def recent_range(n: int, N: int, sinks: int) -> tuple[int, int]:
    """The residual slots ``lo:hi`` an ``N``-token call at ``n`` attends: those holding
    ``[group_start(n), n + N)`` when they do not wrap around the residual, else all."""
    lo_token = max(group_start(n, sinks), sinks)
    count = n + N - lo_token
    if count <= 0:
        return 0, 0
    lo = (lo_token - sinks) % RECENT
    return (lo, lo + count) if lo + count <= RECENT else (0, RECENT)


def mask(visible: np.ndarray, slots: np.ndarray, n: int, sinks: int, window: int,
         window_size: int | None) -> np.ndarray:  # fmt: skip
    """The boolean mask ``(N, slots_total + hi - lo)`` of an ``N``-token call at ``n``
    (``lo, hi = recent_range(n, N, sinks)``).

    Args:
        visible (np.ndarray): The ring's mask over the value slots (``Ring.visible``,
            padded to every slot).
        slots (np.ndarray): Token held by each ring slot after the call (``-1``: none),
            for the first ``len(slots)`` columns.
        n (int): First token of the call.
        sinks, window (int): The cache's sizes.
        window_size (int, optional): A model's own sliding window.
    """
    N = visible.shape[0]
    q = np.arange(n, n + N)[:, None]
    row_group = np.where(q >= sinks, (q - sinks) // GROUP, -1)
    t = np.full(visible.shape[1], -1, dtype=np.int64)
    t[: len(slots)] = slots
    t[:sinks] = -1  # sink slots are float: nothing to swap
    t = t[None, :]
    open_group = (t >= sinks) & ((t - sinks) // GROUP == row_group)
    seen = visible & ~open_group
    tok = recent_tokens(n, N, sinks)[None, :]
    extra = (tok >= sinks) & (tok <= q) & ((tok - sinks) // GROUP == row_group) & (tok > q - window)
    if window_size is not None:
        extra &= tok > q - window_size
    lo, hi = recent_range(n, N, sinks)
    return np.concatenate([seen, extra[:, lo:hi]], axis=1)
