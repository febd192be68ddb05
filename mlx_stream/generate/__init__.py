"""Generation: turning a model and a cache into tokens.

Lives here: the decode loops (``decode``, ``speculative``, ``steps``), prompt feeding
(``prefill``), the chat session (``session``, with ``transcript`` and ``saving``),
edit repair (``repair``) and batched decode (``batch``).

May import: ``cache``, ``models`` and the package's base modules; never ``serve`` or
``eval``, nor typer or rich (``tests/test_layering.py`` checks).
"""
