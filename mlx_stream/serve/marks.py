"""Turn marks: a session's caches with the whole prompt of one of its last turns fed
but the prompt's last token, so that a request keeping that prompt and replacing what
came after it resumes there instead of being rebuilt, after the window has evicted
what a repair would need. Agents send such requests at most steps: the reply they
resend differs from the one generated (a tool call's arguments re-serialized, thinking
dropped), a fork replaces the last exchange, a regeneration resends the same prompt.

Contract: a mark's caches encode exactly its ``tokens`` (the prompt's tokens but the
last, as the session fed them); it serves a request only when a rebuild would feed
those same tokens first (checked token for token), and the rest of the request's
tokens then go in as a turn: the caches are those of the session had it been sent
the new request's tokens from the start. A session keeps the marks of its last
:data:`MARKS` turns (each a copy of its caches: counted by admission); none with a
recall tier (a copy would share its store).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_stream.errors import UserError
from mlx_stream.generate.session import ChatSession, Checkpoint, cache_count
from mlx_stream.generate.transcript import new_messages

MARKS = 2  # the last turn's prompt (a resent reply) and the one before (a fork)


@dataclass
class Resumed:
    """A request placed on a mark: the tokens its turn feeds and why (for the log)."""

    turn: tuple[list[int], str]  # as ChatSession.turn_tokens returns it
    note: str


def take(marks: list[Checkpoint], session: ChatSession, user: Any, turn: tuple | None) -> None:
    """Add the mark of ``session`` now (its turn's prompt all fed but the last token)
    to ``marks``, keeping the last :data:`MARKS`. ``turn``: the turn's tokens and text
    (``None``: computed, as the turn does, from the session as it stands)."""
    tokens, full = turn if turn is not None else session.turn_tokens(user)
    if session.tokens is None or len(tokens) < 2:
        return
    fed = session.tokens + list(tokens[:-1])
    if cache_count(session.caches) != len(fed):  # not where a mark can be taken
        return
    mark = session.checkpoint()
    mark.messages += [dict(m) for m in new_messages(user)]
    mark.tokens, mark.fed_text, mark.pending = fed, full, []
    marks[:] = (marks + [mark])[-MARKS:]


def find(marks: list[Checkpoint], session: ChatSession, history: list, user: Any):
    """The newest of ``marks`` a rebuild of ``history`` + ``user`` would start from,
    and the tokens it feeds after it: ``(mark, tokens, turn)``, ``tokens`` what the
    caches then hold, or ``None``. A mark whose prompt was edited since only among
    tokens its window has evicted still serves, as a repair keeps such an edit: no
    later query reads them (:func:`~mlx_stream.generate.repair.plan`)."""
    from mlx_stream.generate.repair import (
        common_prefix,
        common_suffix,
        encode_like_rebuild,
        evicted_before,
        keep_evicted,
    )

    messages = list(history) + new_messages(user)
    full = session.render(session.conversation(messages))
    tokens = encode_like_rebuild(session, full)
    for mark in reversed(marks):
        old, k = mark.tokens or [], len(mark.messages)
        if mark.system != session.system or not 0 < k <= len(messages) or not old:
            continue
        if messages[:k] == mark.messages:
            head = tokens[: len(old) + 1]
        else:  # its prompt as the request renders it now
            head = encode_like_rebuild(session, session.render(session.conversation(messages[:k])))
        n = len(head) - 1
        if n < 1 or len(tokens) <= n or tokens[:n] != head[:n]:
            continue
        if head[:n] == old:
            return mark, list(old), (tokens[n:], full)
        p = common_prefix(old, head[:n])
        s = common_suffix(old, head[:n], min(len(old), n) - p)
        if p >= session.sinks and len(old) - s <= evicted_before(mark.caches):
            return mark, keep_evicted(head[:n], len(old), p, s), (tokens[n:], full)
    return None


def resume(
    session: ChatSession,
    marks: list[Checkpoint],
    history: list,
    user: Any,
    why: str,
    beyond: int = 0,
) -> Resumed | None:
    """Put ``session`` on the newest mark that serves ``history`` + ``user`` (see
    :func:`find`); its transcript is then ``history``. ``None`` when none serves, or
    none holds more than ``beyond`` tokens (another state the caller has holds more)."""
    found = find(marks, session, history, user)
    if found is None or len(found[1]) <= beyond:
        return None
    mark, kept, turn = found
    back = len(marks) - marks.index(mark)
    session.restore(mark)
    session.messages = [dict(m) for m in history]
    session.tokens, session.pending = kept, []
    where = "the last turn's prompt" if back == 1 else f"the prompt {back} turns back"
    edited = "" if kept == mark.tokens else ", edited only where its window had evicted"
    return Resumed(turn, f"resumed from {where} ({len(kept):,} tokens{edited}): {why}")


MARK = ".mark"  # a saved session's newest mark: PATH.mark.safetensors and PATH.mark.json


def save(session: ChatSession, marks: list[Checkpoint], path: Path) -> None:
    """Save the newest of ``marks`` beside ``session``'s files at ``path`` (a restart
    then resumes an agent's next step from it), or remove a stale one."""
    target = path.with_name(path.name + MARK)
    if not marks:
        for suffix in (".safetensors", ".json", ".draft.safetensors"):
            with contextlib.suppress(OSError):
                target.with_name(target.name + suffix).unlink()
        return
    mark, names = marks[-1], ("caches", "messages", "fed_text", "pending", "tokens")
    live = {name: getattr(session, name) for name in names}
    try:  # the session's own save, of the mark's state: no copy of the caches
        session.caches, session.messages, session.fed_text = (
            mark.caches,
            mark.messages,
            mark.fed_text,
        )
        session.pending, session.tokens = mark.pending, mark.tokens
        session.save(target)
    finally:
        for name, value in live.items():
            setattr(session, name, value)


def load(session: ChatSession, path: Path) -> list[Checkpoint]:
    """The mark saved beside the session at ``path`` (:func:`save`) as a list of one;
    none when there is none or it does not load (a checked file: a bad one is only a
    lost mark). ``session`` is left holding it: load the session's own state after."""
    target = path.with_name(path.name + MARK)
    if not target.with_name(target.name + ".safetensors").is_file():
        return []
    try:
        session.load(target)
    except UserError:
        return []
    mark = session.checkpoint()
    return [mark] if mark.tokens else []
