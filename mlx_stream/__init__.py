"""mlx-stream: run language models forever in fixed memory on MLX.

The public API is resolved lazily (PEP 562), so ``import mlx_stream`` loads neither MLX
nor mlx-lm, and the package never imports typer or rich (the CLI lives in ``cli/``).
Its folders and the layering between them: docs/development.md::

    from mlx_stream import CacheSpec, RecallSpec, load, make_sink_cache, stream_generate

    model, tokenizer = load()  # the registry default, pulled on first use
    cache = make_sink_cache(model, sinks=4, window=1024)  # or, as one value:
    cache = CacheSpec(sinks=4, window=1024).build(model)
    cache = make_sink_cache(model, window=512, recall=RecallSpec())  # remembers past it
    for r in stream_generate(model, tokenizer, "Hello", max_tokens=32, prompt_cache=cache):
        print(r.text, end="")
"""

from __future__ import annotations

import importlib
from typing import Any

from mlx_stream import blas as _blas

# On Linux, an installed OpenBLAS must be loaded before mlx.core to serve MLX's CPU
# matmuls (its vendored reference BLAS is far slower); a no-op elsewhere.
_blas.preload()

__version__ = "0.1.0"

# The stable top-level API: public name -> (module, attribute), imported on first use.
_API = {
    # (model, tokenizer) for a registry name, an mlx-lm folder or a .gguf file.
    "load": ("mlx_stream.models.loader", "load"),
    "make_sink_cache": ("mlx_stream.cache.sink", "make_sink_cache"),
    "SinkCache": ("mlx_stream.cache.sink", "SinkCache"),
    # One frozen value for a cache policy: validated, its bytes, JSON, build(model).
    "CacheSpec": ("mlx_stream.cache.spec", "CacheSpec"),
    # The recall tier's policy: make_sink_cache(model, ..., recall=RecallSpec()).
    "RecallSpec": ("mlx_stream.recall.spec", "RecallSpec"),
    "stream_generate": ("mlx_stream.generate.decode", "stream_generate"),
    "ChatSession": ("mlx_stream.generate.session", "ChatSession"),
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _API[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # resolved once: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
