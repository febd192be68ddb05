"""What every recall module may import without reaching the others: the cache file's
metadata key and :func:`tier_of`."""

KEY = "mlx_stream_recall"  # the cache file's metadata: its sidecar and the manifest's sha256


def tier_of(caches: list):
    """The recall tier (``tier.Recall``) a prompt cache's layers share, or ``None``."""
    from mlx_stream.cache.hooks import hooks_of  # loads mlx: RecallSpec alone must not

    return hooks_of(caches)
