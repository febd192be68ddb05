"""The way to the queries: mlx-lm's attention function, wrapped in the model's module.

mlx-lm attention layers do ``keys, values = cache.update_and_fetch(k, v)`` and then
``scaled_dot_product_attention(queries, keys, values, cache=cache, scale=..., mask=...)``,
a name each model module imports from ``mlx_lm.models.base``. Replacing that name in
the modules a model's layers come from with a wrapper that receives ``cache=`` gives
the recall tier the queries of every layer, and lets it attend over the retrieved
region and the window together, without copying any model file. The wrapper is a pure
pass-through for every cache that has no recall (``cache.recall`` unset), so it stays
installed once a model has asked for recall; it is never installed otherwise.

Whether a model's forward pass reaches the wrapper for every cached layer is not
assumed: :func:`install` runs a lazy probe pass (shapes only, nothing computed) and
refuses, with one line, a model where some layer never calls it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache.qattend import attention_modules
from mlx_stream.errors import Unsupported
from mlx_stream.mlxlm import ATTENTION_NAME as NAME


def _wrap(original):
    # mlx-lm's parameters (mlx_stream.mlxlm.ATTENTION_PARAMETERS), passed on by keyword
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        recall = getattr(cache, "recall", None)
        if recall is None:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                            sinks=sinks)  # fmt: skip
        return recall.attend(cache, queries, keys, values, scale, mask, sinks, original)

    scaled_dot_product_attention.recall_wrapper = True
    return scaled_dot_product_attention


class _Probe:
    """Stands in for a recall tier during the probe pass: records which layers call."""

    def __init__(self, index: int, seen: set):
        self.index, self.seen = index, seen

    def attend(self, cache, queries, keys, values, scale, mask, sinks, original):
        self.seen.add(self.index)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model, layers: list[int], name: str) -> None:
    """Wrap the attention function of ``model``'s modules and prove, with a lazy probe
    pass, that every cache index in ``layers`` reaches it.

    Raises:
        Unsupported: One line naming the first layer whose attention does not call it.
    """
    for module in attention_modules(model):
        fn = getattr(module, NAME)
        if callable(fn) and not getattr(fn, "recall_wrapper", False):
            setattr(module, NAME, _wrap(fn))
    caches = mlx_cache.make_prompt_cache(model)
    seen: set = set()
    for i in layers:
        caches[i].recall = _Probe(i, seen)
    try:
        model(mx.array([[0]]), cache=caches)  # lazy: builds the graph, computes nothing
    except Exception as e:  # noqa: BLE001 - a foreign model failing is a refusal
        raise Unsupported(f"{name}: recall's probe pass failed ({type(e).__name__}: {e})") from e
    missing = [i for i in layers if i not in seen]
    if missing:
        raise Unsupported(
            f"{name}: recall cannot see the queries of layer {missing[0]} (its attention "
            "does not call mlx-lm's scaled_dot_product_attention); run it without --recall"
        )
