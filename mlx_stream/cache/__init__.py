"""The KV cache: everything that decides what a model keeps of its context.

Lives here: the policy (``spec``: :class:`CacheSpec`), the sink + window cache
(``sink``: :class:`SinkCache`, its save and load; ``layer``, ``ring``, ``relayout``,
``storage``/``channel``/``variants``/``kvquant``, ``positions``: its parts), the seam a
client of a layer plugs into (``hooks``), the one patch of mlx-lm's attention
(``attention``), the batched cache (``batched``), the reclaim schedule (``reclaim``) and
the bytes-before-allocating estimate (``estimate``). The parts: docs/cache.md.

May import mlx, mlx-lm's cache classes, numpy and the package's base modules; nothing
above it, nor typer or rich (``tests/test_layering.py`` checks). The names below are
re-exported lazily (PEP 562): importing ``estimate`` or ``ring`` does not load mlx-lm.
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
