"""Quantized attention on the packed per-channel keys (MLX's quantized matmul route).

Contract: a handler of the one wrapper of mlx-lm's attention function
(``mlx_stream.cache.attention``) for the calls whose keys are ``PackedKeys``.
``install(model, caches)`` probes copies of ``caches`` and sets ``fast_route`` only
where every per-channel SinkCache layer hands its packed keys and values to the wrapper
untouched; elsewhere the caches return dequantized floats (correct, slower).
``attend`` computes the float route's attention over the dequantized keys, to
rounding, every row of a chunk over exactly a decode step's columns in the same order.
GQA folds a KV head's query heads into the rows of one matmul; attention sinks
(``sinks=``, gpt-oss) take the float route. In full, and why this route: docs/cache.md
("The packed route's contract", "Why the packed route").
"""

from __future__ import annotations

import copy
import weakref
from typing import NamedTuple

import mlx.core as mx

from mlx_stream.cache import attention, kvquant
from mlx_stream.cache import storage as kvstore

#: The position movers (``Move``, one per layer, owned by the model) of layers proven to
#: reach the wrapper, with the model's modules: a SinkCache built or loaded later for
#: the same model takes the route from its constructor while they stay wrapped.
_PROVEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def proven(move) -> bool:
    """Whether the layer that ``move`` belongs to was proven to attend on packed keys
    (and its modules' attention is still wrapped)."""
    modules = _PROVEN.get(move) if move is not None else None
    return modules is not None and attention.proven(modules, "qattend")


class PackedKeys(NamedTuple):
    """One call's keys: ``floats`` ``(B, H, E + recent, D)`` (the float sinks, spare
    sinks, then the ``recent`` residual columns), ``ring`` the packed ``(B, H, D, R)``
    groups; ``splice``: the slot the residual columns replace (a single-token step: its
    mask has one column per slot), else ``None`` (they are extra columns)."""

    floats: mx.array
    ring: tuple
    recent: int
    sinks: int
    bits: int
    splice: int | None


class PackedValues(NamedTuple):
    """One call's values: the slot storage (packed triple, or float) and the value slot
    of each residual column (``idx``)."""

    slots: object
    idx: mx.array
    bits: int | None
    group_size: int


def pack(keys: kvquant.ChannelKeys, values, lo: int, hi: int, idx: mx.array,
         splice: int | None, value_bits: int | None,
         group_size: int) -> tuple[PackedKeys, PackedValues]:  # fmt: skip
    """The packed pair a ``fast_route`` cache returns (residual columns ``lo:hi``, whose
    value slots are ``idx``, spliced at slot ``splice`` when not ``None``)."""
    floats = keys.edge
    if hi > lo:  # sinks, spare sinks and residual keys: one matmul in ``attend``
        floats = mx.concatenate([floats, keys.recent[..., lo:hi, :].astype(keys.dtype)], axis=2)
    return (
        PackedKeys(floats, keys.ring, hi - lo, keys.sinks, keys.bits, splice),
        PackedValues(values, idx, value_bits, group_size),
    )


def unpack(keys: PackedKeys, values: PackedValues) -> tuple[mx.array, mx.array]:
    """The float keys and values of every column (the dequantize route)."""
    S = keys.sinks
    ring = mx.dequantize(*keys.ring, group_size=kvquant.GROUP, bits=keys.bits)
    ring = ring.swapaxes(-1, -2).astype(keys.floats.dtype)
    E = keys.floats.shape[-2] - keys.recent
    edge, recent = keys.floats[..., :E, :], keys.floats[..., E:, :]
    if keys.splice is not None:
        a = keys.splice - S
        ring = mx.concatenate([ring[..., :a, :], recent, ring[..., a + keys.recent :, :]], 2)
    parts = [edge[..., :S, :], ring, edge[..., S:, :]]
    if keys.splice is None:
        parts.append(recent)
    k = mx.concatenate([p for p in parts if p.shape[-2]], axis=2)
    v = kvstore.unpack(values.slots, values.bits, values.group_size).astype(k.dtype)
    if keys.recent and keys.splice is None:
        v = mx.concatenate([v, mx.take(v, values.idx, axis=2)], axis=2)
    return k, v


def attend(queries: mx.array, keys: PackedKeys, values: PackedValues, scale: float,
           mask) -> mx.array:  # fmt: skip
    """Attention of ``queries`` (B, n_heads, N, D) over the packed columns.

    Args:
        queries (mx.array): The layer's queries.
        keys, values: What the cache's ``update_and_fetch`` returned.
        scale (float): The attention scale.
        mask: ``None``, ``"causal"``, or a boolean or additive ``(N, columns)`` array
            (or one that broadcasts to ``(B, n_heads, N, columns)``).

    Returns:
        mx.array: ``(B, n_heads, N, D_v)``.
    """
    B, H, N, D = queries.shape
    KVH = keys.floats.shape[1]
    rep = H // KVH
    S, r = keys.sinks, keys.recent
    q = (queries * scale).reshape(B, KVH, rep * N, D)
    ring = mx.quantized_matmul(q, *keys.ring, transpose=False, group_size=kvquant.GROUP,
                               bits=keys.bits)  # fmt: skip
    resid = None  # the residual columns' scores, when not spliced yet
    if keys.floats.shape[-2]:
        side = q @ keys.floats.swapaxes(-1, -2)  # sinks, spare sinks, residual
        E = side.shape[-1] - r
        if r:
            side, resid = side[..., :E], side[..., E:]
        if r and keys.splice is not None:  # the residual scores replace their slots' ring scores
            a = keys.splice - S
            ring[..., a : a + r] = resid
            resid = None
        parts = [side[..., :S], ring, side[..., S:]]
        scores = mx.concatenate([p for p in parts if p.shape[-1]], axis=-1)
    else:
        scores = ring
    L = scores.shape[-1]  # one column per slot
    if (
        mask is not None
        and N == 1
        and resid is None
        and not isinstance(mask, str)
        and mask.ndim < 3
    ):
        # one row (a decode step): the mask broadcasts over the folded heads
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    elif mask is not None and not isinstance(mask, str):
        scores = scores.reshape(B, KVH, rep, N, L)
        if mask.ndim == 4:  # (B or 1, heads or 1, N, C): heads split as the scores'
            b, h = mask.shape[:2]
            mask = mask.reshape(b, 1, 1, N, -1) if h == 1 else mask.reshape(b, KVH, rep, N, -1)
        if resid is not None:
            scores, mask = _splice_rows(scores, mask, resid.reshape(B, KVH, rep, N, r), values.idx)
            resid = None
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
        scores = scores.reshape(B, KVH, rep * N, L)
    elif resid is not None:  # no mask array: the residual stays as extra columns
        scores = mx.concatenate([scores, resid], axis=-1)
        if isinstance(mask, str):
            C = L + r
            causal = mx.arange(C - N, C)[:, None] >= mx.arange(C)[None]
            scores = mx.where(causal, scores.reshape(B, KVH, rep, N, C), mx.finfo(scores.dtype).min)
            scores = scores.reshape(B, KVH, rep * N, C)
    probs = mx.softmax(scores, axis=-1, precise=True)
    if resid is not None:
        # A row sees a token through its ring column or its residual column, never
        # both (the mask): the residual's weight goes to the token's value slot.
        probs = probs[..., :L].at[..., values.idx].add(probs[..., L:])
    if isinstance(values.slots, tuple):
        out = mx.quantized_matmul(probs, *values.slots, transpose=False,
                                  group_size=values.group_size, bits=values.bits)  # fmt: skip
    else:
        out = probs @ values.slots
    out = out.reshape(B, H, N, -1)
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


def _splice_rows(scores: mx.array, mask: mx.array, resid: mx.array, idx: mx.array):
    """A chunk's rows laid out as decode steps: row ``i`` reads a residual token's score
    and mask in the token's own slot where its mask shows that token through the
    residual (the tokens of its open group). So every row attends over exactly the
    columns a single-token step at its token attends over, in the same order, and
    gives the same bits (each of the kernels here computes a row on its own): a
    speculative verify block or a chunk equals token-by-token decoding.

    Args:
        scores: ``(B, KVH, rep, N, L)``, one column per slot.
        mask: broadcasts to ``(B, KVH, rep, N, L + r)``; its last ``r`` columns are
            the residual's.
        resid: ``(B, KVH, rep, N, r)`` the residual columns' scores.
        idx: ``(r,)`` the slot of each residual column's token (a column of no token
            points at slot 0 and is masked for every row: it writes slot 0 unchanged).
    """
    L = scores.shape[-1]
    own, extra = mask[..., :L], mask[..., L:]
    seen = extra if extra.dtype == mx.bool_ else extra > -mx.inf
    scores[..., idx] = mx.where(seen, resid, mx.take(scores, idx, axis=-1))
    own[..., idx] = mx.where(seen, extra, mx.take(own, idx, axis=-1))
    return scores, own


def claims(cache, keys) -> bool:
    """Whether a call of the wrapped attention is this route's: its keys are packed."""
    return isinstance(keys, PackedKeys)


def handle(queries, keys, values, cache, scale, mask, sinks, original) -> mx.array:
    """The wrapped attention (``cache.attention``) of a call with packed keys:
    :func:`attend`, or with attention sinks (``sinks=``, gpt-oss) ``original``, mlx's
    float attention, on the dequantized tensors."""
    if sinks is not None:
        keys, values = unpack(keys, values)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                        sinks=sinks)  # fmt: skip
    return attend(queries, keys, values, scale, mask)


attention.register("qattend", attention.Handler(claims, handle))


def install(model, caches: list) -> bool:
    """Prove, with a lazy probe pass on copies of ``caches`` (``cache.attention``),
    that every per-channel SinkCache layer hands its packed keys to the wrapped
    attention, and set ``fast_route`` on those caches.

    Returns:
        bool: Whether the caches attend on their packed keys.
    """
    channel = [i for i, c in enumerate(caches) if getattr(c, "channel_keys", False)]
    if not channel:
        return False
    probe = copy.deepcopy(caches)
    for i in channel:
        probe[i].fast_route = True
    try:
        if attention.prove(model, probe, "qattend", channel):
            return False
    except Exception:  # noqa: BLE001 - a model that cannot take the route keeps floats
        return False
    modules = tuple(attention.modules(model))
    for i in channel:
        caches[i].fast_route = True
        if caches[i].move is not None:
            _PROVEN[caches[i].move] = modules
    return True
