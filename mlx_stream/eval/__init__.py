"""Evaluation: measuring what a cache policy costs in quality.

Lives here: streaming perplexity with checkpoints (``perplexity``), divergence from
the full cache (``divergence``) passkey recall prompts (``passkey``) and needles in long
haystacks for the recall tier (``needle``).

May import: ``generate``, ``cache``, ``models``, ``checkpoint`` and the package's base
modules; never ``serve``, nor typer or rich (``tests/test_layering.py`` checks).
"""
