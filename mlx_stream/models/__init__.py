"""Models: which model a name means, and getting it into memory.

Lives here: the registry (``registry``: ``models.yaml`` -> ``ModelSpec``, the user cache
layout), pulling, converting and loading (``loader``) and the GGUF converter
(``gguf``). The packaged ``models.yaml`` sits next to this package in a wheel.

May import: the package's base modules (``errors``, ``files``, ``defaults``), mlx,
mlx-lm and the download libraries; never ``generate``, ``serve`` or ``eval``, nor
typer or rich (``tests/test_layering.py`` checks).
"""
