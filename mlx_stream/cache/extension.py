"""The cache's extension seam: a package that adds state to a prompt cache (the recall
tier) registers an :class:`Extension` here when it is imported; the cache calls it to
build, save and load without importing it. A spec asking for an extension that is not
registered is refused with one line."""

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


def get(name: str) -> Extension:
    """The extension ``name``; ``Unsupported`` when its package was never imported."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise Unsupported(
            f"the cache's {name} extension is not loaded: import mlx_stream.{name} first"
        ) from None
