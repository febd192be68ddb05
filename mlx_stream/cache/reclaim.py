"""Reclaiming MLX's pool of freed buffers on a token cadence that survives jumps.

MLX keeps freed buffers in a pool for reuse (``mx.get_cache_memory()``) and
``mx.clear_cache()`` hands them back to the system. mlx-lm clears when
``n % 256 == 0``, which only fires if the count lands on the multiple: speculative
rounds advance by several tokens and step over it, so the pool is never released
(ollama PR 18510). The rule here fires when a multiple of the cadence lies in
``(previous, current]``, however far the count jumped. One :class:`ReclaimSchedule`
drives every clear of a generation: prefill chunks, plain decode steps and
speculative rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_stream.defaults import DEFAULT_RECLAIM_EVERY, RECLAIM_MODES


class ReclaimSchedule:
    """When to call ``mx.clear_cache()`` as a token count advances.

    Args:
        every (int): The cadence in tokens. Default: ``256``.
        mode (str): ``"crossing"`` fires when a multiple of ``every`` lies in
          ``(previous, current]``; ``"exact"`` reproduces mlx-lm/ollama's
          ``current % every == 0`` (misses multiples under jumps, kept for
          comparisons); ``"none"`` never fires. Default: ``"crossing"``.
    """

    def __init__(self, every: int = DEFAULT_RECLAIM_EVERY, mode: str = "crossing"):
        assert every >= 1, f"every must be >= 1, got {every}"
        assert mode in RECLAIM_MODES, f"mode must be one of {RECLAIM_MODES}, got {mode!r}"
        self.every = every
        self.mode = mode
        self.reclaims = 0
        self.reclaimed_bytes = 0  # pool bytes handed back, summed over reclaims

    def due(self, previous: int, current: int) -> bool:
        """Whether a count going from ``previous`` to ``current`` should reclaim."""
        if self.mode == "crossing":
            return previous // self.every != current // self.every
        if self.mode == "exact":
            return current % self.every == 0
        return False

    def step(self, previous: int, current: int) -> bool:
        """Clear MLX's buffer pool if due; returns whether it did."""
        if not self.due(previous, current):
            return False
        self.reclaimed_bytes += mx.get_cache_memory()
        mx.clear_cache()
        self.reclaims += 1
        return True

    def __repr__(self) -> str:
        return f"ReclaimSchedule(every={self.every}, mode={self.mode!r}, reclaims={self.reclaims})"


@dataclass(frozen=True)
class MemorySnapshot:
    """MLX memory counters in bytes (they work on the CPU backend too).

    Attributes:
        active: Bytes held by live arrays.
        cache: Bytes of freed buffers kept in MLX's pool for reuse.
        peak: Highest ``active`` since the last :func:`reset_peak`.
    """

    active: int
    cache: int
    peak: int


def memory_snapshot() -> MemorySnapshot:
    """Read MLX's memory counters (three cheap calls, fine once per token)."""
    return MemorySnapshot(mx.get_active_memory(), mx.get_cache_memory(), mx.get_peak_memory())


def reset_peak() -> None:
    """Restart the peak memory counter."""
    mx.reset_peak_memory()


def set_wired_limit(limit: int | None = None) -> int | None:
    """Wire (pin) up to ``limit`` bytes of GPU memory; only Metal has a wired limit.

    Args:
        limit (int, optional): Bytes to wire. Default: the device's recommended
          working-set size.

    Returns:
        The previous limit on Metal, to restore later; ``None`` on other backends,
        where this does nothing.
    """
    if not mx.metal.is_available():
        return None
    if limit is None:
        limit = mx.device_info()["max_recommended_working_set_size"]
    return mx.set_wired_limit(limit)
