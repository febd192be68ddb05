"""The one patch of mlx-lm's attention function: ``scaled_dot_product_attention``, the
name each mlx-lm model module imports from ``mlx_lm.models.base`` and calls with
``cache=`` after ``cache.update_and_fetch``.

Contract: handlers register (:func:`register`: ``claims(cache, keys)`` and ``attend``):
the packed keys of ``cache.qattend`` and a layer's client (``cache.hooks``).
:func:`prove` wraps the attention function of the modules a model's layers come from,
once per module, and runs one lazy probe pass (shapes only) recording which caches'
calls each handler took; a failed pass or a layer never reached puts the modules it
wrapped back. The wrapper hands a call to the first handler that claims it, every
other call to the function it replaced, unchanged; :func:`restore` puts it back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx

from mlx_stream.mlxlm import ATTENTION_NAME as NAME  # the function the wrapper replaces


class Handler(NamedTuple):
    """What a handler of the wrapped attention does: ``claims(cache, keys)`` whether a
    call is its own; ``attend(queries, keys, values, cache, scale, mask, sinks,
    original)`` the attention of a call it claims (``original``: the function the
    wrapper replaced)."""

    claims: Callable
    attend: Callable


@dataclass
class _Patch:
    """One module's patch: the function it replaced, the wrapper, and the handlers
    proven to be reached through it."""

    original: Callable
    wrapper: Callable
    proven: set = field(default_factory=set)


_HANDLERS: dict[str, Handler] = {}
_PATCHES: dict = {}  # module -> _Patch
_WATCH: dict[int, set] = {}  # during a probe: id(cache) -> names of the handlers it reached


def register(name: str, handler: Handler) -> None:
    """Make ``handler`` take the calls it claims in every wrapped module."""
    _HANDLERS[name] = handler


def modules(model) -> list:
    """Python modules of the model's classes that import mlx-lm's attention by name."""
    out = []
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if module is not None and hasattr(module, NAME) and module not in out:
            out.append(module)
    return out


def _wrap(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        for name, handler in _HANDLERS.items():
            if handler.claims(cache, keys):
                if _WATCH and id(cache) in _WATCH:
                    _WATCH[id(cache)].add(name)
                return handler.attend(queries, keys, values, cache, scale, mask, sinks, original)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return scaled_dot_product_attention


def patched(module) -> bool:
    """Whether ``module``'s attention function is the wrapper."""
    patch = _PATCHES.get(module)
    return patch is not None and getattr(module, NAME, None) is patch.wrapper


def install(model) -> list:
    """Wrap the attention function of ``model``'s modules not wrapped yet; returns them."""
    new = []
    for module in modules(model):
        fn = getattr(module, NAME)
        if callable(fn) and not patched(module):
            _PATCHES[module] = _Patch(fn, _wrap(fn))
            setattr(module, NAME, _PATCHES[module].wrapper)
            new.append(module)
    return new


def restore(targets: list | None = None) -> None:
    """Put the original attention function back in ``targets`` (default: every
    wrapped module); a module whose function was replaced again since is left."""
    for module in list(_PATCHES) if targets is None else targets:
        patch = _PATCHES.pop(module, None)
        if patch is not None and getattr(module, NAME, None) is patch.wrapper:
            setattr(module, NAME, patch.original)


def prove(model, caches: list, name: str, layers: list[int]) -> list[int]:
    """Install the wrapper on ``model``'s modules and run ``model`` once, lazily, on
    ``caches``: the indices in ``layers`` whose attention call handler ``name`` did not
    take (empty: proven). A failed pass re-raises after the modules it wrapped are
    restored; so does a missing layer, without raising.
    """
    new = install(model)
    for c in caches:
        _WATCH[id(c)] = set()
    try:
        model(mx.array([[0]]), cache=caches)  # lazy: builds the graph, computes nothing
        missing = [i for i in layers if name not in _WATCH[id(caches[i])]]
    except BaseException:
        _undo(new)
        raise
    finally:
        for c in caches:
            _WATCH.pop(id(c), None)
    if missing:
        _undo(new)
    else:
        for module in modules(model):
            if module in _PATCHES:
                _PATCHES[module].proven.add(name)
    return missing


def proven(targets: list, name: str) -> bool:
    """Whether handler ``name`` was proven on every module of ``targets``, still wrapped."""
    return all(patched(m) and name in _PATCHES[m].proven for m in targets)


def _undo(new: list) -> None:
    restore([m for m in new if not _PATCHES[m].proven])
