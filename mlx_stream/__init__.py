"""mlx-stream: run language models forever in fixed memory on MLX.

The engine: a rolling KV cache that keeps attention sinks and a window of recent
tokens (``cache``), a reclaim schedule for MLX's buffer pool (``reclaim``), decode
loops (``decode``), model loading (``registry``, ``loader``, ``gguf``) and streaming
evaluation (``evaluate``). It never imports typer or rich.
"""

__version__ = "0.1.0"
