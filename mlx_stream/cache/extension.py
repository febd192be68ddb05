"""How a prompt cache is built, saved and loaded with a client's state (the recall tier):
the client's package registers an :class:`Extension` here when it is imported, and the
cache calls it without importing it. A registry, not an argument, because a cache file
must find the extension of the state it holds from its key alone (``load_cache``'s
``"saved"``). The layers reach their client through ``cache.hooks`` alone."""

from __future__ import annotations

from typing import Any, Protocol

from mlx_stream.errors import Unsupported


class Extension(Protocol):
    """What the cache asks of an extension (``name``: the ``CacheSpec`` field and the
    package ``mlx_stream.<name>``; ``key``: the cache file's metadata key it owns)."""

    name: str
    key: str

    def check(self, model, caches: list, verdict, spec) -> Any:
        """Refuse what it cannot serve; return ``spec`` with what it needs (slack)."""

    def attach(self, spec, caches: list) -> None:
        """Give the built SinkCache layers of ``caches`` its state."""

    def of(self, caches: list) -> Any:
        """Its state on a prompt cache, or ``None``."""

    def stage(self, path, state, mode: int | None) -> Any:
        """Write ``state`` beside ``path``: an object with ``binding`` (the metadata
        value), ``commit()``, ``discard()`` and ``finish()``."""

    def drop(self, path) -> None:
        """Remove what an earlier save left beside ``path``."""

    def admit(self, path, binding: str | None, setting: Any, model) -> None:
        """Refuse a file whose saved state (``binding``) does not match ``setting``."""

    def restore(self, path, binding: str, model, raw: list, verdict, caches: list,
                setting: Any) -> None:  # fmt: skip
        """Give the loaded ``caches`` the saved state."""


_REGISTRY: dict[str, Extension] = {}
# The cache-file keys of the extensions this package ships, by name: a file holding one
# is refused, not loaded without it, in a process that never imported the extension.
SHIPPED_KEYS = {"recall": "mlx_stream_recall"}


def register(extension: Extension) -> None:
    """Make ``extension`` available to every cache built, saved or loaded from now on."""
    _REGISTRY[extension.name] = extension


def registered() -> list[Extension]:
    return list(_REGISTRY.values())


def requested(spec) -> list[Extension]:
    """The extensions a ``CacheSpec`` asks for (its field of each one's name is set)."""
    return [get(name) for name in SHIPPED_KEYS if getattr(spec, name, None) is not None]


def get(name: str) -> Extension:
    """The extension ``name``; ``Unsupported`` when its package was never imported."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise Unsupported(
            f"the cache's {name} extension is not loaded: import mlx_stream.{name} first"
        ) from None
