"""Generation: turning a model and a cache into tokens.

Lives here: the decode loops (``decode``: ``generate_step``, ``stream_generate``,
speculative decoding), the chat session with its checkpoints (``session``:
``ChatSession``) and batched decode over many sessions (``batch``).

May import: ``cache``, ``models`` and the package's base modules; never ``serve`` or
``eval``, nor typer or rich (``tests/test_layering.py`` checks).
"""
