"""The one seam between a SinkCache layer and a client that keeps state beside it.

Contract: a client implements :class:`Hooks` (the recall tier is the one shipped) and
is given to each of its layers' caches (``SinkCache(hooks=)``, or
:meth:`~mlx_stream.cache.SinkCache.attach` once every layer exists). The cache calls it
before a write, after a trim and for its attention; the decode loop calls
:func:`prompt_end`. A cache without a client holds :data:`NONE`, whose events do nothing.
The attention call reaches the client through the one patch of mlx-lm's attention
function (``cache.attention``), registered here under :data:`ATTENTION`.
"""

from __future__ import annotations

from mlx_stream.cache import attention

ATTENTION = "hooks"  # the attention handler's name (``attention.prove`` checks it)


class Hooks:
    """A layer cache's client. Every event is a no-op here.

    Attributes:
        what (str): What the client is, for refusals ("a recall tier").
        attends (bool): Whether the client takes the layer's attention calls.
    """

    what = "no client"
    attends = False

    def before_write(self, cache, n: int, N: int) -> None:
        """``cache`` is about to write an ``N``-token call at token ``n``."""

    def trimmed(self, cache, tokens_seen: int) -> None:
        """``cache`` forgot its last tokens: ``tokens_seen`` remain."""

    def attend(self, cache, queries, keys, values, scale, mask, sinks, original):
        """The attention of a call on ``cache`` (``original``: mlx-lm's function)."""
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def prompt_end(self, model, caches: list, fed) -> None:
        """A prompt was fed up to its last token (``fed``: its tokens before it)."""


NONE = Hooks()


def hooks_of(caches: list) -> Hooks | None:
    """The client a prompt cache's layers share, or ``None``."""
    return next((h for c in caches if (h := getattr(c, "hooks", NONE)) is not NONE), None)


def prompt_end(model, caches: list, fed) -> None:
    """Tell the prompt cache's client that a prompt was fed up to its last token."""
    hooks = hooks_of(caches)
    if hooks is not None:
        hooks.prompt_end(model, caches, fed)


def _claims(cache, keys) -> bool:
    return getattr(cache, "hooks", NONE).attends


def _attend(queries, keys, values, cache, scale, mask, sinks, original):
    return cache.hooks.attend(cache, queries, keys, values, scale, mask, sinks, original)


attention.register(ATTENTION, attention.Handler(_claims, _attend))
