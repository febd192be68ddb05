"""The recall tier: what leaves the window is kept and brought back when the queries
need it, in fixed device memory.

``spec`` (the policy value, :class:`RecallSpec`), ``store`` (evicted blocks in host
memory or memory-mapped files), ``select`` (block summaries and scoring), ``hook`` (the
proof that a model's attention reaches the cache's seam), ``tier`` (the client of the
cache's layers, ``cache.hooks``: one per model cache). Turn it on with
``make_sink_cache(model, ..., recall=RecallSpec())`` or ``CacheSpec(..., recall=...)``.

May import ``cache`` and the package's base modules, nothing above them
(``tests/test_layering.py`` checks). The cache never imports it: importing this package
registers how a cache builds, saves and loads a tier (``seam``, ``cache.extension``).
"""

from mlx_stream.cache import extension
from mlx_stream.recall.names import tier_of
from mlx_stream.recall.seam import RecallExtension
from mlx_stream.recall.spec import RecallSpec

extension.register(RecallExtension())

__all__ = ["RecallSpec", "tier_of"]
