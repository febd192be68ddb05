"""Models: which model a name means, and getting it into memory.

Lives here: the registry (``registry``: ``models.yaml`` -> ``ModelSpec``, the user cache
layout), pulling, converting and loading (``loader``), the GGUF converter (``gguf``)
and Hugging Face ids (``hub``: the shared Hugging Face cache, LM Studio's folder, the
download with its fit check). The packaged ``models.yaml`` sits next to this package in
a wheel.

May import: the package's base modules (``errors``, ``files``, ``defaults``), the cache's
memory estimate (``cache.estimate``, for the fit check), mlx, mlx-lm and the download
libraries; never ``generate``, ``serve`` or ``eval``, nor typer or rich
(``tests/test_layering.py`` checks).
"""
