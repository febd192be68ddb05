"""One way to sample: mlx-lm's sampler and logits processors from a ``Sampling``.

Contract: :func:`make_sampling` returns ``(sampler, processors)`` for a
:class:`~mlx_stream.generate.model_config.Sampling`; a ``seed`` seeds ``mx.random``
first (the process's global random state, as mlx-lm's ``make_sampler`` draws from it).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_stream.generate.model_config import Sampling


def seed_random(seed: int | None) -> None:
    """Seed ``mx.random`` (what a sampler from :func:`make_sampling` draws), unless ``None``."""
    if seed is not None:
        mx.random.seed(seed)


def make_sampling(
    sample: Sampling, seed: int | None = None
) -> tuple[Callable[[mx.array], mx.array], list[Callable]]:
    """mlx-lm's sampler and logits processors (the repetition penalty's) for
    ``sample``, ``mx.random`` seeded with ``seed`` first when one is given."""
    seed_random(seed)
    sampler = make_sampler(sample.temp, sample.top_p, sample.min_p, top_k=sample.top_k)
    return sampler, make_logits_processors(repetition_penalty=sample.repetition_penalty)
