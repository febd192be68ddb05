"""Stop a reply that has fallen into a loop: one span of tokens over and over.

Contract: a :class:`LoopGuard` is fed each token of one reply and answers ``True`` once
the reply's last ``span`` tokens repeat one period of at most ``span // MIN_REPEATS``
tokens exactly (so the period came back at least :data:`MIN_REPEATS` times in a row).
Small models sampled or greedy can repeat a line until ``max_tokens``; an agent client
then takes the cut reply as a failed turn and the user waits through every token of it.
The guard only ends the reply early; the tokens it saw stay in the reply.

By hand: neither mlx-lm nor llama.cpp stops on a loop (llama.cpp's DRY sampler and
repetition penalties make a loop less likely, they do not end one).
"""

from __future__ import annotations

import numpy as np

from mlx_stream.defaults import LOOP_REPEATS as MIN_REPEATS  # a period fills the span so often

CHECK_EVERY = 8  # tokens between checks (a check costs span // MIN_REPEATS compares)


class LoopGuard:
    """Watches one reply for an exact repetition filling its last ``span`` tokens."""

    def __init__(self, span: int):
        if span < MIN_REPEATS:
            raise ValueError(f"a loop span must be at least {MIN_REPEATS} tokens, not {span}")
        self.span = span
        self.tokens: list[int] = []
        self.period: int | None = None  # the loop's period, once found

    def add(self, token: int) -> bool:
        """Take the reply's next token; whether the reply is now looping."""
        self.tokens.append(int(token))
        n = len(self.tokens)
        if n < self.span or (n - self.span) % CHECK_EVERY:
            return False
        self.period = repeating_period(self.tokens[-self.span :], self.span // MIN_REPEATS)
        return self.period is not None


def repeating_period(tokens: list[int], longest: int) -> int | None:
    """The shortest ``p <= longest`` with ``tokens[i] == tokens[i + p]`` for every
    ``i``, or ``None``."""
    tail = np.asarray(tokens)
    for p in range(1, min(longest, len(tail) - 1) + 1):
        if np.array_equal(tail[p:], tail[:-p]):
            return p
    return None
