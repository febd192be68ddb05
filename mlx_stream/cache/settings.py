"""The checks of a cache's eight settings (:class:`CacheSettingError` names the one a
SinkCache cannot have); ``CacheSpec`` and ``SinkCache`` both apply them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from mlx_stream.defaults import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_SINKS,
    DEFAULT_SLACK,
    DEFAULT_STRIDE,
    DEFAULT_WINDOW,
    KV_BITS,
    KV_GROUP_SIZES,
    POSITIONS,
)
from mlx_stream.errors import Unsupported

#: The CLI flag of each setting a user chooses (slack and stride have none).
FLAGS = {
    "sinks": "--sinks",
    "window": "--window",
    "positions": "--positions",
    "kv_bits": "--kv-bits",
    "kv_group_size": "--kv-group-size",
    "key_bits": "--kv-key-bits",
}
FIELDS = ("sinks", "window", "slack", "stride", "positions", "kv_bits", "kv_group_size", "key_bits")


class _Names(dict):
    """Field -> the name shown to the user; a field without one is shown as itself."""

    def __missing__(self, key: str) -> str:
        return key


class CacheSettingError(Unsupported):
    """A cache setting a SinkCache cannot have: one line naming it (as a field or as
    the CLI flag) and what it must be. Exit code 2; also a ``ValueError``."""

    def __init__(self, setting: str, requirement: str, names: dict | None = None):
        self.setting, self.requirement = setting, requirement
        super().__init__(f"{{{setting}}} {requirement}".format_map(_Names(names or {})))

    def flagged(self) -> CacheSettingError:
        """The same refusal naming the CLI flags."""
        return CacheSettingError(self.setting, self.requirement, FLAGS)


def refusal(s: Any) -> tuple[str, str] | None:
    """The first setting of ``s`` a SinkCache cannot have, with what it must be (other
    settings named as ``{field}``), or ``None``."""
    bits = " or ".join(map(str, KV_BITS))
    if s.window < 1:
        return "window", f"must be at least 1 (got {s.window})"
    if s.sinks < 0:
        return "sinks", f"must be 0 or more (got {s.sinks})"
    if s.slack < 0:
        return "slack", f"must be 0 or more (got {s.slack})"
    if s.stride < 1:
        return "stride", f"must be at least 1 (got {s.stride})"
    if s.positions not in POSITIONS:
        return "positions", f"must be one of {', '.join(POSITIONS)} (got {s.positions!r})"
    if s.kv_bits not in (None, *KV_BITS):
        return "kv_bits", f"must be {bits} (got {s.kv_bits})"
    if s.key_bits not in (None, *KV_BITS) or (s.key_bits is not None and s.kv_bits is None):
        return "key_bits", f"must be {bits}, with {{kv_bits}} set (got {s.key_bits})"
    if s.kv_group_size not in KV_GROUP_SIZES:
        sizes = ", ".join(map(str, KV_GROUP_SIZES[:-1])) + f" or {KV_GROUP_SIZES[-1]}"
        return "kv_group_size", f"must be {sizes} (got {s.kv_group_size})"
    return None


def read_json(data: dict) -> dict:
    """The settings a JSON dict holds (``CacheSpec.to_json``'s form, or a SinkCache's
    ``meta_state``; other keys ignored), their types checked; a missing setting is
    left out (files written before quantization lack the last three).

    Raises:
        Unsupported: Not a dict, ``sinks`` or ``window`` missing, or a setting of the
            wrong type.
    """
    if not isinstance(data, dict) or any(k not in data for k in ("sinks", "window")):
        raise Unsupported(f"not a cache policy (got {str(data)[:80]})")
    values = {k: data[k] for k in FIELDS if k in data}
    for k, v in values.items():
        kind = str if k == "positions" else int
        optional = k in ("slack", "kv_bits", "key_bits")
        if not (type(v) is kind or (optional and v is None)):
            what = "a string" if kind is str else "an integer"
            raise Unsupported(f"cache setting {k!r} must be {what} (got {v!r})")
    return values


def checked(
    sinks: int = DEFAULT_SINKS,
    window: int = DEFAULT_WINDOW,
    slack: int | None = None,
    stride: int = DEFAULT_STRIDE,
    positions: str = "cache",
    kv_bits: int | None = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    key_bits: int | None = None,
) -> SimpleNamespace:
    """The eight settings as ``CacheSpec`` holds them (``slack`` 0 and ``key_bits``
    ``kv_bits`` when not given), checked: what a SinkCache is configured from when it is
    given no ``CacheSpec`` (this module is below the spec's, which builds caches)."""
    slack = DEFAULT_SLACK if slack is None else slack
    key_bits = kv_bits if key_bits is None else key_bits
    s = SimpleNamespace(sinks=sinks, window=window, slack=slack, stride=stride,
                        positions=positions, kv_bits=kv_bits, kv_group_size=kv_group_size,
                        key_bits=key_bits)  # fmt: skip
    found = refusal(s)
    if found is not None:
        raise CacheSettingError(*found)
    return s


def validate_sizes(sinks: int, window: int, *settings, **named) -> None:
    """Raise Unsupported (a ValueError), saying what to change, for sizes a SinkCache
    cannot have (:func:`checked`, the checks of :class:`~mlx_stream.cache.spec.CacheSpec`)."""
    checked(sinks, window, *settings, **named)
