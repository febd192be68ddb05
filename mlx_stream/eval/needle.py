"""Needles in long haystacks: what the window, the window with recall and the full
cache can still find, at contexts past the model's trained length.

Contract: a chat prompt holds ``length`` tokens of haystack with one needle (a pass
key, a word or a fact) at a ``depth``, then asks for it (``primed`` or a plain
phrasing). Each prompt is answered greedily through every cache asked for
(``window``, ``recall``, ``full``); an answer counts when it contains the needle's
value (case-insensitive).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_stream.cache.hooks import hooks_of as tier_of
from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.defaults import DEFAULT_SINKS, DEFAULT_STRIDE
from mlx_stream.eval.passkey import FILLER, SYSTEM, answer
from mlx_stream.generate.prefill import feed_prompt

KINDS = ("passkey", "word", "fact")
CACHES = ("window", "recall", "full")
WORDS = ("lighthouse", "pineapple", "volcano", "saxophone", "tangerine", "glacier",
         "compass", "lantern", "harbor", "meteor", "walnut", "canyon")  # fmt: skip
TOWNS = ("Ravensford", "Millbrook", "Ashcombe", "Thornbury", "Wexley", "Dunmere",
         "Halloway", "Brackley", "Fernhollow", "Caldmoor", "Pennick", "Oakhurst")  # fmt: skip
NEEDLE = {
    "passkey": (" The pass key is {v}. Remember it. {v} is the pass key. ",
                " What is the pass key? The pass key is"),
    "word": (" The secret word is {v}. Remember it. {v} is the secret word. ",
             " What is the secret word? The secret word is"),
    "fact": (" Captain Elias Marwood kept his old brass telescope in a cottage in the town "
             "of {v}. ", " Where did Captain Elias Marwood keep his old brass telescope? "
             "He kept it in the town of"),
}  # fmt: skip
QUESTIONS = ("primed", "q0", "q1", "q2")
PLAIN = {
    "passkey": (" What is the pass key mentioned in the text? Answer with the number only.",
                " Which number was given as the pass key in the text above?",
                " Tell me the pass key that appears in this text."),
    "word": (" What is the secret word mentioned in the text? Answer with the word only.",
             " Which word was given as the secret word in the text above?",
             " Tell me the secret word that appears in this text."),
    "fact": (" In which town did Captain Elias Marwood keep his old brass telescope?",
             " According to the text, where was Captain Marwood's telescope kept?",
             " Name the town where Captain Elias Marwood kept his telescope."),
}  # fmt: skip
SENTINEL = "\x00HAYSTACK\x00"


@dataclass
class NeedlePrompt:
    tokens: list[int]
    value: str
    needle_at: int  # index of the needle's first token
    needle_len: int  # its tokens
    asked_at: int = 0  # index of the question's first token


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def filler_unit(tokenizer: Any) -> int:
    """Tokens of one round of the filler's sentences (a whole-sentence boundary)."""
    return len(_encode(tokenizer, FILLER))


def filler_tokens(tokenizer: Any, n: int) -> list[int]:
    unit = _encode(tokenizer, FILLER)
    return (unit * (n // len(unit) + 1))[:n]


def value_of(kind: str, rng: random.Random) -> str:
    """A random needle value of ``kind``."""
    if kind == "passkey":
        return str(rng.randrange(10000, 100000))
    return rng.choice(WORDS if kind == "word" else TOWNS)


def _question(tokenizer: Any, kind: str, question: str) -> tuple[list[int], list[int]]:
    """The question's tokens and the cue after the chat template's tail (primed only)."""
    if question == "primed":
        asked, cue = NEEDLE[kind][1].split("?")
        return _encode(tokenizer, asked + "?"), _encode(tokenizer, cue)
    return _encode(tokenizer, PLAIN[kind][int(question[1:])]), []


def build(tokenizer: Any, haystack: list[int], kind: str, length: int, depth: float,
          value: str, align: int = 1, question: str = "primed",
          asked: Sequence[str] = ()) -> NeedlePrompt:  # fmt: skip
    """The prompt of about ``length`` tokens with the needle at ``depth`` of the
    haystack; with ``align`` (the filler's sentence length in tokens) the needle and
    the question start at whole filler sentences, the prompt up to ``align`` shorter.
    ``question``: ``primed`` or a plain phrasing (``q0``...; see the module docstring).
    The haystack is sized for the longest of ``question`` and ``asked``, so prompts
    asking the same needle differently share everything before the question."""
    needle_text = NEEDLE[kind][0]
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
    question, cue = _question(tokenizer, kind, question)
    longest = max(sum(map(len, _question(tokenizer, kind, q))) for q in (*asked, "primed"))
    room = length - len(head) - len(tail) - len(needle) - longest
    if room < 1:
        raise ValueError(f"a needle prompt needs more than {length} tokens")
    if len(haystack) < room:
        raise ValueError(f"the haystack has {len(haystack)} tokens, {room} needed")
    room = room // align * align
    at = int(room * depth) // align * align
    body = haystack[:at] + needle + haystack[at:room]
    tokens = head + body + question + tail + cue
    return NeedlePrompt(tokens, value, len(head) + at, len(needle), len(head) + len(body))


def needle_eval(
    model: nn.Module,
    tokenizer: Any,
    haystack: list[int],
    lengths: Sequence[int],
    depths: Sequence[float],
    kinds: Sequence[str] = KINDS,
    caches: Sequence[str] = CACHES,
    sinks: int = DEFAULT_SINKS,
    window: int = 512,
    recall=None,
    context: int | None = None,
    answer_tokens: int = 8,
    seed: int = 0,
    callback: Callable[[dict], None] | None = None,
    inspect: Callable[[Any, NeedlePrompt, dict], None] | None = None,
    align: int = 1,
    questions: Sequence[str] = ("primed",),
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
        questions (Sequence[str]): How each needle is asked for (``QUESTIONS``), all
            from the same stream up to the first question.
    """
    from mlx_stream.recall import RecallSpec
    from mlx_stream.recall.spec import PROMPT_SELECTOR

    recall = recall or RecallSpec()
    rows = []
    for length, kind, depth in product(lengths, kinds, depths):
        # the same needle at a depth whatever the length: the full cache's shorter
        # prompts ask for what the longer ones hide
        value = value_of(kind, random.Random(f"{seed}:{kind}:{depth}"))
        prompts = [build(tokenizer, haystack, kind, length, depth, value, align, q, questions)
                   for q in questions]  # fmt: skip
        for name in caches:
            if name == "full" and context is not None and len(prompts[0].tokens) > context:
                continue
            if name == "full":
                cache = make_prompt_cache(model)
            else:
                cache = make_sink_cache(model, sinks, window,
                                        recall=recall if name == "recall" else None)  # fmt: skip
            asks = list(zip(prompts, questions, strict=True))
            for (_, question), row in zip(asks, _ask(model, tokenizer, name, cache, asks,
                                                     answer_tokens, inspect)):  # fmt: skip
                row.update(length_asked=length, kind=kind, depth=depth, question=question)
                if name == "recall":
                    row["prompt_selector"] = PROMPT_SELECTOR
                rows.append(row)
                if callback is not None:
                    callback(row)
            tier = tier_of(cache)
            if tier is not None:
                tier.close()
    return rows


def _prefill(model, cache: list, tokens: list[int]) -> None:
    """Feed ``tokens`` as the start of a stream (no prompt end: the prompt goes on)."""
    feed_prompt(model, cache, tokens)


def _ask(model, tokenizer, name: str, cache: list, asks: list, answer_tokens, inspect):
    """Answer each ``(prompt, question)`` of ``asks`` through
    ``cache``, yielding rows: what the prompts share, three blocks or more before the
    first question, is fed once and each is asked of a copy (the recall tier rewound
    after each)."""
    tier = tier_of(cache)
    shared = 0
    if len(asks) > 1:
        asked = min(p.asked_at for p, _ in asks)
        bs = tier.block if tier is not None else DEFAULT_STRIDE
        shared = max(0, (asked - 3 * bs) // bs * bs)
        _prefill(model, cache, asks[0][0].tokens[:shared])
    for n, (p, _) in enumerate(asks):
        mark = tier.mark() if tier is not None else None
        fork = copy.deepcopy(cache) if len(asks) > 1 else cache
        if tier is not None:
            tier.rewind(fork)  # the tier serves the copy
        look = inspect if n == 0 or asks[n - 1][0] is not p else None
        yield _answer_one(model, tokenizer, p, name, fork, shared, answer_tokens, look)
        if tier is not None:
            tier.rewind(cache, mark)


def _answer_one(model, tokenizer, p: NeedlePrompt, name: str, cache: list, start: int,
                answer_tokens: int, inspect) -> dict:  # fmt: skip
    """One prompt answered through ``cache`` (its first ``start`` tokens already fed):
    the row (the needle's blocks and whether the prompt's end selected them all, for
    a recall cache)."""
    extra: dict = {}
    tier = tier_of(cache)
    original = None if tier is None else tier.on_prompt_end
    if inspect is not None and tier is not None:
        inspect(tier, p, extra)
    if tier is not None:
        before = tier.on_prompt_end

        def chosen(t, point):
            extra["selection"] = list(t.selection)
            if before is not None:
                before(t, point)

        tier.on_prompt_end = chosen
    tic = time.perf_counter()
    got = answer(model, tokenizer, cache, p.tokens[start:], answer_tokens)
    seconds = time.perf_counter() - tic
    row = {"length": len(p.tokens), "cache": name, "value": p.value, "answer": got, "found": p.value.lower() in got.lower(),
           "needle_distance": len(p.tokens) - p.needle_at, "seconds": round(seconds, 1)}  # fmt: skip
    if tier is not None:
        bs = tier.block
        blocks = sorted({p.needle_at // bs, (p.needle_at + p.needle_len - 1) // bs})
        selection = extra.pop("selection", [])
        row.update(needle_blocks=blocks, selection=selection,
                   needle_selected=all(b in selection for b in blocks),
                   store_bytes=tier.store_nbytes, region_bytes=tier.device_nbytes)  # fmt: skip
        tier.on_prompt_end = original
    row.update(extra)
    return row
