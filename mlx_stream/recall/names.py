"""What every recall module may import without reaching the others: the cache file's
metadata key and :func:`tier_of`."""

from mlx_stream.cache.extension import SHIPPED_KEYS

KEY = SHIPPED_KEYS["recall"]  # the cache file's metadata: its sidecar and the manifest's sha256


def tier_of(caches: list):
    """The recall tier (``tier.Recall``) a prompt cache's layers share, or ``None``."""
    return next((c.recall for c in caches if getattr(c, "recall", None) is not None), None)
