"""The way to the queries: proof that a model's layers reach the cache's attention seam.

The tier takes each layer's attention calls through ``mlx_stream.cache.hooks`` (the
client of a SinkCache is handed the calls of mlx-lm's ``scaled_dot_product_attention``,
wrapped once by ``mlx_stream.cache.attention``): it attends over the retrieved region and
the window together, without copying any model file. That needs mlx-lm's function
patched, because a model calls it by name after ``update_and_fetch`` (nothing the cache
returns can change that call). Whether every cached layer reaches the wrapper is not
assumed: :func:`install` runs the lazy probe pass (shapes only, nothing computed) and
refuses, with one line, a model where some layer never does.
"""

from __future__ import annotations

from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache import attention
from mlx_stream.cache.hooks import ATTENTION, Hooks
from mlx_stream.errors import Unsupported


class _Probe(Hooks):
    """Stands in for a recall tier during the probe pass: plain attention."""

    attends = True


def install(model, layers: list[int], name: str) -> None:
    """Wrap the attention function of ``model``'s modules and prove, with a lazy probe
    pass, that every cache index in ``layers`` reaches it.

    Raises:
        Unsupported: One line naming the first layer whose attention does not call it.
    """
    caches = mlx_cache.make_prompt_cache(model)
    for i in layers:
        caches[i].hooks = _Probe()  # mlx-lm's own caches: the seam reads the attribute
    try:
        missing = attention.prove(model, caches, ATTENTION, layers)
    except Exception as e:  # noqa: BLE001 - a foreign model failing is a refusal
        raise Unsupported(f"{name}: recall's probe pass failed ({type(e).__name__}: {e})") from e
    if missing:
        raise Unsupported(
            f"{name}: recall cannot see the queries of layer {missing[0]} (its attention "
            "does not call mlx-lm's scaled_dot_product_attention); run it without --recall"
        )
