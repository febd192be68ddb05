"""The KV cache: everything that decides what a model keeps of its context.

Lives here: the cache policy as one value (``spec``: :class:`CacheSpec`), the sink +
window cache (``sink``: :class:`SinkCache`, its save and load),
its parts (``ring``: slot layout and masks; ``storage``, ``channel``, ``variants``: the
storage classes of keys and values, float, per-token or per-channel quantized;
``kvquant``: per-channel keys with their float residual; ``positions``: RoPE moves and
the model self-check), the one patch of mlx-lm's attention function (``attention``),
the batched cache (``batched``), the reclaim schedule for MLX's buffer pool
(``reclaim``) and the bytes-before-allocating estimate (``estimate``).

May import: mlx, mlx-lm's cache classes, numpy and the package's base modules
(``errors``, ``files``, ``defaults``); never ``models``, ``generate``, ``serve`` or
``eval``, nor typer or rich (``tests/test_layering.py`` checks).

The names below are re-exported from ``sink`` and ``spec`` lazily (PEP 562), so importing
``mlx_stream.cache.estimate`` or ``ring`` does not load mlx-lm.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SinkCache": "mlx_stream.cache.sink",
    "make_sink_cache": "mlx_stream.cache.sink",
    "save_cache": "mlx_stream.cache.sink",
    "load_cache": "mlx_stream.cache.sink",
    "max_call_tokens": "mlx_stream.cache.sink",
    "validate_sizes": "mlx_stream.cache.sink",
    "CacheSpec": "mlx_stream.cache.spec",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # resolved once: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
