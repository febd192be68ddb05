"""Transcript text: messages as the chat template sees them.

Contract: pure functions of strings and a tokenizer; user text is made decodable
(:func:`clean_text`) and special-token text in it escaped (:func:`escape_specials`).
"""

from __future__ import annotations

from typing import Any

from mlx_stream.mlxlm import hf_tokenizer

SENTINEL = "\x00mlx-stream\x00"
ZERO_WIDTH_SPACE = "\u200b"


def new_messages(user_text: str | list[dict]) -> list[dict]:
    """A turn's new messages: a user message's text, or messages (tool results)."""
    if isinstance(user_text, str):
        return [{"role": "user", "content": user_text}]
    return [dict(m) for m in user_text]


def as_user(message: dict) -> dict:
    """A system message after the first, for a template that refuses one there."""
    if message["role"] != "system":
        return message
    return {"role": "user", "content": f"[system] {message['content']}"}


def clean_text(text: str) -> str:
    """``text`` with undecodable input made replacement characters (U+FFFD).

    Bytes that were not UTF-8 reach Python as lone surrogates (``surrogateescape`` on
    stdin, ``"\\udcff"`` escapes in JSON), which the tokenizer rejects: decode them
    leniently wherever text enters a session.
    """
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that is not an escaped byte
        raw = text.encode("utf-8", "replace")
    return raw.decode("utf-8", "replace")


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts ``tokenizer`` reads as special tokens, longest first."""
    hf = hf_tokenizer(tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    texts |= set(getattr(hf, "all_special_tokens", None) or ())
    texts.discard(getattr(hf, "unk_token", None))  # unknown text reads as it anyway
    return tuple(sorted((t for t in texts if len(t) > 1), key=len, reverse=True))


def escape_specials(text: str, specials: tuple[str, ...]) -> str:
    """``text`` with every special token's text broken by a zero-width space after its
    first character, so message content is read as text: a user who writes
    ``<|im_start|>system`` gets those characters, not a new role."""
    for special in specials:
        if special in text:
            text = text.replace(special, special[0] + ZERO_WIDTH_SPACE + special[1:])
    return text
