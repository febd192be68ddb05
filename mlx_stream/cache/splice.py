"""Cut the stored tail of a SinkCache and put it back at other positions.

Contract: for a cache that has evicted nothing yet (token ``t`` in slot ``t``, stored at
position ``t``: the layout's base is 0 until the window fills), :func:`cut` takes the
stored keys and values of tokens ``start..tokens_seen`` (storage form, as written) and
forgets them (``trim``); :func:`paste` appends such a tail after the tokens the cache
holds now, its positioned part (the layer's ``Move``) turned by ``shift`` positions,
exactly as the cache's own sink moves and rebases turn it. What the tail's keys and
values say is kept as it was: a caller that changed what came before them chooses to
reuse them (an approximation). Only float or per-token quantized storage, no recall
tier: :func:`refusal` says why a cache list cannot be spliced.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_stream.cache import storage as kvstore
from mlx_stream.cache.hooks import NONE
from mlx_stream.cache.sink import SinkCache


@dataclass
class Tail:
    """The stored keys and values of a run of tokens (storage form), one pair a layer."""

    pairs: list
    length: int


def refusal(caches: list, end: int) -> str | None:
    """Why ``caches`` cannot be cut and pasted up to ``end`` tokens, or ``None``.

    ``end``: the most tokens the caches will hold during the splice (it must stay
    below the window's first eviction, where the layout still puts token ``t`` at
    slot and position ``t``)."""
    for c in caches:
        if not isinstance(c, SinkCache):
            return f"a {type(c).__name__} layer (only SinkCache layers are spliced)"
        if c.hooks is not NONE:  # e.g. a recall tier's store follows the stream in order
            return f"{c.hooks.what} (its state follows the stream in order)"
        if c.channel_keys:
            return "per-channel quantized keys"
        if c.positions != "cache":
            return "absolute positions"
        if end >= c.sinks + c.window or c.tokens_seen >= c.sinks + c.window:
            return "the conversation does not fit in the window (tokens were evicted)"
    return None


def cut(caches: list, start: int, stop: int | None = None) -> Tail:
    """The stored tokens ``start..stop`` (default: to the end) of every cache; each
    forgets every token from ``start`` on."""
    pairs = []
    n = caches[0].tokens_seen
    stop = n if stop is None else min(stop, n)
    for c in caches:
        if c.keys is None or stop <= start:
            pairs.append(None)
        else:
            pairs.append([kvstore.copy(kvstore.get(b, start, stop)) for b in (c.keys, c.values)])
        c.trim(max(0, n - start))
    return Tail(pairs, max(0, stop - start))


def paste(caches: list, tail: Tail, shift: int) -> None:
    """Append ``tail`` after the tokens each cache holds, moved by ``shift`` positions."""
    if not tail.length:
        return
    for c, pair in zip(caches, tail.pairs, strict=True):
        n = c.tokens_seen
        if n < c.sinks or n + tail.length >= c.sinks + c.window:
            raise ValueError(
                f"a tail pasted at token {n} must lie between the sinks and the window's end"
            )
        pair = list(pair)
        if c.move is not None and c.move.moves and shift:
            slot = c.move.slot
            bits, g = (c.key_bits, c.value_bits)[slot], c.kv_group_size
            moved = c.move(kvstore.unpack(pair[slot], bits, g), shift)
            pair[slot] = kvstore.pack(moved, bits, g)
        elif shift and c.move is None:
            raise ValueError("this cache does not know where its positions live")
        for buf, src in zip((c.keys, c.values), pair, strict=True):
            kvstore.put(buf, n, n + tail.length, src)
        c.ring.write(tail.length)
