"""Transcript matching: which session a chat request continues, and how.

Contract: an :class:`Entry` is a session the server knows, resident or on disk, with
the transcript its caches encode (and, resident, the checkpoint one turn shorter).
:func:`split_messages` cuts a request into system prompt, history and new message;
:func:`find` picks the entry among the caller's own sessions and the mode that makes
its caches encode the history (``append``, ``restore``, ``rebuild``, ``new``),
adding a new entry to the table when none fits. Matching is on the transcript, never
on the KV cache (a wrapped ring matches no token prefix). No MLX work, no memory
accounting: the engine admits and runs what :func:`find` picked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_stream.generate.session import ChatSession, Checkpoint, clean_text
from mlx_stream.serve.marks import Marks
from mlx_stream.serve.refusals import BadRequest, Busy


@dataclass
class Entry:
    """A session the server knows: resident (``session`` set) or on disk (``path``).

    ``messages`` is the transcript its caches encode; ``checkpoint`` (resident only)
    encodes ``checkpoint.messages``, a transcript one turn shorter, and is only ever
    restored for a request whose history is exactly that.
    """

    id: str
    system: str | None
    messages: list[dict[str, str]] = field(default_factory=list)
    session: ChatSession | None = None
    checkpoint: Checkpoint | None = None
    path: Path | None = None
    bytes: int = 0
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False
    tokens_seen: int = 0
    sinks: int = 0
    transient: bool = False  # a plain completion: dropped when done
    owner: str = ""
    tools: Any = None  # its serve.tools.ToolSet (part of what a request must match)
    agent: str = ""  # the agent client's session key of the requests that made it
    # During a turn after a repaired edit: the state before the turn, the checkpoint
    # once the turn has gone through (a failed one goes back to before the edit).
    repaired: Checkpoint | None = None
    prefilled: int = 0  # its system prompt's tokens computed for the request that made it
    # Resident only: the caches at the end of its last turns' prompts (serve.marks).
    marks: Marks = field(default_factory=Marks)

    @property
    def key(self) -> tuple[str, str]:
        return (self.owner, self.id)


def split_messages(messages: list[dict[str, str]]) -> tuple[str | None, list[dict], str]:
    """``(system, history, user)`` of a chat request: a leading system message, the
    turns before the last, and the last (a user message's text; after tool results,
    or with system messages around it, the new messages as a list). System messages
    elsewhere stay in the transcript at their place. Text is decoded leniently."""
    messages = [{**m, "content": clean_text(m["content"])} for m in messages]
    if not messages:
        raise BadRequest("messages: must hold at least one message")
    system = None
    if messages[0]["role"] in ("system", "developer"):
        system = messages[0]["content"]
        messages = messages[1:]
    n = len(messages)
    while n > 0 and messages[n - 1]["role"] in ("system", "developer"):
        n -= 1  # system messages after the last turn (agents' reminders) join it
    if n == 0 or messages[n - 1]["role"] not in ("user", "tool"):
        raise BadRequest("messages: the last message must be from the user or a tool result")
    last_user = messages[n - 1]["role"] == "user"
    if n == len(messages) and last_user and (n < 2 or messages[-2]["role"] != "tool"):
        return system, messages[:-1], messages[-1]["content"]
    # Several new messages (tool results, system notes): all after the last reply.
    cut = max((i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
    return system, messages[:cut], messages[cut:]


def restorable(entry: Entry, system: str | None, history: list) -> bool:
    """Whether ``entry``'s checkpoint encodes exactly ``system`` + ``history``."""
    cp = entry.checkpoint
    return (
        entry.session is not None
        and cp is not None
        and cp.system == system
        and cp.messages == history
    )


def find(
    entries: dict[tuple[str, str], Entry],
    request: Any,
    system: str | None,
    history: list,
    tools: Any = None,
    *,
    isolate: bool,
    new_id: Callable[[int], str],
    repair: bool = False,
) -> tuple:
    """``(entry, mode, source)`` for a chat request, among its owner's sessions only;
    ``tools`` (a ToolSet) must match like the system prompt.

    ``append``: the entry's transcript is the history. ``restore``: ``source``'s
    checkpoint encodes exactly the history (an edit or a regeneration of the last
    turn); with the session's own id it restores in place, without one it forks a new
    session and the original stays for its owner. ``rebuild``: from the history alone
    (an id whose transcript does not match, or a history no session holds). ``new``:
    no history. ``repair`` (when asked for): the history differs from ``source``'s
    transcript elsewhere (an edit in the middle): with the session's own id its caches
    are repaired in place, without one a copy of ``source`` is (a fork), ``source``
    being the resident session with the most messages equal to the history's at the
    same place (at least one). Without an id, only a history that is not empty is
    matched, and only when the server is not ``isolate``-d. A new entry is added to ``entries``, its id
    from ``new_id(digits)``; :class:`Busy` for a named session that is answering.

    Args:
        entries: The server's sessions by ``(owner, id)``.
        request: The request (its ``owner`` and ``session_id``).
        system, history: From :func:`split_messages`.
    """
    owner, session_id = request.owner, request.session_id
    if session_id is not None:
        entry = entries.get((owner, session_id))
        if entry is None:
            entry = _add(entries, Entry(id=session_id, system=system, owner=owner, tools=tools))
            return entry, "rebuild" if history else "new", None
        if entry.busy:
            raise Busy(f"session {entry.id} is answering another request; retry shortly")
        same = (entry.system, entry.tools) == (system, tools)
        if same and entry.messages == history:
            return entry, "append", None
        if same and restorable(entry, system, history):
            return entry, "restore", entry
        if same and repair and history:
            return entry, "repair", entry
        return entry, "rebuild", None
    if history and not isolate:
        mine = [
            e for e in entries.values()
            if e.owner == owner and not e.busy and not e.transient
        ]  # fmt: skip
        mine.sort(key=lambda e: -e.last_used)
        mine = [e for e in mine if e.tools == tools]
        for entry in mine:
            if entry.system == system and entry.messages == history:
                return entry, "append", None
        agent = agent_of(request)
        for entry in mine:
            if restorable(entry, system, history):
                if agent and entry.agent == agent:  # the agent's own: restored in place
                    return entry, "restore", entry
                fork = Entry(id=new_id(16), system=system, owner=owner, tools=tools, agent=agent)
                return _add(entries, fork), "restore", entry
        source = closest(mine, system, history) if repair else None
        if repair and agent and (source is None or source.agent != agent):
            # the agent's own latest session, on disk too (a restart): it goes on there
            source = next((e for e in mine if e.agent == agent and e.system == system), source)
        if source is not None:
            if agent and source.agent == agent:  # an agent never goes back: no copy kept
                return source, "repair", source
            fork = Entry(id=new_id(16), system=system, owner=owner, tools=tools, agent=agent)
            return _add(entries, fork), "repair", source
    entry = Entry(id=new_id(16), system=system, owner=owner, tools=tools, agent=agent_of(request))
    return _add(entries, entry), "rebuild" if history else "new", None


def agent_of(request: Any) -> str:
    return getattr(request, "agent", "")


def closest(entries: list[Entry], system: str | None, history: list) -> Entry | None:
    """The resident entry with ``system`` whose transcript has the most messages equal
    to ``history``'s at the same place (at least one; the first listed on a tie): an
    edit of the first message keeps the rest in place."""
    best, most = None, 0
    for entry in entries:
        if entry.session is None or entry.system != system:
            continue
        n = sum(a == b for a, b in zip(entry.messages, history, strict=False))
        if n > most:
            best, most = entry, n
    return best


def _add(entries: dict[tuple[str, str], Entry], entry: Entry) -> Entry:
    entries[entry.key] = entry
    return entry
