"""One frozen value for a cache policy: every setting of the sink + window cache.

Contract: a :class:`CacheSpec` holds the eight settings a SinkCache is built from
(``sinks, window, slack, stride, positions, kv_bits, kv_group_size, key_bits``) and is
valid once constructed: ``__post_init__`` refuses impossible settings with one line
(:class:`CacheSettingError`, an ``Unsupported``: exit 2), naming the Python field, or
the CLI flag when built from the user's options (:meth:`CacheSpec.for_model`). It is
the one place those settings are checked, turned into bytes (:meth:`CacheSpec.bytes`),
into JSON, read back from a cache (:meth:`CacheSpec.of`) and built
(:meth:`CacheSpec.build`). Nothing heavy is imported at module level, and nothing
``cache.build`` imports imports this module (no import circle). In full: docs/cache.md
("CacheSpec").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlx_stream.cache.settings import (  # noqa: F401  (FLAGS, CacheSettingError: spec's names)
    FIELDS,
    FLAGS,
    CacheSettingError,
    read_json,
    refusal,
)
from mlx_stream.defaults import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_SINKS,
    DEFAULT_SLACK,
    DEFAULT_STRIDE,
    DEFAULT_WINDOW,
)


@dataclass(frozen=True)
class CacheSpec:
    """A sink + window cache policy: what ``make_sink_cache`` builds, as one value.

    Attributes:
        sinks (int): First tokens kept forever. Default: ``4``.
        window (int): Most recent tokens each query sees. Default: ``1024``.
        slack (int): Extra ring slots for rollback: ``trim(n)`` is exact for ``n <=
            slack + 1`` (a multi-token call needs none). Default (``None``): ``0``;
            see :meth:`for_draft`. 4-bit keys round it up (``kvquant.ring_slack``).
        stride (int): Sinks move and the buffer rebases only at multiples of this
            token index. Default: ``64``.
        positions (str): ``"cache"`` (bounded StreamingLLM positions) or
            ``"absolute"`` (positions grow with the stream). Default: ``"cache"``.
        kv_bits (int, optional): Store keys and values quantized to 4 or 8 bits.
            Default: ``None`` (the model's float dtype).
        kv_group_size (int): Quantization group size: 32, 64 or 128. Default: ``64``.
        key_bits (int, optional): Bits of the keys when they differ from
            ``kv_bits``; normalized to ``kv_bits`` when not given.
        recall (RecallSpec, optional): The recall tier (``mlx_stream.recall``): evicted
            blocks kept and brought back; not part of the JSON form. Default: off.

    Raises:
        CacheSettingError: A setting a SinkCache cannot have (one line).
    """

    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    slack: int | None = None
    stride: int = DEFAULT_STRIDE
    positions: str = "cache"
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    key_bits: int | None = None
    recall: Any = None

    def __post_init__(self) -> None:
        if self.slack is None:  # make_sink_cache's rule: slack serves rollback only
            object.__setattr__(self, "slack", DEFAULT_SLACK)
        found = refusal(self)
        if found is not None:
            raise CacheSettingError(*found)
        if self.key_bits is None:  # one spelling per policy: 8-bit keys of an 8-bit cache
            object.__setattr__(self, "key_bits", self.kv_bits)

    # ----- constructors ---------------------------------------------------------------

    @classmethod
    def for_model(
        cls,
        entry: Any = None,
        sinks: int | None = None,
        window: int | None = None,
        positions: str = "cache",
        kv_bits: int | None = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
        key_bits: int | None = None,
        num_draft_tokens: int | None = None,
    ) -> CacheSpec:
        """The policy a command runs: the registry entry's sizes, the user's options
        over them. Refusals name the CLI flags (``--window must be at least 1``).

        Args:
            entry: The registry entry (``ModelSpec``: its ``sinks`` and ``window``), or
                ``None`` for a model given by path (the package defaults).
            sinks, window (int, optional): ``--sinks`` / ``--window``; ``None``: the
                entry's.
            positions, kv_bits, kv_group_size, key_bits: The other cache options.
            num_draft_tokens (int, optional): Speculative draft tokens per round: the
                slack then holds a verify block (:meth:`for_draft`).

        Raises:
            CacheSettingError: An option a SinkCache cannot have, naming its flag.
        """
        if sinks is None:
            sinks = entry.sinks if entry is not None else DEFAULT_SINKS
        if window is None:
            window = entry.window if entry is not None else DEFAULT_WINDOW
        try:
            spec = cls(sinks, window, None, DEFAULT_STRIDE, positions, kv_bits, kv_group_size,
                       key_bits)  # fmt: skip
        except CacheSettingError as e:
            raise e.flagged() from None
        return spec if num_draft_tokens is None else spec.for_draft(num_draft_tokens)

    def for_draft(self, num_draft_tokens: int) -> CacheSpec:
        """This policy with room for the rollback of a speculative verify block of
        ``num_draft_tokens + 1`` tokens (the slack rule: at least that, and at least the
        slack it has)."""
        return self.replace(slack=max(self.slack, num_draft_tokens + 1))

    def replace(self, **changes: Any) -> CacheSpec:
        """A copy with ``changes`` (validated like any other)."""
        return dataclasses.replace(self, **changes)

    # ----- JSON -----------------------------------------------------------------------

    def to_json(self) -> dict:
        """The eight settings as a JSON-ready dict (field names as keys)."""
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def from_json(cls, data: dict) -> CacheSpec:
        """The policy a JSON dict holds: :meth:`to_json`'s form, or a SinkCache's
        ``meta_state`` (other keys ignored). Files written before quantization
        existed lack the last three settings: their defaults then.

        Raises:
            Unsupported: Not a dict, a setting missing or of the wrong type, or
                settings a SinkCache cannot have.
        """
        return cls(**read_json(data))

    @classmethod
    def of(cls, cache: Any) -> CacheSpec:
        """The policy of a SinkCache (read from its ``meta_state``: the slack asked
        for, where per-channel keys round the ring's up)."""
        return cls.from_json(cache.meta_state)

    # ----- what it costs and what it builds -------------------------------------------

    def bytes_for(self, layout: Any) -> int:
        """Exact bytes of a full cache of this policy for an ``estimate.KVLayout``."""
        from mlx_stream.cache.estimate import cache_bytes

        return cache_bytes(layout, self.sinks, self.window, self.slack, self.positions,
                           self.kv_bits, self.kv_group_size, self.key_bits, self.stride)  # fmt: skip

    def bytes(self, model: Any) -> int:
        """Exact bytes of this policy's full cache for ``model`` (what ``sum(c.nbytes)``
        reaches once every slot is written), worked out without allocating; ``0`` for a
        model with no layer it makes a SinkCache."""
        from mlx_stream.cache.estimate import model_layout

        layout = model_layout(model)
        return 0 if layout is None else self.bytes_for(layout)

    def build(self, model: Any, check_memory: bool = True) -> list:
        """The model's prompt cache under this policy (``make_sink_cache``).

        Args:
            model: An mlx-lm model.
            check_memory (bool): First refuse a cache larger than the memory available
                or a group size that does not divide the head dimension, with one line
                (:func:`make_checked_sink_cache`). Default: ``True``.

        Raises:
            UserError: The cache would not fit (bytes needed and available).
            Unsupported: A model this cache would serve inexactly.
        """
        if check_memory:
            from mlx_stream.cache.estimate import check_spec

            check_spec(model, self)
        from mlx_stream.cache.build import build_sink_cache

        return build_sink_cache(model, self)


def make_checked_sink_cache(model: Any, sinks: int, window: int, **options: Any) -> list:
    """``make_sink_cache(model, sinks, window, **options)`` after checking that the
    full cache fits in memory: ``CacheSpec(sinks, window, **options).build(model)``.

    Raises:
        UserError: Impossible sizes, or a cache larger than the memory available
            (with both figures), before anything is allocated.
    """
    return CacheSpec(sinks, window, **options).build(model)
