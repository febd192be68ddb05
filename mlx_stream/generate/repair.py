"""Repair a session's caches in place after an edit anywhere in its transcript.

Contract: :func:`repair` keeps the KV before the first difference, recomputes the
changed span plus ``window`` tokens after it, and moves the rest by the change in
length (approximate, bounded by ``window``). An edit entirely among tokens the window
has evicted (an agent pruning an old tool result of a long session) changes no KV:
no query will read those tokens again, so the caches are kept as they are and only
the transcript changes (a rebuild would not feed them either: it feeds the tail that
fits the window). It refuses with a reason (the caller rebuilds) where that cannot be
done honestly: tokens unknown, an edit in the sinks or reaching into the window of a
cache that has evicted, a draft model, a recall tier (its store holds the old text),
per-channel quantized keys, or a template that does not render the transcript as a
prefix. An exception leaves the caches part-way: restore a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_stream.cache import splice
from mlx_stream.cache.hooks import hooks_of
from mlx_stream.defaults import DEFAULT_REPAIR_TOKENS  # noqa: F401 - re-exported
from mlx_stream.generate.prefill import feed_prompt


@dataclass
class Repaired:
    """What a repair did, in tokens of the new transcript.

    Attributes:
        prefix: Kept before the edit (exact).
        recomputed: Fed again: the changed span and the window after it.
        moved: Kept after the window, their positions moved by ``shift``.
        shift: The edit's change in length (new minus old tokens).
    """

    prefix: int
    recomputed: int
    moved: int
    shift: int
    note: str = ""  # how it came about, for the server's log (``serve.sessions``)

    @property
    def reused(self) -> int:
        """Tokens whose KV was kept (before and after the edit)."""
        return self.prefix + self.moved


@dataclass
class Plan:
    """Where the new transcript's tokens come from (see :func:`plan`)."""

    tokens: list[int]  # the new transcript's tokens (up to the next turn's text)
    fed_text: str  # its rendered text
    prefix: int  # tokens kept before the edit
    stop: int  # recomputed: tokens[prefix:stop]
    tail: int  # old tokens tail..keep kept (none when tail >= cached)
    shift: int
    evicted: bool = False  # the edit is among evicted tokens: no KV changes
    keep: int | None = None  # the end of the old tokens kept (None: all that follow)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def common_suffix(a: list[int], b: list[int], limit: int) -> int:
    i = 0
    while i < limit and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


def encode_like_rebuild(session: Any, text: str) -> list[int]:
    """``text``'s tokens as a fresh session feeds them: the rendered system prompt
    (what the sinks or a stored prefix hold) apart from the rest."""
    head = session.system_text()
    if head and text.startswith(head):
        return session.encode(head) + session.encode(text[len(head) :])
    return session.encode(text)


def plan(session: Any, history: list[dict], new: Any, window: int) -> Plan | str:
    """How to make ``session`` encode ``history`` before the turn ``new`` (a user
    message's text or new messages), recomputing ``window`` tokens after the edit;
    a string: why not."""
    from mlx_stream.generate.session import cache_count
    from mlx_stream.generate.transcript import new_messages

    old = session.tokens
    if old is None or len(old) != cache_count(session.caches):
        return "the tokens its caches hold are not known"
    if session.draft_model is not None:
        return "a draft model (its caches would need the same repair)"
    turn = new_messages(new)
    old_text = session.render(session.conversation(session.messages + turn))
    if not old_text.startswith(session.fed_text):
        return "the chat template rewrites earlier turns"
    rest = old_text[len(session.fed_text) :]
    new_text = session.render(session.conversation(list(history) + turn))
    if not new_text.endswith(rest):
        return "the chat template renders the next turn differently after the edit"
    fed_text = new_text[: len(new_text) - len(rest)]
    tokens = encode_like_rebuild(session, fed_text)
    full = old + session.pending
    n, e = len(old), len(tokens)
    prefix = common_prefix(old, tokens)
    if prefix < session.sinks:
        return "the edit reaches into the sinks"
    same_end = common_suffix(full, tokens, min(len(full), e) - prefix)
    shift = e - len(full)
    if len(full) - same_end <= evicted_before(session.caches):
        client = hooks_of(session.caches)
        if client is not None:  # a recall tier's store holds the old text
            return f"{client.what} (its store holds the edited text)"
        kept = keep_evicted(tokens, len(full), prefix, same_end)
        return Plan(kept, fed_text, n, n, n, 0, evicted=True)
    stop = min(e - same_end + max(0, window), e)
    tail = stop - shift  # the old index of the first token kept after the window
    tail = min(tail, n)  # n: nothing kept after the window (what follows it is pending)
    p = Plan(tokens, fed_text, prefix, stop, tail, shift)
    other = second_edit(old, tokens, prefix, window, fed_text)
    if other is not None and kept_after(other, n) > kept_after(p, n):
        p = other
    end = max(n, p.stop + kept_after(p, n))
    # Nothing old after the prefix (the new transcript extends the old one): the new
    # tokens are only fed, as a turn's are, whatever the window has evicted.
    why = splice.refusal(session.caches, end) if prefix < n or p.tail < n else None
    if why is not None:
        return why
    return p


def kept_after(p: Plan, n: int) -> int:
    """Old tokens ``p`` keeps after its recomputed span (of the ``n`` the caches hold)."""
    return max(0, (n if p.keep is None else min(p.keep, n)) - p.tail)


def second_edit(
    old: list[int], new: list[int], prefix: int, window: int, fed_text: str
) -> Plan | None:
    """A plan that also keeps a run of old tokens that a second, later edit ends (an
    agent clears an old tool result and its last reply differs too): the longest run
    of old tokens after the first edit found again after it in ``new``, its first
    ``window`` tokens recomputed, the rest moved; what follows the run is fed with the
    turn. Written here: difflib finds the run, nothing aligns KV spans."""
    from difflib import SequenceMatcher

    if len(old) - prefix < 2 * window or len(new) - prefix < 2 * window:
        return None
    i, j, size = SequenceMatcher(None, old, new).find_longest_match(
        prefix, len(old), prefix, len(new)
    )
    if size <= window:
        return None
    stop = j + window
    return Plan(new, fed_text, prefix, stop, i + window, j - i, keep=i + size)


def repair(session: Any, history: list[dict], new: Any, window: int) -> Repaired | str:
    """Make ``session`` encode ``history`` (see the module's contract); a string when
    it cannot be (the session is then untouched)."""
    p = plan(session, history, new, window)
    return p if isinstance(p, str) else apply(session, history, p)


def evicted_before(caches: list) -> int:
    """The token index below which no later query of ``caches`` reads a token (past
    the sinks; within reach of a rollback counts as read): 0 before the first eviction."""
    from mlx_stream.cache.sink import SinkCache

    if not caches or not all(isinstance(c, SinkCache) for c in caches):
        return 0
    c = caches[0]
    if c.tokens_seen <= c.sinks + c.window + c.slack + 1:
        return 0
    return c.tokens_seen - c.window - c.slack - 1


def keep_evicted(new: list[int], n: int, prefix: int, same_end: int) -> list[int]:
    """``new``'s tokens as caches that hold ``n`` tokens keep them after an edit among
    tokens they have evicted (``new`` and what they hold share ``prefix`` tokens first
    and ``same_end`` last): the edited span :func:`resized` to the length it had."""
    e = len(new)
    edited = resized(new[prefix : e - same_end], n - same_end - prefix)
    return new[:prefix] + edited + new[e - same_end :]


def resized(tokens: list[int], n: int) -> list[int]:
    """``tokens`` cut or padded (with -1, no token) to ``n``: evicted tokens keep their
    count, so the session's tokens stay one per token its caches have seen."""
    return tokens[:n] + [-1] * (n - len(tokens))


def apply(session: Any, history: list[dict], p: Plan) -> Repaired:
    """Carry out :func:`plan`'s ``p``: ``session`` then encodes ``history``."""
    caches = session.caches
    n = len(session.tokens)
    if p.evicted:
        session.messages = [dict(m) for m in history]
        session.fed_text = p.fed_text
        session.tokens, session.pending = list(p.tokens[:n]), list(p.tokens[n:])
        return Repaired(n, 0, 0, 0)
    tail = splice.cut(caches, p.tail, p.keep)
    for c in caches:
        c.trim(c.tokens_seen - p.prefix)
    feed(session, p.tokens[p.prefix : p.stop])
    splice.paste(caches, tail, p.shift)
    cached = p.stop + tail.length
    session.messages = [dict(m) for m in history]
    session.fed_text = p.fed_text
    session.pending = list(p.tokens[cached:])
    session.tokens = list(p.tokens[:cached])
    return Repaired(p.prefix, p.stop - p.prefix, tail.length, p.shift if tail.length else 0)


def feed(session: Any, tokens: list[int]) -> None:
    """Feed ``tokens`` into ``session``'s caches, a call at a time."""
    feed_prompt(session.model, session.caches, tokens)


def edit(session: Any, turn: int, text: str, window: int) -> tuple[str, Repaired | str]:
    """Replace the user message of turn ``turn`` (from 1) with ``text`` and make
    ``session`` ready to answer its last user message again, the turns between kept.

    Returns:
        ``(message, done)``: the last user message (to stream a new reply to) and the
        repair's counts, or why it rebuilt (the caches then start over from the
        system prompt; the next turn feeds the whole transcript).
    """
    from mlx_stream.errors import UserError

    users = [i for i, m in enumerate(session.messages) if m["role"] == "user"]
    if not 1 <= turn <= len(users):
        raise UserError(f"/edit: no turn {turn} (the chat has {len(users)})")
    messages = [dict(m) for m in session.messages]
    messages[users[turn - 1]] = {"role": "user", "content": text}
    last = users[-1]
    history, again = messages[:last], messages[last]["content"]
    point = session.checkpoint()
    try:
        done = repair(session, history, again, window)
    except BaseException:
        session.restore(point)
        raise
    if isinstance(done, str):
        session.reset()
        session.messages = history
    return again, done
