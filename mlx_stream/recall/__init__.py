"""The recall tier: what leaves the window is kept and brought back when the queries
need it, in fixed device memory.

``spec`` (the policy value, :class:`RecallSpec`), ``store`` (evicted blocks in host
memory or memory-mapped files), ``select`` (block summaries and scoring), ``hook`` (the
queries, through mlx-lm's attention function), ``tier`` (the runtime glue, one per
model cache). Turn it on with ``make_sink_cache(model, ..., recall=RecallSpec())`` or
``CacheSpec(..., recall=RecallSpec())``.

May import: ``cache`` and the package's base modules; never ``models``, ``generate``,
``eval`` or ``serve`` (``tests/test_layering.py`` checks). The cache never imports it:
importing this package registers the tier as the cache's extension (``seam``), so a
``RecallSpec`` always finds it; ``generate.decode`` calls it at a prompt's end.
"""

from mlx_stream.cache import extension
from mlx_stream.recall.names import tier_of
from mlx_stream.recall.seam import RecallExtension
from mlx_stream.recall.spec import RecallSpec

extension.register(RecallExtension())

__all__ = ["RecallSpec", "tier_of"]
