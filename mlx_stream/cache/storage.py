"""Slot-indexed storage of one cached tensor: a float array ``(B, H, slots, D)``, or
mlx's quantized triple ``(packed, scales, biases)`` with the same slot axis.

``bits=None`` means float. Every function takes and returns the storage form, so the
cache never branches on ``isinstance(tuple)`` itself.
"""

from __future__ import annotations

import mlx.core as mx


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
    return (buf[0] if isinstance(buf, tuple) else buf).shape[-2]


def dtype_of(buf):
    """The float dtype of ``buf`` (the scales' dtype when quantized)."""
    return buf[1].dtype if isinstance(buf, tuple) else buf.dtype


def get(buf, start: int, stop: int):
    """Slots ``start:stop`` of ``buf`` (the buffer itself when that is all of it)."""
    if start == 0 and stop == length(buf):
        return buf  # the whole buffer: no slice op in the decode graph
    if isinstance(buf, tuple):
        return tuple(b[..., start:stop, :] for b in buf)
    return buf[..., start:stop, :]


def put(buf, start: int, stop: int, src, src_start: int = 0) -> None:
    """Write ``src[src_start : src_start + stop - start]`` into slots ``start:stop``."""
    n = stop - start
    pairs = zip(buf, src) if isinstance(buf, tuple) else ((buf, src),)
    for b, x in pairs:
        whole = src_start == 0 and x.shape[-2] == n  # no slice op on the decode path
        b[..., start:stop, :] = x if whole else x[..., src_start : src_start + n, :]


def copy(buf):
    """An independent copy of ``buf`` (later in-place writes to ``buf`` do not show)."""
    if buf is None:
        return None
    if isinstance(buf, tuple):
        return tuple(mx.array(b) for b in buf)
    return mx.array(buf)
