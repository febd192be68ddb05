"""mlx-stream: run language models forever in fixed memory on MLX.

The engine: a rolling KV cache that keeps attention sinks and a window of recent
tokens (``cache``), a reclaim schedule for MLX's buffer pool (``reclaim``), decode
loops (``decode``), model loading (``registry``, ``loader``, ``gguf``) and streaming
evaluation (``evaluate``). It never imports typer or rich.
"""

from mlx_stream import blas as _blas

# On Linux, an installed OpenBLAS must be loaded before mlx.core to serve MLX's CPU
# matmuls (its vendored reference BLAS is ~30x slower); a no-op elsewhere.
_blas.preload()

__version__ = "0.1.0"
