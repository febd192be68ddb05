"""The recall tier: what leaves the window is kept and brought back when the queries
need it, in fixed device memory.

``spec`` (the policy value, :class:`RecallSpec`), ``store`` (evicted blocks in host
memory or memory-mapped files), ``select`` (block summaries and scoring), ``hook`` (the
queries, through mlx-lm's attention function), ``tier`` (the runtime glue, one per
model cache). Turn it on with ``make_sink_cache(model, ..., recall=RecallSpec())`` or
``CacheSpec(..., recall=RecallSpec())``.

May import: ``cache`` and the package's base modules; never ``models``, ``generate``,
``eval`` or ``serve`` (``tests/test_layering.py`` checks). ``cache.sink`` reaches it only
lazily, to build a cache that asked for it; ``generate.decode`` calls it at a prompt's end.
"""

from mlx_stream.recall.spec import RecallSpec

__all__ = ["RecallSpec", "tier_of"]


def tier_of(caches: list):
    """The recall tier (``tier.Recall``) a prompt cache's layers share, or ``None``."""
    return next((c.recall for c in caches if getattr(c, "recall", None) is not None), None)
