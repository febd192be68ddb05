"""The slot layout of a sink + window ring, in numpy: no model, no mlx.

A buffer of ``sinks + window + slack`` slots (plus spare sink copies). Token
``t < sinks`` lives in slot ``t``; later tokens go round a ring of ``window + slack``
slots; ``slots[i]`` records the token slot ``i`` holds (``-1``: none). Row ``q`` of a
call sees the slots holding a token ``t <= q`` with ``t < sinks`` or ``t > q - window``.
Positions and sink moves change only at multiples of ``stride``; a call spanning two
layouts stays exact through spare sink copies. A multi-token call attends over the
buffer as it was, then its own tokens, and is written afterwards; a call of at most ``slack + 1``
tokens in one layout, or any call of an :class:`InPlaceRing` (per-channel keys), is
written first. The layout is a pure function of token indices (a batched cache
shares it). In full: docs/cache.md ("The ring's layout").
"""

from __future__ import annotations

import math

import numpy as np

from mlx_stream.errors import Unsupported

#: Most spare sink copies a buffer carries (calls spanning more layouts are refused).
MAX_SPARE_SINK_SETS = 4


def spare_sets(sinks: int, slack: int, stride: int, positions: str, in_place: bool) -> int:
    """Spare sink copies a call may need: as many as the sink layouts a call can span
    beyond its first (in place: as many as ``slack + 1`` tokens can span)."""
    if sinks == 0 or positions != "cache":
        return 0
    if not in_place:
        return MAX_SPARE_SINK_SETS
    return min(MAX_SPARE_SINK_SETS, math.ceil((slack + 1) / stride))


class Ring:
    """Slot bookkeeping and positions of one sink + window buffer.

    Args:
        sinks (int): First tokens kept forever.
        window (int): Recent tokens each row sees.
        slack (int): Extra ring slots (largest call and deepest rollback: ``slack + 1``).
        stride (int): Sinks move and the buffer rebases only at multiples of it.
        positions (str): ``"cache"`` (bounded positions) or ``"absolute"``.
    """

    in_place = False  # calls attend over the buffer as it was, then write (see above)

    def __init__(self, sinks: int, window: int, slack: int, stride: int, positions: str):
        self.sinks, self.window, self.slack, self.stride = sinks, window, slack, stride
        self.positions = positions
        self.capacity = sinks + window + slack
        # Rebase often enough to bound positions, rarely enough to cost < 1 token/token.
        self.rebase_every = stride * math.ceil(self.capacity / stride)
        self.spare_sets = spare_sets(sinks, slack, stride, positions, self.in_place)
        # Spare sink copies live in slots after the ring only when calls write in place.
        self.slots_total = self.capacity + (self.spare_sets * sinks if self.in_place else 0)
        self.slots = np.full(self.capacity, -1, dtype=np.int64)
        self.filled = 0  # ring slots ever written (high-water mark)
        self.tokens_seen = 0

    # ----- positions -----------------------------------------------------------------

    def layout(self, n: int) -> tuple[int, int]:
        """``(base, sink_start)`` for a call whose first token has index ``n``."""
        if self.positions == "absolute":
            return 0, 0
        sink_start = max(0, (n // self.stride) * self.stride - self.window + 1 - self.sinks)
        rebased_at = self.rebase_point(n)
        base = max(0, rebased_at - self.window + 1 - self.sinks)
        return base, sink_start

    def rebase_point(self, n: int) -> int:
        """The last token index ``<= n`` where the buffer rebased (or 0)."""
        return (n // self.rebase_every) * self.rebase_every

    @property
    def offset(self) -> int:
        return self.tokens_seen - self.layout(self.tokens_seen)[0]

    @property
    def max_offset(self) -> int:
        return self.sinks + self.window + self.rebase_every

    def sink_layouts(self, N: int) -> list[int]:
        """The distinct ``sink_start`` of the rows of the next ``N``-token call, in
        order: the first one is the call's layout, each later one needs a spare copy."""
        n = self.tokens_seen
        starts = [self.layout(n)[1]]
        m = (n // self.stride + 1) * self.stride
        while m < n + N:
            s = self.layout(m)[1]
            if s != starts[-1]:
                starts.append(s)
            m += self.stride
        return starts

    # ----- slots -----------------------------------------------------------------

    def slot(self, t: int) -> int:
        S = self.sinks
        return t if t < S else S + (t - S) % (self.capacity - S)

    def runs(self, n: int, N: int) -> list[tuple[int, int, int]]:
        """Contiguous ``(slot, source, length)`` runs where tokens ``n..n+N-1`` go."""
        if N == 1:
            return [(self.slot(n), 0, 1)]
        runs, i = [], 0
        while i < N:
            slot = self.slot(n + i)
            end = self.sinks if n + i < self.sinks else self.capacity
            length = min(N - i, end - slot)
            runs.append((slot, i, length))
            i += length
        return runs

    def room(self, n: int) -> int:
        """Most tokens a call at ``n`` may write without overwriting one a row needs
        (calls not in place see the buffer as it was: only the sink layouts bound them)."""
        return self.largest_call()

    def largest_call(self) -> int:
        """An upper bound of any call this buffer serves (the spare sink sets bound the
        layouts a call spans; each layout lasts ``stride`` tokens)."""
        return (self.spare_sets + 1) * self.stride

    def concatenates(self, N: int) -> bool:
        """Whether the next ``N``-token call attends over the buffer as it was before it,
        followed by its own tokens (not in place, past the first eviction). A call of at
        most ``slack + 1`` tokens in one sink layout (a speculative verify block) is
        written in place first instead: each token it overwrites left the window of
        every row, and each row then attends over the slots a decode step at its token
        attends over, in the same order, for the same bits."""
        return (
            N > 1 and not self.in_order(N) and (N > self.slack + 1 or len(self.sink_layouts(N)) > 1)
        )

    def max_call_tokens(self) -> int:
        """Most tokens the next call may feed without overwriting a token a row still
        needs and without crossing a layout change (so it needs no spare sinks)."""
        n = self.tokens_seen
        room = self.room(n)
        if self.positions == "absolute":
            return room
        layout = self.layout(n)
        m = (n // self.stride + 1) * self.stride
        while m - n < room and self.layout(m) == layout:
            m += self.stride
        return min(room, m - n)

    def check_call(self, N: int) -> None:
        """Refuse, before anything is written, a call this buffer cannot serve exactly."""
        n = self.tokens_seen
        if (N > 1 and not self.in_order(N) and not self.concatenates(N)
                and len(self.sink_layouts(N)) - 1 > self.spare_sets):  # fmt: skip
            # (a concatenating call appends a copy of the sinks per layout as columns:
            # any number; in place, the spare slots after the ring bound them)
            raise Unsupported(
                f"a call of {N} tokens at token {n} spans more sink moves than the cache "
                f"can serve exactly (stride {self.stride}); feed at most "
                f"max_call_tokens() = {self.max_call_tokens()} tokens"
            )

    def in_order(self, N: int) -> bool:
        """True while nothing was evicted: the buffer then is exactly a KVCache."""
        return self.tokens_seen + N <= self.sinks + self.window

    def fetched(self, N: int) -> int:
        """How many leading slots the next ``N``-token call attends over."""
        if self.in_order(N):
            return self.tokens_seen + N
        if self.concatenates(N):
            return self.capacity + (len(self.sink_layouts(N)) - 1) * self.sinks + N
        if N > 1 and len(self.sink_layouts(N)) > 1:  # one token has one layout
            return self.slots_total
        return max(self.filled, min(self.capacity, self.tokens_seen + N))

    def visible(self, N: int, window_size: int | None = None) -> np.ndarray:
        """The boolean mask ``(N, fetched(N))`` of the next ``N``-token call."""
        if N == 1 and not self.in_order(1):
            return self._visible_step(window_size)
        if self.concatenates(N):
            return self._visible_before(N, window_size)
        n = self.tokens_seen
        slots = self.slots.copy()
        for slot, i, length in self.runs(n, N):
            slots[slot : slot + length] = np.arange(n + i, n + i + length)
        L = self.fetched(N)
        q = np.arange(n, n + N)[:, None]
        t = slots[None, : min(L, self.capacity)]
        seen = (t >= 0) & (t <= q) & ((t < self.sinks) | (t > q - self.window))
        if window_size is not None:
            seen &= t > q - window_size
        if L <= self.capacity:
            return seen
        # Spare sink copies: each row sees the sinks of its own layout, in one copy.
        S = self.sinks
        starts = self.sink_layouts(N)
        row_start = np.array([self.layout(r)[1] for r in range(n, n + N)])
        which = np.searchsorted(starts, row_start)  # starts increase with the stride
        spare = np.zeros((N, L - self.capacity), dtype=bool)
        for k in range(1, len(starts)):
            spare[which == k, (k - 1) * S : k * S] = True
        seen[which > 0, :S] = False
        if window_size is not None:
            sink_tokens = np.tile(np.arange(S), self.spare_sets)[None, :]
            spare &= sink_tokens > q - window_size
        return np.concatenate([seen, spare], axis=1)

    def _visible_step(self, window_size: int | None) -> np.ndarray:
        """``visible(1)`` past the first eviction, in a few array operations: a decode
        step asks for it once per token (the general form costs far more)."""
        n, S, t = self.tokens_seen, self.sinks, self.slots
        seen = (t >= 0) & ((t < S) | (t > n - self.window))
        if window_size is not None:
            seen &= t > n - window_size
        seen[self.slot(n)] = True  # the step's own token
        return seen[None, : self.fetched(1)]

    def _visible_before(self, N: int, window_size: int | None) -> np.ndarray:
        """The mask of a concatenating call: the buffer as it was, the spare sink sets
        of its later layouts, then its own tokens."""
        n, S = self.tokens_seen, self.sinks
        q = np.arange(n, n + N)[:, None]
        t = np.concatenate([self.slots, np.arange(n, n + N)])[None, :]
        seen = (t >= 0) & (t <= q) & ((t < S) | (t > q - self.window))
        if window_size is not None:
            seen &= t > q - window_size
        starts = self.sink_layouts(N)
        row_start = np.array([self.layout(r)[1] for r in range(n, n + N)])
        which = np.searchsorted(starts, row_start)
        spare = np.zeros((N, (len(starts) - 1) * S), dtype=bool)
        for k in range(1, len(starts)):
            spare[which == k, (k - 1) * S : k * S] = True
        if window_size is not None and S:
            spare &= np.tile(np.arange(S), len(starts) - 1)[None, :] > q - window_size
        # A row of a later layout sees its own moved copy of the sinks, not the first.
        seen[which > 0] &= t[0] >= S
        C = self.capacity
        return np.concatenate([seen[:, :C], spare, seen[:, C:]], axis=1)

    def write(self, N: int) -> None:
        """Record that the next ``N`` tokens were written."""
        n = self.tokens_seen
        for slot, i, length in self.runs(n, N):
            self.slots[slot : slot + length] = range(n + i, n + i + length)
        self.tokens_seen += N
        self.filled = max(self.filled, min(self.capacity, self.tokens_seen))

    def check_trim(self, n: int) -> int:
        """How many tokens ``trim(n)`` removes; refuses a rollback to tokens already
        overwritten."""
        n = min(n, self.tokens_seen)
        keep = self.tokens_seen - n
        lost_newest = self.tokens_seen - 1 - (self.capacity - self.sinks)
        if n and lost_newest >= max(self.sinks, keep - self.window + 1):
            raise Unsupported(
                f"cannot trim {n} tokens: they overwrote tokens that would be back in the "
                f"window (trim at most slack + 1 = {self.slack + 1})"
            )
        return n

    def forget(self, n: int) -> None:
        """Forget the last ``n`` tokens (checked by ``check_trim``)."""
        keep = self.tokens_seen - n
        for t in range(keep, self.tokens_seen):
            self.slots[self.slot(t)] = -1
        self.tokens_seen = keep


class InPlaceRing(Ring):
    """A ring whose every call is written into its slots before attention (per-channel
    keys: their mask picks float or quantized columns per row): the largest call is
    ``slack + 1`` tokens, and the spare sink copies live in slots after the ring."""

    in_place = True

    def room(self, n: int) -> int:
        """Most tokens a call at ``n`` may write without overwriting one a row needs."""
        ring = self.capacity - self.sinks
        return ring + max(self.sinks, n - self.window + 1) - n

    def largest_call(self) -> int:
        return self.slack + 1

    def concatenates(self, N: int) -> bool:
        return False

    def check_call(self, N: int) -> None:
        n = self.tokens_seen
        if N > self.room(n):
            raise Unsupported(
                f"a call of {N} tokens at token {n} would overwrite tokens still in the "
                f"window (at most {self.room(n)} here); raise slack (now {self.slack}) "
                "or feed smaller chunks"
            )
        super().check_call(N)
