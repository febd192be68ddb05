"""``serve``'s sessions never carry one conversation into another: a session's cache is
always the encoding of the transcript it records, whatever ended its last turn, and a
request only ever continues a session of its own caller.

The reference for "the reply this request should get" is a fresh engine sent the
request's conversation whole. The window (256) holds every conversation here, so a
session continued turn by turn, restored from a checkpoint, brought back from disk or
rebuilt from its history holds the same tokens and must give the same greedy reply;
over a tiny random model any other context changes the reply.
"""

from __future__ import annotations

import queue
import random
import time

import pytest

from mlx_stream.cache.spec import CacheSpec
from mlx_stream.generate.session import Settings
from mlx_stream.serve.event_types import Delta, End, Failed, Started

SYSTEM = "you are a captain"
WORDS = "the old captain said sea was very long and ship sail on hello what".split()


@pytest.fixture
def engine(loaded, tmp_path):
    from mlx_stream.serve.engine import Engine

    made = []

    def make(**kw):
        model, tokenizer = loaded
        settings = Settings(CacheSpec(sinks=2, window=256), max_tokens=6)
        e = Engine(model, tokenizer, settings, "tiny", state_dir=tmp_path / str(len(made)), **kw)
        (tmp_path / str(len(made))).mkdir()
        e.start()
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


class Reply:
    def __init__(self, text, usage, session_id, error=None):
        self.text, self.usage, self.session_id, self.error = text, usage, session_id, error

    @property
    def cached(self) -> int:
        return self.usage["prompt_tokens_details"]["cached_tokens"]


def ask(engine, messages, session_id=None, owner="", cancel_after=None, **kw) -> Reply:
    """One chat request through the engine; ``cancel_after`` text events, the client
    goes away (the request is cancelled) and this waits until its session is idle."""
    from mlx_stream.serve.engine import Request

    events: queue.Queue = queue.Queue()
    request = Request(
        emit=events.put, messages=[dict(m) for m in messages], session_id=session_id,
        owner=owner, **kw,
    )  # fmt: skip
    engine.submit(request)
    parts, sid, seen = [], None, 0
    while True:
        match event := events.get(timeout=60):
            case Started(session_id):
                sid = session_id
            case Delta(text):
                parts.append(text)
                seen += 1
                if cancel_after is not None and seen >= cancel_after:
                    request.cancelled.set()
                    wait_idle(engine)
                    return Reply(None, None, sid, error="cancelled")
            case End(usage):
                return Reply("".join(parts), usage, sid)
            case _:
                return Reply(None, None, sid, error=event)


def wait_idle(engine, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while engine.call(lambda: any(e.busy for e in engine.entries.values())).result():
        assert time.monotonic() < deadline, "a cancelled request never ended"
        time.sleep(0.01)


def conversation(*turns: str, system: str | None = SYSTEM) -> list[dict]:
    """``turns`` alternate user, assistant, user, ... (the last is the user's)."""
    head = [{"role": "system", "content": system}] if system else []
    roles = ("user", "assistant")
    return head + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


class Reference:
    """The reply a fresh engine gives to a conversation sent whole (memoized)."""

    def __init__(self, engine):
        self.engine, self.memo = engine, {}

    def __call__(self, messages: list[dict]) -> str:
        key = repr(messages)
        if key not in self.memo:
            reply = ask(self.engine, messages, session_id=f"ref-{len(self.memo)}")
            assert reply.text is not None, reply.error
            self.memo[key] = reply.text
        return self.memo[key]


# --------------------------------------------------------------- item 1: cut-off turns


@pytest.mark.parametrize("ending", ["disconnect", "error"])
def test_a_cut_off_turn_leaves_nothing_for_the_next_conversation_on_that_id(engine, ending):
    """The victim's second turn ends early; a new conversation sent with the victim's
    session id gets exactly a fresh session's reply, not one conditioned on turn 1."""
    e, ref = engine(), Reference(engine())
    first = ask(e, conversation("the ship sail on"), session_id="victim-1")
    cut = conversation("the ship sail on", first.text, "hello captain")
    if ending == "disconnect":
        assert ask(e, cut, session_id="victim-1", cancel_after=1).error == "cancelled"
    else:
        assert isinstance(ask(e, cut, session_id="victim-1", seed=-1).error, Failed)
    other = conversation("what was very long")
    reply = ask(e, other, session_id="victim-1")
    assert reply.text == ref(other)
    warm = engine()  # another conversation made the system prompt's snapshot there
    ask(warm, conversation("the sea"))
    fresh = ask(warm, other)
    assert reply.cached == fresh.cached > 0  # the system prompt's snapshot, nothing more


@pytest.mark.parametrize("ending", ["disconnect", "error"])
def test_after_a_cut_off_turn_an_edit_of_the_turn_before_is_not_answered_from_it(engine, ending):
    """The owner edits turn 1 after turn 2 was cut off: the checkpoint from before
    turn 2 holds turn 1 and must not be restored for an edit of turn 1."""
    e, ref = engine(), Reference(engine())
    first = ask(e, conversation("the ship sail on"), session_id="s")
    cut = conversation("the ship sail on", first.text, "hello captain")
    kw = {"cancel_after": 1} if ending == "disconnect" else {"seed": -1}
    assert ask(e, cut, session_id="s", **kw).error is not None
    edit = conversation("what was very long")
    assert ask(e, edit, session_id="s").text == ref(edit)
    again = ask(e, cut, session_id="s")  # and then the owner's regeneration of turn 2
    assert again.text == ref(cut)


def test_a_new_conversation_without_an_id_never_takes_over_a_session(engine):
    e, ref = engine(), Reference(engine())
    first = ask(e, conversation("the ship sail on"))
    cut = conversation("the ship sail on", first.text, "hello captain")
    assert ask(e, cut, session_id=first.session_id, cancel_after=1).error == "cancelled"
    other = ask(e, conversation("what was very long"))
    assert other.text == ref(conversation("what was very long"))
    assert other.session_id != first.session_id
    back = ask(e, cut)  # the owner, without an id: its session goes on
    assert back.session_id == first.session_id and back.text == ref(cut)
    assert back.cached > other.cached


# ------------------------------------------------------------ item 2: whose sessions


def test_owners_have_their_own_session_ids_and_transcripts(engine):
    e, ref = engine(), Reference(engine())
    mine = conversation("the ship sail on")
    a = ask(e, mine, session_id="shared", owner="alice")
    theirs = conversation("what was very long")
    b = ask(e, theirs, session_id="shared", owner="bob")
    assert b.text == ref(theirs) and a.text == ref(mine)
    # Bob extends Alice's transcript, without an id and with it: never her session.
    follow = conversation("the ship sail on", a.text, "hello captain")
    for sid in (None, "shared"):
        got = ask(e, follow, session_id=sid, owner="bob")
        assert got.text == ref(follow)
        assert got.cached < a.usage["total_tokens"] - 1  # not continued from her cache
    sessions = {(s["owner"], s["id"]) for s in e.stats["sessions"]}
    assert ("alice", "shared") in sessions and ("bob", "shared") in sessions
    assert e.entries[("alice", "shared")].messages == mine[1:] + [
        {"role": "assistant", "content": a.text}
    ]


def test_an_edit_without_an_id_forks_and_the_original_stays(engine):
    e, ref = engine(), Reference(engine())
    t1 = ask(e, conversation("the ship sail on"))
    two = conversation("the ship sail on", t1.text, "hello captain")
    t2 = ask(e, two)
    assert t2.session_id == t1.session_id
    edit = conversation("the ship sail on", t1.text, "what was very long")
    forked = ask(e, edit)
    assert forked.session_id != t1.session_id and forked.text == ref(edit)
    assert forked.cached > 0  # restored from the checkpoint, not rebuilt
    three = two + [{"role": "assistant", "content": t2.text}, {"role": "user", "content": "sea"}]
    on = ask(e, three)  # the original owner goes on where it was
    assert on.session_id == t1.session_id and on.text == ref(three)
    assert on.cached >= t2.usage["total_tokens"] - 1


def test_isolate_matches_no_request_without_an_id(engine):
    e, ref = engine(isolate=True), Reference(engine())
    t1 = ask(e, conversation("the ship sail on"))
    two = conversation("the ship sail on", t1.text, "hello captain")
    t2 = ask(e, two)
    assert t2.session_id != t1.session_id and t2.text == ref(two)
    assert t2.cached < t1.usage["total_tokens"] - 1


# ------------------------------------------------------------ item 5: history kept


def test_an_unknown_id_with_a_history_is_answered_from_the_history(engine):
    """What every client sends after a server restart: the history is not dropped."""
    e = engine()
    history = conversation("the ship sail on", "very long sea", "what was very long")
    named = ask(e, history, session_id="after-restart")
    anonymous = ask(engine(), history)
    alone = ask(engine(), conversation("what was very long"))
    assert named.text == anonymous.text
    assert named.usage["prompt_tokens"] == anonymous.usage["prompt_tokens"]
    assert named.usage["prompt_tokens"] > alone.usage["prompt_tokens"] + 5


# ----------------------------------------------------------- the invariant, at random


def test_random_turns_edits_regenerations_and_failures_answer_as_fresh_sessions(engine):
    """Three clients (two owners; ids and no ids; one session id shared by name across
    owners), a budget of two resident sessions (evictions to disk and back), and at
    random: new turns, regenerations, edits, new conversations, disconnects mid-reply and
    failed turns. Every reply equals a fresh engine's for the same messages."""
    e, ref = engine(max_sessions=2), Reference(engine())
    rng = random.Random(23)
    clients = [
        {"owner": "alice", "sid": "s", "messages": []},
        {"owner": "bob", "sid": "s", "messages": []},
        {"owner": "alice", "sid": None, "messages": []},
    ]
    kinds = ["turn"] * 4 + ["regenerate", "edit", "new", "disconnect", "fail"]
    checked = 0
    for _ in range(36):
        c = rng.choice(clients)
        kind = rng.choice(kinds) if c["messages"] else "new"
        words = " ".join(rng.sample(WORDS, 3))
        base = c["messages"]
        if kind == "new":
            messages = conversation(words)
        elif kind in ("regenerate", "edit"):
            last = base[-2]["content"] if kind == "regenerate" else words
            messages = base[:-2] + [{"role": "user", "content": last}]
        else:
            messages = base + [{"role": "user", "content": words}]
        if kind == "disconnect":
            assert ask(e, messages, c["sid"], c["owner"], cancel_after=1).error
            continue
        if kind == "fail":
            assert ask(e, messages, c["sid"], c["owner"], seed=-1).error
            continue
        reply = ask(e, messages, c["sid"], c["owner"])
        assert reply.text is not None, reply.error
        assert reply.text == ref(messages), (kind, c["owner"], c["sid"])
        c["messages"] = messages + [{"role": "assistant", "content": reply.text}]
        checked += 1
    assert checked >= 20 and e.evictions > 0 and e.restores > 0
