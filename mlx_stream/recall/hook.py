"""The way to the queries: the recall tier's handler of mlx-lm's attention function.

mlx-lm attention layers do ``keys, values = cache.update_and_fetch(k, v)`` and then
``scaled_dot_product_attention(queries, keys, values, cache=cache, scale=..., mask=...)``.
``mlx_stream.cache.attention`` wraps that name once in the modules a model's layers
come from; the tier registers here for the calls of caches that have it
(``cache.recall`` set), which gives it the queries of every layer and lets it attend
over the retrieved region and the window together, without copying any model file.
Every other call passes through unchanged.

Whether a model's forward pass reaches the wrapper for every cached layer is not
assumed: :func:`install` runs the lazy probe pass (shapes only, nothing computed) and
refuses, with one line, a model where some layer never calls it (the model's attention
then stays as it was).
"""

from __future__ import annotations

from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache import attention
from mlx_stream.errors import Unsupported


def _claims(cache, keys) -> bool:
    return getattr(cache, "recall", None) is not None


def _attend(queries, keys, values, cache, scale, mask, sinks, original):
    return cache.recall.attend(cache, queries, keys, values, scale, mask, sinks, original)


attention.register("recall", attention.Handler(_claims, _attend))


class _Probe:
    """Stands in for a recall tier during the probe pass: plain attention."""

    def attend(self, cache, queries, keys, values, scale, mask, sinks, original):
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model, layers: list[int], name: str) -> None:
    """Wrap the attention function of ``model``'s modules and prove, with a lazy probe
    pass, that every cache index in ``layers`` reaches it.

    Raises:
        Unsupported: One line naming the first layer whose attention does not call it.
    """
    caches = mlx_cache.make_prompt_cache(model)
    for i in layers:
        caches[i].recall = _Probe()
    try:
        missing = attention.prove(model, caches, "recall", layers)
    except Exception as e:  # noqa: BLE001 - a foreign model failing is a refusal
        raise Unsupported(f"{name}: recall's probe pass failed ({type(e).__name__}: {e})") from e
    if missing:
        raise Unsupported(
            f"{name}: recall cannot see the queries of layer {missing[0]} (its attention "
            "does not call mlx-lm's scaled_dot_product_attention); run it without --recall"
        )
