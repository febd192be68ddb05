"""Passkey retrieval: what the model can still recall through a sink + window cache.

A chat prompt (the model's own template) hides a random five-digit pass key in filler
text and asks for it at the end. The key sits at a chosen distance from the question:

* ``inside``: half a window before the end, in the window all through the answer;
* ``just_outside``: its last token a sixteenth of a window past the window's start;
* ``far_outside``: right after the system prompt, about two windows back;
* ``system``: in the system prompt, which is pinned as the sinks (``--keep-system``).

Each prompt is answered greedily twice: through the policy's cache and through the full
cache (mlx-lm ``KVCache``s, the reference), so a row says what the window loses and not
what the model lacks. An answer counts when it contains the key.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.defaults import DEFAULT_SINKS
from mlx_stream.generate.decode import generate_step

PLACEMENTS = ("inside", "just_outside", "far_outside", "system")
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
SYSTEM = "You are a helpful assistant."
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key?"
SENTINEL = "\x00PASSKEY\x00"


@dataclass
class RecallPrompt:
    """One passkey prompt: its tokens, the key, and the sinks that pin what must be pinned."""

    tokens: list[int]
    key: str
    sinks: int
    distance: int  # tokens from the key's last token to the end of the prompt


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    return "".join(f"{m['content']}\n" for m in messages)


def _filler(tokenizer: Any, n: int) -> list[int]:
    """Exactly ``n`` filler tokens (whole sentences repeated, the last cut)."""
    unit = _encode(tokenizer, FILLER)
    return (unit * (n // len(unit) + 1))[:n]


def build_prompt(
    tokenizer: Any, placement: str, window: int, length: int, key: str, sinks: int = DEFAULT_SINKS
) -> RecallPrompt:
    """The passkey prompt of ``placement`` for ``window``, about ``length`` tokens long.

    Args:
        tokenizer: Has ``encode`` (and ``apply_chat_template`` with a chat template).
        placement (str): One of :data:`PLACEMENTS`.
        window (int): The window the placement is relative to.
        length (int): Prompt tokens wanted (the filler takes up the rest).
        key (str): The pass key.
        sinks (int): Sinks for the placements that do not pin the system prompt.

    Returns:
        RecallPrompt: With ``sinks`` the system prompt's tokens for ``"system"``.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
    key_text = KEY_SENTENCE.format(key=key)
    system = SYSTEM + (key_text if placement == "system" else "")
    messages = [{"role": "system", "content": system}]
    full = _render(tokenizer, [*messages, {"role": "user", "content": SENTINEL}], True)
    head_text, tail_text = full.split(SENTINEL)
    head, tail = _encode(tokenizer, head_text), _encode(tokenizer, tail_text)
    question = _encode(tokenizer, QUESTION)
    key_tokens = [] if placement == "system" else _encode(tokenizer, key_text)
    room = length - len(head) - len(tail) - len(question) - len(key_tokens)
    # Tokens after the key's last token: the filler after it, the question, the tail.
    wanted = {"inside": window // 2, "just_outside": window + window // 16}.get(placement)
    after = room if wanted is None else wanted - len(question) - len(tail)
    if not 0 <= after <= room:
        raise ValueError(
            f"cannot place a key '{placement}' for window {window} in a prompt of {length} tokens"
        )
    if wanted is None and after + len(question) + len(tail) <= window + window // 16:
        raise ValueError(
            f"cannot place a key '{placement}' for window {window} in a prompt of {length} tokens"
        )
    tokens = head + _filler(tokenizer, room - after) + key_tokens
    tokens += _filler(tokenizer, after) + question + tail
    pinned, distance = sinks, after + len(question) + len(tail)
    if placement == "system":
        system_text = _render(tokenizer, messages, False)
        pinned = len(_encode(tokenizer, system_text)) if full.startswith(system_text) else len(head)
        distance = len(tokens) - pinned
    return RecallPrompt(tokens, key, pinned, distance)


def answer(model: nn.Module, tokenizer: Any, cache: list, tokens: list[int], n: int) -> str:
    """The greedy answer to ``tokens`` (at most ``n`` tokens, cut at an end token)."""
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    out = []
    for token, _, _ in generate_step(tokens, model, cache, max_tokens=n):
        if token in eos:
            break
        out.append(token)
    return tokenizer.decode(out)


def prompt_length(window: int, context: int | None, answer_tokens: int) -> int:
    """Prompt tokens for ``window``: two windows and a bit, within ``context``."""
    length = 2 * window + 256
    if context is not None:
        length = min(length, context - answer_tokens)
    return length


def check_prompts(
    tokenizer: Any,
    windows: Sequence[int],
    placements: Sequence[str],
    sinks: int,
    context: int | None,
    answer_tokens: int,
) -> None:
    """Raise ValueError, before any model call, if a placement cannot fit a window."""
    for window in windows:
        length = prompt_length(window, context, answer_tokens)
        for placement in placements:
            try:
                build_prompt(tokenizer, placement, window, length, "00000", sinks)
            except ValueError as exc:
                where = f" (the model's context is {context})" if context else ""
                raise ValueError(f"--window {window}: {exc}{where}") from None


def recall(
    model: nn.Module,
    tokenizer: Any,
    windows: Sequence[int],
    placements: Sequence[str] = PLACEMENTS,
    trials: int = 4,
    sinks: int = DEFAULT_SINKS,
    answer_tokens: int = 12,
    context: int | None = None,
    seed: int = 0,
    callback: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Passkey accuracy per placement and window, beside the full cache's.

    Args:
        model (nn.Module): The model.
        tokenizer: mlx-lm's ``TokenizerWrapper`` (``encode``, ``decode``, template).
        windows (Sequence[int]): Windows to test.
        placements (Sequence[str]): Of :data:`PLACEMENTS`.
        trials (int): Keys per placement and window. Default: ``4``.
        sinks (int): Sinks where the system prompt is not pinned. Default: ``4``.
        answer_tokens (int): Most tokens per answer. Default: ``12``.
        context (int, optional): The model's context: prompts stay within it.
        seed (int): Seed of the random keys. Default: ``0``.
        callback (Callable[[int, int], None], optional): ``(prompts done, total)``.

    Returns:
        list[dict]: One row per window and placement: ``placement``, ``window``,
        ``sinks``, ``trials``, ``accuracy``, ``reference_accuracy``, ``prompt_tokens``,
        ``key_distance`` (tokens from the key to the question, mean) and ``answers``.
    """
    rng = random.Random(seed)
    rows, done, total = [], 0, len(windows) * len(placements) * trials
    for window in windows:
        length = prompt_length(window, context, answer_tokens)
        for placement in placements:
            hits = ref_hits = distance = tokens = 0
            answers = []
            pinned = sinks
            for _ in range(trials):
                key = str(rng.randrange(10000, 100000))
                p = build_prompt(tokenizer, placement, window, length, key, sinks)
                pinned = p.sinks
                cache = make_sink_cache(model, p.sinks, window)
                got = answer(model, tokenizer, cache, p.tokens, answer_tokens)
                ref = answer(model, tokenizer, make_prompt_cache(model), p.tokens, answer_tokens)
                hits += key in got
                ref_hits += key in ref
                distance += p.distance
                tokens += len(p.tokens)
                answers.append({"key": key, "answer": got, "reference_answer": ref})
                done += 1
                if callback is not None:
                    callback(done, total)
            rows.append({
                "placement": placement, "window": window, "sinks": pinned, "trials": trials,
                "accuracy": hits / trials, "reference_accuracy": ref_hits / trials,
                "prompt_tokens": tokens // trials, "key_distance": distance // trials,
                "answers": answers,
            })  # fmt: skip
    return rows
