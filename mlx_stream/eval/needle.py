"""Needles in long haystacks: what the window, the window with recall and the full
cache can still find, at contexts past the model's trained length.

A chat prompt (the model's template) holds ``length`` tokens of haystack (a book, or
filler sentences) with one needle sentence at a ``depth`` (0.1 = near the start, 0.9
= near the question), then asks for it:

* ``passkey``: a random five-digit pass key;
* ``word``: a word fact ("the secret word is <word>") with a word from a fixed list.

Each prompt is answered greedily through every cache asked for: ``window`` (sinks +
window), ``recall`` (the same with the recall tier) and ``full`` (mlx-lm's KVCache,
only where the prompt fits the trained context). An answer counts when it contains
the needle's value (case-insensitive).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.eval.passkey import FILLER, SYSTEM, answer

KINDS = ("passkey", "word")
CACHES = ("window", "recall", "full")
WORDS = ("lighthouse", "pineapple", "volcano", "saxophone", "tangerine", "glacier",
         "compass", "lantern", "harbor", "meteor", "walnut", "canyon")  # fmt: skip
NEEDLE = {
    "passkey": (" The pass key is {v}. Remember it. {v} is the pass key. ",
                " What is the pass key? The pass key is"),
    "word": (" The secret word is {v}. Remember it. {v} is the secret word. ",
             " What is the secret word? The secret word is"),
}  # fmt: skip
SENTINEL = "\x00HAYSTACK\x00"


@dataclass
class NeedlePrompt:
    tokens: list[int]
    value: str
    needle_at: int  # index of the needle's first token
    needle_len: int  # its tokens


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def filler_unit(tokenizer: Any) -> int:
    """Tokens of one round of the filler's sentences (a whole-sentence boundary)."""
    return len(_encode(tokenizer, FILLER))


def filler_tokens(tokenizer: Any, n: int) -> list[int]:
    unit = _encode(tokenizer, FILLER)
    return (unit * (n // len(unit) + 1))[:n]


def build(tokenizer: Any, haystack: list[int], kind: str, length: int, depth: float,
          value: str, align: int = 1) -> NeedlePrompt:  # fmt: skip
    """The prompt of about ``length`` tokens with the needle at ``depth`` of the
    haystack; with ``align`` (the filler's sentence length in tokens) the needle and
    the question start at whole filler sentences, the prompt up to ``align`` shorter."""
    needle_text, question_text = NEEDLE[kind]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": SENTINEL}]  # fmt: skip
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    else:
        full = f"{SYSTEM}\n{SENTINEL}\n"
    head_text, tail_text = full.split(SENTINEL)
    head, tail = _encode(tokenizer, head_text), _encode(tokenizer, tail_text)
    needle = _encode(tokenizer, needle_text.format(v=value))
    question = _encode(tokenizer, question_text.split("?")[0] + "?")
    cue = _encode(tokenizer, question_text.split("?")[1])
    room = length - len(head) - len(tail) - len(needle) - len(question) - len(cue)
    if room < 1:
        raise ValueError(f"a needle prompt needs more than {length} tokens")
    if len(haystack) < room:
        raise ValueError(f"the haystack has {len(haystack)} tokens, {room} needed")
    room = room // align * align
    at = int(room * depth) // align * align
    body = haystack[:at] + needle + haystack[at:room]
    tokens = head + body + question + tail + cue
    return NeedlePrompt(tokens, value, len(head) + at, len(needle))


def needle_eval(
    model: nn.Module,
    tokenizer: Any,
    haystack: list[int],
    lengths: Sequence[int],
    depths: Sequence[float],
    kinds: Sequence[str] = KINDS,
    caches: Sequence[str] = CACHES,
    sinks: int = 4,
    window: int = 512,
    recall=None,
    context: int | None = None,
    answer_tokens: int = 8,
    seed: int = 0,
    callback: Callable[[dict], None] | None = None,
    inspect: Callable[[Any, NeedlePrompt, dict], None] | None = None,
    align: int = 1,
) -> list[dict]:
    """One row per length, kind, depth and cache: the answer and whether it holds the
    needle's value. ``full`` runs only where the prompt fits ``context``.

    Args:
        recall (RecallSpec): The recall policy of the ``recall`` cache.
        callback (Callable[[dict], None], optional): Called with each row as it is done.
        inspect (Callable, optional): Called with ``(recall tier, prompt, row)`` before
            each recall prompt is answered (a benchmark's measurements go in ``row``).
        align (int): Needle and question at multiples of this many haystack tokens
            (:func:`filler_unit` for the filler: whole sentences). Default: ``1``.
    """
    from mlx_stream.recall import RecallSpec

    recall = recall or RecallSpec()
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        for kind in kinds:
            for depth in depths:
                value = str(rng.randrange(10000, 100000)) if kind == "passkey" else rng.choice(
                    WORDS)  # fmt: skip
                p = build(tokenizer, haystack, kind, length, depth, value, align)
                for name in caches:
                    if name == "full" and context is not None and len(p.tokens) > context:
                        continue
                    if name == "full":
                        cache = make_prompt_cache(model)
                    else:
                        cache = make_sink_cache(
                            model, sinks, window, recall=recall if name == "recall" else None
                        )
                    extra: dict = {}
                    if inspect is not None and name == "recall":
                        inspect(cache[0].recall, p, extra)
                    tic = time.perf_counter()
                    got = answer(model, tokenizer, cache, p.tokens, answer_tokens)
                    seconds = time.perf_counter() - tic
                    row = {"length": len(p.tokens), "length_asked": length, "kind": kind,
                           "depth": depth,
                           "cache": name, "value": value, "answer": got,
                           "found": value.lower() in got.lower(),
                           "needle_distance": len(p.tokens) - p.needle_at,
                           "seconds": round(seconds, 1)}  # fmt: skip
                    r = getattr(cache[0], "recall", None)
                    if r is not None:
                        bs = r.block
                        row["needle_blocks"] = blocks = sorted(
                            {p.needle_at // bs, (p.needle_at + p.needle_len - 1) // bs}
                        )
                        row["needle_selected"] = all(b in r.selection for b in blocks)
                        row["selection"] = list(r.selection)
                        row["store_bytes"] = r.store_nbytes
                        row["region_bytes"] = r.device_nbytes
                        r.close()
                    row.update(extra)
                    rows.append(row)
                    if callback is not None:
                        callback(row)
    return rows
