"""The session table of :class:`~mlx_stream.serve.engine.Engine` (:class:`Sessions`, owned
by the engine): sessions made resident (loaded from the state folder or new), evicted,
dropped, rebuilt from a client's history, started from a shared system-prompt
snapshot, repaired after an edit, saved on a drain.

Contract: a session's caches always encode exactly the transcript its entry records;
its checkpoint encodes the transcript one turn shorter. Room is made by
:class:`~mlx_stream.serve.admission.Admission` before any cache is allocated.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.generate.session import ChatSession, Checkpoint, Settings, cache_count
from mlx_stream.serve import marks, matching
from mlx_stream.serve import recall as recalled
from mlx_stream.serve.admission import COPIES, Admission, weights_bytes
from mlx_stream.serve.matching import Entry
from mlx_stream.serve.refusals import Unsaved
from mlx_stream.serve.scheduler import Job
from mlx_stream.serve.store import MAX_STORED, SessionStore


class Sessions:
    """The session table: entries by ``(owner, id)``, resident or saved in the state
    folder, admitted by bytes. Used on the worker thread only.

    Args:
        model, tokenizer: The loaded model.
        settings (Settings): Session defaults.
        model_id (str): The name the model is served under (saved sessions record it).
        draft_model: A draft model for speculative decoding.
        keep_system (bool): Make the rendered system prompt the sinks.
        pin (int): Most tokens of a rendered system prompt kept as sinks.
        budget (int, optional): Memory budget in bytes (:class:`Admission`).
        max_sessions (int, optional): Most resident sessions.
        state_dir (Path, optional): The state folder (:class:`SessionStore`).
        isolate (bool): Never match a request without a session id to a session.
        prefixes (PrefixStore, optional): System prompts' caches on disk.
        repair_tokens (int): Tokens after an edit computed again (0: rebuilt).
        ids (random.Random, optional): Where new ids come from (the same on every
            rank of a cluster). Default: ``uuid4``.
    """

    def __init__(
        self, model: Any, tokenizer: Any, settings: Settings, model_id: str, *,
        draft_model: Any = None, keep_system: bool = True, pin: int, budget: int | None = None,
        max_sessions: int | None = None, state_dir: str | Path | None = None,
        isolate: bool = False, prefixes: Any = None, repair_tokens: int = 0,
        ids: random.Random | None = None,
    ):  # fmt: skip
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.settings, self.model_id, self.keep_system, self.pin = (
            settings, model_id, keep_system, pin
        )  # fmt: skip
        self.isolate, self.prefixes, self.repair_tokens, self._ids = (
            isolate, prefixes, repair_tokens, ids
        )  # fmt: skip
        self.recall = settings.cache.recall  # a RecallSpec: each session its own store
        recalled.remove_stale(self.recall)
        weights = weights_bytes(model) + (weights_bytes(draft_model) if draft_model else 0)
        self.store = SessionStore(state_dir, self.store_config)
        self.entries: dict[tuple[str, str], Entry] = {}  # by (owner, id)
        self.admission = Admission(
            self.entries, weights, budget, max_sessions, measure=self.measure_cache, evict=self._evict,
            fixed=lambda sinks: recalled.fixed_bytes(model, self.recall, sinks),
            copies=2 if self.recall is not None else COPIES,  # marks only without recall
        )  # fmt: skip
        self._dropped: set[tuple[str, str]] = set()  # caches dropped: rebuilt on next use
        self.evictions = self.restores = self.dropped = 0

    def load(self, discard: bool = False) -> None:
        """Find the sessions the state folder's index lists (and whose files are
        intact) again: on disk, each loaded on its next request; ``discard``: drop
        them instead (:meth:`SessionStore.load`)."""
        for entry in self.store.load(discard=discard):
            self.entries[entry.key] = entry

    def close(self) -> None:
        """Release every session's recall store and the state folder (the worker is
        gone)."""
        for entry in self.entries.values():
            recalled.release(entry.session)
        self.store.cleanup()

    def end_turn(self, entry: Entry, rollback: bool) -> None:
        """The request on ``entry`` ended: a transient one is dropped; on ``rollback``
        its session goes back to the checkpoint from before the turn, else an edit's
        repair stays; its record follows its session."""
        entry.busy = False
        entry.last_used = time.monotonic()
        if entry.transient:
            self.drop(entry)
            return
        if rollback and entry.checkpoint is not None:
            entry.session.restore(entry.checkpoint)  # its recall tier too
        elif entry.repaired is not None:  # the turn went through: the edit stays
            entry.checkpoint = entry.repaired
        entry.repaired = None
        entry.messages = [dict(m) for m in entry.session.messages]
        entry.tokens_seen = cache_count(entry.session.caches)

    def save_all(self) -> None:
        """Save every resident session to the state folder (a temporary one outlives
        nothing: none); one that cannot be saved is reported on stderr."""
        if self.store.temporary:
            return
        for entry in [e for e in self.entries.values() if e.session and not e.transient]:
            try:
                self._evict(entry, drop=False)
            except (UserError, Unsaved) as exc:  # UserError: a session save refused
                sys.stderr.write(f"Error: session {entry.id} not saved: {exc}\n")

    @property
    def budget(self) -> int:
        """The memory budget in bytes (settable)."""
        return self.admission.budget

    @budget.setter
    def budget(self, value: int) -> None:
        self.admission.budget = value

    @property
    def weights(self) -> int:
        """Bytes of the weights (and the draft model's)."""
        return self.admission.weights

    @property
    def snapshots(self) -> dict[str, tuple[Checkpoint, int]]:
        """The shared system-prompt snapshots: ``(checkpoint, bytes)`` by prompt."""
        return self.admission.snapshots

    def session_bytes(self, sinks: int) -> int:
        """Bytes of one resident session with ``sinks`` sinks (its caches and its
        checkpoint), see :meth:`Admission.session_bytes`."""
        return self.admission.session_bytes(sinks)

    def used_bytes(self) -> int:
        """Weights + snapshots + resident sessions."""
        return self.admission.used_bytes()

    def measure_cache(self, sinks: int) -> int:
        """Bytes of one session's caches with ``sinks`` sinks, from real caches (after
        their one allocation)."""
        import mlx.core as mx

        settings = self.settings_for(sinks=sinks)
        probe = ChatSession(
            self.model, self.tokenizer, settings, draft_model=self.draft_model
        )  # fmt: skip
        try:
            probe.prefill(self.tokenizer.decode([0]) or " ")
            mx.eval([c.state for c in probe.caches])
            return sum(int(getattr(c, "nbytes", 0) or 0) for c in probe.caches)
        finally:
            recalled.release(probe)

    def settings_for(self, sinks: int | None = None, **changes: Any) -> Settings:
        """The engine's settings for one new session: its own recall store (a folder
        of its own), ``sinks`` if given, and ``changes``."""
        policy = self.settings.cache.replace(recall=recalled.for_session(self.recall))
        if sinks is not None:
            policy = policy.replace(sinks=sinks)
        return dataclasses.replace(self.settings, cache=policy, **changes)

    def _evict(self, entry: Entry, drop: bool = True) -> None:
        """Save a resident session to disk (listed in the state folder's index) and
        free its memory; :class:`Unsaved` when the folder cannot take it (the
        session then stays resident). A session whose save is refused
        (``UserError``) has its caches dropped
        when ``drop`` (its next request rebuilds it from the client's history), else
        the error is raised."""
        try:
            path, record = self.store.save(entry)
        except RuntimeFailure:  # Unsaved: the folder, not the session
            raise
        except UserError:
            if not drop:
                raise
            recalled.release(entry.session)
            marks.forget(entry.marks)
            entry.session, entry.checkpoint, entry.marks = None, None, marks.Marks()
            self._dropped.add(entry.key)
            self.dropped += 1
            return
        recalled.release(entry.session)  # the saved files hold it now
        # (its base stays on disk beside it: marks.load finds it again)
        entry.path, entry.session, entry.checkpoint, entry.marks = path, None, None, marks.Marks()
        entry.tokens_seen = record["tokens_seen"]
        self.evictions += 1
        stored = [e for e in self.entries.values() if e.session is None]
        if len(stored) > MAX_STORED:
            self.drop(min(stored, key=lambda e: e.last_used))

    def evict(self, entry: Entry) -> Path | None:
        """Save the idle resident session of ``entry`` to the state folder now and free
        its memory (as room being made would); its saved file's path. On the worker
        thread (:meth:`call`)."""
        self._evict(entry)
        return entry.path

    def sinks_for(self, system: str | None) -> int:
        """The sinks a new session with the system prompt ``system`` gets (its rendered
        prompt up to the pin with ``keep_system``); on the worker thread."""
        session = self._new_session(system)
        try:
            return session.sinks
        finally:
            recalled.release(session)

    def drop(self, entry: Entry) -> None:
        """Forget ``entry``: its caches released, its saved files removed."""
        self.entries.pop(entry.key, None)
        self._dropped.discard(entry.key)
        recalled.release(entry.session)
        marks.forget(entry.marks)
        if entry.path is not None:
            self.store.forget(entry)

    def _new_session(self, system: str | None, tools: Any = None) -> ChatSession:
        """A session for ``system`` (and ``tools``) whose caches are not allocated yet."""
        settings = self.settings_for(keep_system=self.keep_system, pin_limit=self.pin)
        kw = {"system": system, "draft_model": self.draft_model, "tools": tools}
        try:
            session = ChatSession(self.model, self.tokenizer, settings, **kw)
        except UserError:  # keep_system without any system prompt: plain sinks
            settings.keep_system = False
            session = ChatSession(self.model, self.tokenizer, settings, **kw)
        return session

    def _from_snapshot(self, session: ChatSession, keep: Entry, extra: int = 0) -> None:
        """Start ``session`` from its system prompt's shared prefilled snapshot (made,
        and admitted by bytes, on first use), making room for ``extra`` more bytes
        too (the session itself, not counted yet). Without room for a shared copy
        (or none is busy to free it), the session prefills its own. A system prompt
        longer than the pin is left unfed: the turn feeds it a chunk per round
        (:meth:`head_first`), then shares it."""
        admission = self.admission
        head = session.system_text() if session.settings.keep_system else ""
        if not head:
            admission.make_room(extra, keep)
            return
        snap = admission.snapshots.get(head) if self.recall is None else None
        if snap is None and self.unfed_head(session):
            admission.make_room(extra, keep)
            return
        if self.recall is not None:  # a snapshot's copy would share its tier
            admission.make_room(extra, keep)
            session.prefill(head)
            return
        if snap is not None:
            admission.make_room(extra, keep, head)
            self.restore_head(session, head)
        else:
            size = admission.cache_bytes(session.sinks)
            shared = admission.fits(extra + size, keep, head)
            admission.make_room(extra + size if shared else extra, keep, head)
            steps = session.prefill_stored(head, self.prefixes)  # or from the store
            while True:
                try:
                    next(steps)
                except StopIteration as done:  # computed, not read: this request's work
                    keep.prefilled = 0 if done.value else cache_count(session.caches)
                    break
            if shared:
                admission.add_snapshot(head, session.checkpoint(), size)

    def unfed_head(self, session: ChatSession) -> str:
        """The rendered system prompt of a session whose caches do not hold it yet,
        when it is longer than the pin (fed a chunk per round); else ``""``."""
        if session.fed_text or not session.settings.keep_system:
            return ""
        head = session.system_text()
        return head if head and len(session.encode(head)) > session.sinks else ""

    def restore_head(self, session: ChatSession, head: str) -> None:
        """``session``'s caches from ``head``'s shared snapshot, its transcript kept."""
        messages = session.messages
        session.restore(self.admission.snapshots[head][0])
        session.messages = messages
        self.admission.touch_snapshot(head)

    def head_first(
        self, job: Job, session: ChatSession, head: str, turn: Iterator[Any]
    ) -> Iterator[Any]:
        """``turn``'s token source, after ``head`` goes into ``session``'s empty caches a
        chunk per poll (``None``); the head is then shared as its system prompt's
        snapshot where the budget has room without evicting anything."""
        steps = session.prefill_stored(head, self.prefixes)
        while True:
            try:
                next(steps)
            except StopIteration as done:  # its value: the prefix store held the head
                stored = done.value
                break
            yield None
        fed = len(session.tokens)  # the head's, set by prefill_stored: no second encode
        if stored:  # read, not computed: cached tokens, as a snapshot's are
            job.cached += fed
        else:
            job.head = fed
        admission, size = self.admission, self.admission.cache_bytes(session.sinks)
        room = admission.used_bytes() + size <= admission.budget
        if self.recall is None and head not in admission.snapshots and room:
            admission.add_snapshot(head, session.checkpoint(), size)
        yield from turn

    def _resident(self, entry: Entry) -> bool:
        """Make ``entry`` resident: admitted by bytes, then loaded from disk or new.

        Returns:
            True when its saved session was lost or corrupt (its files and index
            record are dropped): it starts fresh, for the caller to rebuild from
            the client's history.
        """
        if entry.session is not None:
            return False
        session = self._new_session(entry.system, entry.tools)
        need = self.session_bytes(session.sinks)
        lost = entry.key in self._dropped  # its caches were dropped: rebuilt
        self._dropped.discard(entry.key)
        if entry.path is not None:
            self.admission.make_room(need, entry)
            try:
                self.store.check(entry)
                entry.marks = marks.load(session, entry.path)  # its newest mark first
                session.load(entry.path)
                self.restores += 1
            except UserError:
                self.store.forget(entry)
                recalled.release(session)
                session, lost = self._new_session(entry.system, entry.tools), True
        try:
            if entry.path is None:
                self._from_snapshot(session, entry, extra=need)
        except BaseException:
            recalled.release(session)
            raise
        entry.session, entry.bytes, entry.sinks = session, need, session.sinks
        return lost

    def store_config(self) -> dict[str, Any]:
        """What saved caches depend on: a restart with another model or cache shape
        finds none of them (they would load with sizes the budget does not count)."""
        return {
            "model": self.model_id, "weights_bytes": self.weights,
            "cache": self.settings.cache.to_json(), "keep_system": self.keep_system,
            **({"recall": recalled.config(self.recall)} if self.recall is not None else {}),
            "num_draft_tokens": self.settings.num_draft_tokens,
            "draft_model": self.draft_model is not None,
        }  # fmt: skip

    def new_id(self, n: int) -> str:
        """A fresh ``n``-hex-digit id (the same on every rank of a cluster)."""
        if self._ids is None:
            return uuid.uuid4().hex[:n]
        return f"{self._ids.getrandbits(4 * n):0{n}x}"

    def place(
        self, request: Any, toolset: Any, system: str | None, history: list, user: Any
    ) -> tuple[Entry, str, Any]:
        """The session ``request`` continues (:func:`~mlx_stream.serve.matching.find`),
        resident and encoding exactly ``history`` (restored, repaired or rebuilt), its
        checkpoint the state before the turn: ``(entry, mode, repaired)``; ``repaired``
        is the repair's counts, or why an edit could not be repaired (rebuilt)."""
        repairs = self.repair_tokens > 0 and self.recall is None and self.draft_model is None
        entry, mode, source = matching.find(
            self.entries, request, system, history, toolset,
            isolate=self.isolate, new_id=self.new_id, repair=repairs,
        )  # fmt: skip
        checkpoint = source.checkpoint if source is not None else None  # room may evict it
        if mode == "repair" and source is not entry:  # a fork: a copy of the source
            checkpoint = source.session.checkpoint()
        if mode == "restore" and source is not entry and self.recall is not None:
            mode, checkpoint = "rebuild", None  # a fork would share the source's store
        try:
            if self._resident(entry):  # its saved file was lost: rebuilt from the history
                mode = "rebuild"
        except BaseException:
            if entry.session is None and entry.path is None:  # refused before it began
                self.drop(entry)
            raise
        session, repaired = entry.session, None
        session.thinking = request.thinking  # before anything renders its turn
        if mode == "repair":
            fork = checkpoint if source is not entry else None
            repaired = self._repair(entry, fork, history, user)
            if isinstance(repaired, str):
                repaired = self._on_mark(entry, source, history, user, repaired, checkpoint)
            mode = "rebuild" if isinstance(repaired, str) else mode
        elif mode == "rebuild" and entry.session is not None and entry.marks:
            resumed = marks.resume(
                entry.session, entry.marks, history, user, "its transcript differs"
            )
            mode, repaired = ("repair", resumed) if resumed is not None else (mode, None)
        if mode == "restore":  # the checkpoint encodes exactly ``history``
            session.restore(checkpoint)
            entry.checkpoint = checkpoint
        elif mode == "rebuild":  # the whole history goes in with the new turn
            self._rebuild(entry, system, history, toolset)
            session = entry.session
        elif mode != "repair":
            entry.checkpoint = session.checkpoint()
        entry.messages = [dict(m) for m in session.messages]  # true even if the start fails
        return entry, mode, repaired

    def _on_mark(
        self, entry: Entry, source: Entry, history: list, user: Any, why: str, before: Any
    ) -> Any:
        """After a repair refused for ``why``: resume from a mark of ``source``
        (:mod:`~mlx_stream.serve.marks`), else from its checkpoint (:meth:`_resume`). On a
        mark, a failed turn goes back to the entry's checkpoint, ``before`` for a fork
        (both encode their own transcripts exactly)."""
        cp = source.checkpoint
        beyond = len(cp.tokens or ()) if starts(cp, history) else 0  # where it holds more
        resumed = marks.resume(entry.session, source.marks, history, user, why, beyond)
        if resumed is None:
            return self._resume(entry, source, history, user, why)
        if entry.checkpoint is None:
            entry.checkpoint = before
        return resumed

    def _resume(self, entry: Entry, source: Entry | None, history: list, user: Any, why: str):
        """When ``source``'s checkpoint (the state before its last turn) encodes a start
        of ``history``, go back to it and feed the rest: an edit near the end that its
        repair refused (the window has evicted), such as an agent's reply resent
        otherwise than it was generated, is then exact from there. The ``Repaired``
        counts (noted), or ``why`` (the caller rebuilds)."""
        cp = source.checkpoint if source is not None else None
        if not starts(cp, history):
            return why
        entry.session.restore(cp)
        done = self._repair(entry, None, history, user)
        if isinstance(done, str):
            return why
        done.note = f"edit resumed from the turn before, not repaired: {why}"
        return done

    def _repair(self, entry: Entry, source: Checkpoint | None, history: list, user: Any) -> Any:
        """Repair ``entry``'s session to encode ``history`` (from ``source``, a copy of
        the session it forks, when given); its checkpoint is the state before (what a
        failed turn goes back to). The ``Repaired`` counts, or why a repair cannot
        serve (the caller rebuilds)."""
        from mlx_stream.generate import repair

        session = entry.session
        if source is not None:
            session.restore(source)
        plan = repair.plan(session, history, user, self.repair_tokens)
        if isinstance(plan, str):
            return plan
        entry.checkpoint = session.checkpoint()
        try:
            done = repair.apply(session, history, plan)
        except BaseException:
            session.restore(entry.checkpoint)
            raise
        entry.repaired = session.checkpoint()  # the checkpoint once the turn goes through
        return done

    def _rebuild(
        self, entry: Entry, system: str | None, history: list[dict], tools: Any = None
    ) -> None:
        """Start ``entry`` over from its system prompt's snapshot with ``history`` as
        its transcript (the next turn feeds the tail of it that fits the window)."""
        session = self._new_session(system, tools)
        session.thinking = entry.session.thinking if entry.session is not None else None
        need = self.session_bytes(session.sinks)
        try:
            if need > entry.bytes:
                self.admission.make_room(need - entry.bytes, entry)
            self._from_snapshot(session, entry)
        except BaseException:
            recalled.release(session)
            raise
        session.messages = [dict(m) for m in history]
        if entry.session is not session:
            recalled.release(entry.session)  # the session it replaces
        entry.session, entry.bytes, entry.sinks, entry.system = session, need, session.sinks, system
        entry.tools = tools
        entry.checkpoint = session.checkpoint()

    def add(self, entry: Entry) -> Entry:
        self.entries[entry.key] = entry
        return entry


def starts(cp: Checkpoint | None, history: list) -> bool:
    """Whether ``cp`` encodes a start of ``history`` shorter than all of it."""
    n = len(cp.messages) if cp is not None else 0
    return 0 < n < len(history) and history[:n] == cp.messages
