"""The recall tier: what leaves the window is kept and brought back when the queries
need it, in fixed device memory.

``spec`` (the policy value, :class:`RecallSpec`), ``store`` (evicted blocks in host
memory or memory-mapped files), ``select`` (block summaries and scoring), ``hook`` (the
queries, through mlx-lm's attention function), ``tier`` (the runtime glue, one per
model cache). Turn it on with ``make_sink_cache(model, ..., recall=RecallSpec())``.
"""

from mlx_stream.recall.spec import RecallSpec

__all__ = ["RecallSpec"]
