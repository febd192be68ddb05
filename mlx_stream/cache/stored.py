"""A SinkCache's ``state`` as mlx-lm reads and writes it, and ``used_state`` (the
slots ever written: what ``save_cache`` writes). Mixed into ``SinkCache``."""

from __future__ import annotations

import mlx.core as mx

from mlx_stream.cache import kvquant
from mlx_stream.cache import storage as kvstore
from mlx_stream.errors import Unsupported


class Stored:
    """SinkCache's state methods."""

    @property
    def state(self):
        if self.keys is None:
            return []
        keys = self.keys.state if isinstance(self.keys, kvquant.ChannelKeys) else self.keys
        arrays = [keys, self.values]
        return arrays + ([self.sink_copy] if self.sink_copy is not None else [])

    @property
    def used_state(self):
        """``state`` with only the slots ever written (``ring.filled``): what
        ``save_cache`` writes, so a chat of 400 tokens in a 2k window saves 400 slots.
        The setter pads the rest with zeros, as they were before any write (spare sink
        slots after the ring are rewritten by every call that reads them); per-channel
        keys are kept whole."""
        if self.keys is None:
            return []
        n = max(1, self.ring.filled)

        def used(buf):
            if isinstance(buf, kvquant.ChannelKeys) or n >= kvstore.length(buf):
                return buf
            return kvstore.get(buf, 0, n)

        keys, *rest = self.state
        return [keys if isinstance(keys, dict) else used(keys), used(rest[0]), *rest[1:]]

    @state.setter
    def state(self, v):
        v = list(v)
        if self.channel_keys and not isinstance(v[0], dict):
            raise Unsupported(
                f"this cache was saved with per-token {self.key_bits}-bit keys, which "
                f"mlx-stream no longer reads ({self.key_bits}-bit keys are now per "
                "channel): start the session again"
            )
        if self.channel_keys:
            keys = kvquant.ChannelKeys.from_state(v[0], self.sinks, self.key_bits)
        else:
            keys = tuple(v[0]) if self.key_bits else v[0]
        values = tuple(v[1]) if self.value_bits else v[1]
        self.keys, self.values = (self._pad(x) for x in (keys, values))
        self.sink_copy = v[2] if len(v) > 2 else None

    def _pad(self, buf):
        """A buffer saved before spare sink slots existed, given them (zeros); one saved
        while they were slots (before calls concatenated them), without them (they are
        rewritten by every call that needs them)."""
        missing = self.ring.slots_total - kvstore.length(buf)
        if missing < 0 and not isinstance(buf, kvquant.ChannelKeys):
            return kvstore.get(buf, 0, self.ring.slots_total)
        if missing <= 0:
            return buf

        def pad(b):
            return mx.concatenate([b, mx.zeros((*b.shape[:2], missing, b.shape[3]), b.dtype)], 2)

        return tuple(pad(b) for b in buf) if isinstance(buf, tuple) else pad(buf)
