"""Serving: the OpenAI-compatible server behind ``mlx-stream serve``.

Lives here: the engine (``engine``: sessions, admission, the scheduler's worker
thread), the HTTP routes (``app``: FastAPI) and token logprobs (``logprobs``).

May import: ``generate``, ``cache``, ``models``, ``distributed`` and the package's
base modules; nothing imports it but the CLI. Never typer or rich
(``tests/test_layering.py`` checks).
"""
