"""A SinkCache's ``state`` as mlx-lm reads and writes it, and ``used_state`` (the
slots ever written: what ``save_cache`` writes). Mixed into ``SinkCache``; its
storage (``SinkCache.storage``) gives its own tensors' form."""

from __future__ import annotations


class Stored:
    """SinkCache's state methods."""

    @property
    def state(self):
        if self.keys is None:
            return []
        return self.storage.state() + self._sink_state()

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

    @state.setter
    def state(self, v):
        v = list(v)
        self.storage.load(v[:2], self.ring.slots_total)
        self.sink_copy = v[2] if len(v) > 2 else None

    def _sink_state(self) -> list:
        return [self.sink_copy] if self.sink_copy is not None else []
