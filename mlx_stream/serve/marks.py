"""Turn marks: a session's caches with the whole prompt of one of its last turns fed
but the prompt's last token, so that a request keeping that prompt and replacing what
came after it resumes there instead of being rebuilt (an agent's resent reply, a fork
of the last exchange, a regeneration), after the window has evicted what a repair
would need.

Contract: a mark's caches encode exactly its ``tokens``; it serves a request only when
a rebuild would feed those same tokens first (checked token for token), the rest then
going in as a turn. A session keeps the marks of its last :data:`MARKS` turns (none
with a recall tier). Its base, the newest mark whose caches still hold every token, is
written to disk once and serves any request sharing a prefix with it, resumed at the
longest one. In full: ``docs/serve.md``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_stream.errors import Unsupported, UserError
from mlx_stream.generate.session import ChatSession, Checkpoint, cache_count
from mlx_stream.generate.transcript import new_messages
from mlx_stream.prefix_store import MIN_TOKENS

MARKS = 2  # the last turn's prompt (a resent reply) and the one before (a fork)
BASE = ".base"  # a session's base on disk: PATH.base.safetensors and PATH.base.json


class Marks(list):
    """A session's marks (:class:`Checkpoint` s, newest last) and where its base goes.

    Attributes:
        spill (Path, optional): ``PATH`` of the base's files (``PATH.base.*``); ``None``
            keeps no base.
        base (list[int], optional): The tokens the base's caches hold (its caches on disk).
        system (str, optional): The base's system prompt.
    """

    def __init__(self, items=(), spill: Path | None = None):
        super().__init__(items)
        self.spill, self.base, self.system = spill, None, None


def whole(caches: list) -> bool:
    """Whether ``caches`` still hold every token they were given (no ring slot was
    overwritten yet): any later tokens can then be cut off exactly."""
    rings = [getattr(c, "ring", None) for c in caches]
    return bool(rings) and all(r is not None and r.tokens_seen <= r.capacity for r in rings)


def cuttable(caches: list, n: int) -> bool:
    """Whether each of ``caches`` can drop its last ``n`` tokens exactly (per-channel
    quantized keys cannot reopen an older group, for one)."""
    try:
        for c in caches:
            c.ring.check_trim(n)
            c.storage.check_trim(c.ring.tokens_seen, n)
    except (Unsupported, AttributeError):
        return False
    return True


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
    if len(marks) >= MARKS and isinstance(marks, Marks):
        _retire(marks, session, marks[0], [*marks[1:], mark])
    marks[:] = (marks + [mark])[-MARKS:]


def _retire(marks: Marks, session: ChatSession, old: Checkpoint, newer: list) -> None:
    """``old`` leaves ``marks``: it becomes the base (written to disk) when its caches
    hold every token and no ``newer`` mark that does extends it."""
    if marks.spill is None or not old.tokens or not whole(old.caches):
        return
    if not cuttable(old.caches, len(old.tokens) - session.sinks - 1):
        return  # its caches cannot go back far enough to serve anything
    n = len(old.tokens)
    if any(m.tokens and whole(m.caches) and m.tokens[:n] == old.tokens for m in newer):
        return  # that one will serve every prefix this one serves
    try:
        _write(session, old, marks.spill.with_name(marks.spill.name + BASE))
    except (OSError, RuntimeError, UserError):
        forget(marks)  # no base: an edit deep in the session is rebuilt, as before
        return
    marks.base, marks.system = list(old.tokens), old.system


def forget(marks: list) -> None:
    """Remove ``marks``' base from disk."""
    if isinstance(marks, Marks) and marks.spill is not None:
        _remove(marks.spill.with_name(marks.spill.name + BASE))
        marks.base = marks.system = None


def find(marks: list[Checkpoint], session: ChatSession, history: list, user: Any):
    """The state of ``marks`` a rebuild of ``history`` + ``user`` would start from that
    holds the most of it, and the tokens it feeds after it: ``(mark, tokens, turn,
    cut)``, ``mark`` ``None`` for the base (on disk), ``tokens`` what the caches then
    hold once ``cut`` tokens are cut off their end, or ``None``. A mark whose prompt was
    edited since only among tokens its window has evicted still serves, as a repair
    keeps such an edit: no later query reads them
    (:func:`~mlx_stream.generate.repair.plan`); a whole one (:func:`whole`) or the base
    serves the longest prefix it shares with the request."""
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
    best = None
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
            best = mark, list(old), (tokens[n:], full), 0
            break
        p = common_prefix(old, head[:n])
        s = common_suffix(old, head[:n], min(len(old), n) - p)
        if p >= session.sinks and len(old) - s <= evicted_before(mark.caches):
            best = mark, keep_evicted(head[:n], len(old), p, s), (tokens[n:], full), 0
            break
    whole_ones = [(m, m.tokens) for m in reversed(marks) if m.tokens and whole(m.caches)]
    if isinstance(marks, Marks) and marks.base:
        whole_ones.append((None, marks.base))
    if not whole_ones:
        return best
    # worth it past what a rebuild starts from (the system prompt's snapshot) by a file's worth
    floor = len(best[1]) if best else MIN_TOKENS + max(session.sinks, len(head_tokens(session)))
    for mark, old in whole_ones:
        system = marks.system if mark is None else mark.system
        p = common_prefix(old, tokens[: len(tokens) - 1])
        if mark is not None and not cuttable(mark.caches, len(old) - p):
            continue
        if system == session.system and p > floor:
            best, floor = (mark, list(old[:p]), (tokens[p:], full), len(old) - p), p
    return best


def head_tokens(session: ChatSession) -> list[int]:
    """The tokens of ``session``'s rendered system prompt (what a rebuild restores)."""
    head = session.system_text()
    return session.encode(head) if head else []


def resume(
    session: ChatSession,
    marks: list[Checkpoint],
    history: list,
    user: Any,
    why: str,
    beyond: int = 0,
) -> Resumed | None:
    """Put ``session`` on the state of ``marks`` that serves the most of ``history`` +
    ``user`` (see :func:`find`); its transcript is then ``history``. ``None`` when none
    serves, or none holds more than ``beyond`` tokens (another state the caller has
    holds more), or the base does not load (``session`` is then left for the caller
    to restore or rebuild)."""
    found = find(marks, session, history, user)
    if found is None or len(found[1]) <= beyond:
        return None
    mark, kept, turn, cut = found
    if mark is None:
        try:
            session.load(marks.spill.with_name(marks.spill.name + BASE))
        except UserError:
            forget(marks)
            return None
        if (session.tokens or [])[: len(kept)] != kept:  # its caches say otherwise
            forget(marks)
            return None
        if not cuttable(session.caches, cut):  # (a mark in memory: checked by find)
            return None
        where = "the session's start (its base on disk)"
    else:
        back = len(marks) - marks.index(mark)
        session.restore(mark)
        where = "the last turn's prompt" if back == 1 else f"the prompt {back} turns back"
    for cache in session.caches:  # whole caches: cut back exactly
        cache.trim(cut)
    session.messages = [dict(m) for m in history]
    session.tokens, session.pending = kept, []
    if cut:  # the text of what the caches hold (the turn's own is given with its tokens)
        session.fed_text = session.tokenizer.decode(kept)
    edited = ", cut back to what the request keeps" if cut else ""
    if not cut and mark is not None and kept != mark.tokens:
        edited = ", edited only where its window had evicted"
    return Resumed(turn, f"resumed from {where} ({len(kept):,} tokens{edited}): {why}")


MARK = ".mark"  # a saved session's newest mark: PATH.mark.safetensors and PATH.mark.json


def save(session: ChatSession, marks: list[Checkpoint], path: Path) -> None:
    """Save the newest of ``marks`` beside ``session``'s files at ``path`` (a restart
    then resumes an agent's next step from it), or remove a stale one."""
    target = path.with_name(path.name + MARK)
    if marks:
        _write(session, marks[-1], target)
    else:
        _remove(target)


def _write(session: ChatSession, mark: Checkpoint, target: Path) -> None:
    """Save ``mark`` at ``target`` with ``session``'s own save: no copy of the caches."""
    names = ("caches", "messages", "fed_text", "pending", "tokens")
    live = {name: getattr(session, name) for name in names}
    try:
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


def _remove(target: Path) -> None:
    for suffix in (".safetensors", ".json", ".draft.safetensors"):
        with contextlib.suppress(OSError):
            target.with_name(target.name + suffix).unlink()


def load(session: ChatSession, path: Path) -> Marks:
    """The mark saved beside the session at ``path`` (:func:`save`) as marks of one,
    and its base when one is on disk; no mark when there is none or it does not load
    (a checked file: a bad one is only a lost mark). ``session`` is left holding it:
    load the session's own state after."""
    found = Marks(spill=path)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        state = json.loads(path.with_name(path.name + BASE + ".json").read_text())
        if isinstance(state["tokens"], list) and state["tokens"]:
            found.base, found.system = state["tokens"], state["system"]
    target = path.with_name(path.name + MARK)
    if not target.with_name(target.name + ".safetensors").is_file():
        return found
    try:
        session.load(target)
    except UserError:
        return found
    mark = session.checkpoint()
    if mark.tokens:
        found.append(mark)
    return found
