"""The engine of ``mlx-stream serve``: chat sessions in fixed memory, admitted by bytes,
all model work on one MLX thread.

Contract:
- Every session is a :class:`~mlx_stream.session.ChatSession` whose SinkCaches have a
  fixed size, so a session costs a known number of bytes (its caches plus the
  checkpoint taken before its current turn, measured from real caches). Admission:
  ``weights + snapshots + resident sessions x bytes <= budget``. A session that does
  not fit evicts the least recently used idle session to disk (``save_cache``); it
  comes back on its next request. When nothing can be evicted the request is refused
  (:class:`Busy`: HTTP 429 with ``Retry-After``), never an out-of-memory.
- A session's caches always encode exactly the transcript it records, after every
  ending (complete, stop, cancel, disconnect, error, eviction, restore); its checkpoint
  encodes the transcript one turn shorter and is restored only for that transcript.
  Sessions belong to an owner (a hash of the caller's API key; one owner without keys)
  and a request only ever sees its owner's sessions. A request names its session
  (``X-Session-ID``) or is matched on its transcript: one whose messages extend a
  session's transcript by one user message feeds only that message; one that replaces
  the last turn (an edit or a regeneration) restores the checkpoint from before it, in
  place with the session's id, as a new session (a fork) without one; anything else is
  rebuilt from the pinned system prompt plus the tail that fits the window. A request
  without an id never takes over a session whose transcript it does not extend
  (``isolate``: it is never matched at all). A wrapped ring matches no token prefix, so
  matching is on the transcript, never on the KV cache.
- Pinned system prompt (``keep_system``): the rendered system prompt is the session's
  sinks; sessions with the same system prompt start from one prefilled snapshot.
- One worker thread runs every MLX call, fed by a queue. Each scheduler round, every
  session with decode work steps together in ONE batched model call
  (:class:`~mlx_stream.batch.Batch`: one row per session, each in its own fixed-size
  cache, its own sampling parameters and stop strings); a newcomer's prompt is
  prefilled a chunk per round meanwhile, so running sessions keep streaming. Where
  batching is refused (a draft model, quantized KV, a model whose batched step is not
  exact: the reason is in the stats), each round advances every request by at most
  ``chunk`` tokens instead (fair interleaving: no request waits for another's long
  reply). A cancelled request (a client that went away) stops at the next token and
  its session goes back to the checkpoint from before the turn.

The HTTP side (:mod:`mlx_stream.api`) only translates requests into :class:`Request`
objects and events back into responses.

Sharded (``cluster``: ``serve --distributed``): rank 0 owns HTTP; its worker takes one
request at a time, hands it to the other ranks (:meth:`Engine.follow`) with MLX's
collectives and runs it to its end in step with them; batching is off. The ranks agree
on session ids and on a cancelled request (once per ``chunk`` of tokens), so every
rank's sessions stay the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.generate.session import (
    ChatSession,
    Checkpoint,
    Reply,
    Settings,
    cache_count,
    clean_text,
)
from mlx_stream.serve.logprobs import TokenLogprobs

DEFAULT_CHUNK = 8  # tokens a request advances per scheduler round
DEFAULT_RETRY_AFTER = 2  # seconds a refused client is told to wait
MAX_SNAPSHOTS = 8  # shared system-prompt snapshots kept (least recently used dropped)
MAX_STORED = 256  # sessions kept on disk (oldest dropped)
PUBLISH_EVERY = 0.25  # seconds between refreshes of the stats while requests run


class Busy(Exception):
    """No memory for another session now: every resident session is busy (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = DEFAULT_RETRY_AFTER):
        super().__init__(message)
        self.retry_after = retry_after


class BadRequest(UserError):
    """A request the engine cannot serve as asked (HTTP 400), with one line saying why."""


@dataclass
class Request:
    """One generation request, built by the HTTP side.

    ``messages`` (chat) or ``prompt`` (plain completion). ``owner`` names the caller's
    namespace of sessions (a hash of its API key; ``""`` without keys): a request only
    ever sees and continues sessions of its own owner. Events reach ``emit`` from the
    worker thread: ``("start", info)``, ``("text", str, logprob)`` per segment (the
    token's entry from :class:`~mlx_stream.logprobs.TokenLogprobs` when ``logprobs``
    is set, else ``None``), then ``("end", usage, finish_reason)`` or ``("error",
    status, message, retry_after)``. Setting ``cancelled`` stops the request at its
    next token. ``logprobs``: ``None`` for none, else how many alternatives per token.
    """

    emit: Callable[[tuple], None]
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    session_id: str | None = None
    max_tokens: int | None = None
    temp: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    owner: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)


WIRE = ("messages", "prompt", "session_id", "max_tokens", "temp", "top_p", "stop", "seed",
        "logprobs", "owner")  # fmt: skip
FOLLOW = "follow"  # a follower's worker: take requests from rank 0 from now on


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

    @property
    def key(self) -> tuple[str, str]:
        return (self.owner, self.id)


@dataclass
class _Job:
    request: Request
    entry: Entry
    tokens: Iterator[Any]
    cached: int
    started: float = field(default_factory=time.perf_counter)
    batched: bool = False
    row: Any = None  # its mlx_stream.batch.Row, once its first token was asked for
    running: bool = False  # inside next(tokens): never re-entered


def weights_bytes(model: Any) -> int:
    """Bytes of a model's parameters."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def physical_memory() -> int:
    """Bytes of memory of this machine (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class Engine:
    """Sessions, admission by bytes and the one MLX worker thread.

    Args:
        model, tokenizer: The loaded model.
        settings (Settings): Session defaults (sinks, window, kv bits, max tokens...).
        model_id (str): The name the API serves the model under.
        draft_model: A draft model for speculative decoding.
        keep_system (bool): Make the rendered system prompt the sinks. Default: True.
        budget (int, optional): Memory budget in bytes. Default: 75% of the machine.
        max_sessions (int, optional): Most resident sessions. Default: no limit.
        state_dir (Path, optional): Where evicted sessions go. Default: a temp folder.
        chunk (int): Tokens a request advances per scheduler round when not batched.
        batching (bool): Decode sessions together in one batched call per round.
            Default: True (refused, with the reason in the stats, where inexact).
        cluster (distributed.Cluster, optional): The ranks a sharded model runs on.
        isolate (bool): Never match a request without ``X-Session-ID`` to a session
            (each starts its own). Default: False (a request that extends one of its
            owner's transcripts continues that session).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: Settings,
        model_id: str,
        *,
        draft_model: Any = None,
        keep_system: bool = True,
        budget: int | None = None,
        max_sessions: int | None = None,
        state_dir: str | Path | None = None,
        chunk: int = DEFAULT_CHUNK,
        batching: bool = True,
        cluster: Any = None,
        isolate: bool = False,
    ):
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self._logprobs = TokenLogprobs(tokenizer)
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.cluster, self._ids = cluster, None
        if cluster is not None:
            self._ids = random.Random(cluster.share_int(random.getrandbits(62)))
            if state_dir is not None:  # ranks on one machine must not share files
                state_dir = Path(state_dir) / f"rank-{cluster.rank}"
                state_dir.mkdir(exist_ok=True)
        self.settings, self.model_id, self.keep_system = settings, model_id, keep_system
        self.weights = weights_bytes(model) + (weights_bytes(draft_model) if draft_model else 0)
        self.budget = budget if budget else int(physical_memory() * 0.75) or 1 << 62
        self.max_sessions, self.chunk, self.isolate = max_sessions, chunk, isolate
        self._tmp = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mlx-stream-sessions-")
            state_dir = self._tmp.name
        self.state_dir = Path(state_dir)
        self.entries: dict[tuple[str, str], Entry] = {}  # by (owner, id)
        self.snapshots: dict[str, tuple[Checkpoint, int]] = {}
        self._bytes_by_sinks: dict[int, int] = {}
        self._active: list[_Job] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats: dict[str, Any] = {}
        self._published = 0.0
        self.evictions = self.restores = self.refusals = 0
        self.batching, self._batch, self.batch_refusal = batching, None, "off (--no-batch)"
        if cluster is not None:
            self.batching = False
            self.batch_refusal = "off (--distributed: one request at a time, on every rank)"

    # ----- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; measure a session's bytes first and refuse a budget
        that cannot hold the weights and one session."""
        self._thread = threading.Thread(target=self._run, name="mlx-worker", daemon=True)
        self._thread.start()
        self.call(self._make_batch).result()
        sinks = self.settings.cache.sinks
        need = self.call(lambda: self.weights + self.session_bytes(sinks)).result()
        self.call(self._publish).result()
        if need > self.budget:
            self.stop()
            raise UserError(
                f"--memory-budget {self.budget:,} bytes cannot hold the weights "
                f"({self.weights:,}) and one session ({need - self.weights:,}); "
                f"give at least {need:,}"
            )

    def stop(self) -> None:
        """Stop the worker (active requests end without a reply)."""
        self._stopping = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._tmp is not None:
            self._tmp.cleanup()

    def submit(self, request: Request) -> None:
        """Queue a generation request (any thread)."""
        self._queue.put(request)

    def follow(self) -> None:
        """A follower rank: run rank 0's requests until rank 0 stops."""
        self._queue.put(FOLLOW)
        self._thread.join()

    def call(self, fn: Callable[[], Any]):
        """Run ``fn`` on the worker thread; returns a ``concurrent.futures.Future``."""
        from concurrent.futures import Future

        future: Future = Future()
        self._queue.put((fn, future))
        return future

    # ----- the worker -----------------------------------------------------------------

    def _make_batch(self) -> None:
        """The batch every session decodes in, or the reason there is none."""
        from mlx_stream.errors import Unsupported
        from mlx_stream.generate.batch import Batch

        if not self.batching:
            return
        if self.draft_model is not None:
            self.batch_refusal = "a draft model: each request decodes alone, interleaved"
        elif self.settings.cache.kv_bits is not None:
            self.batch_refusal = "quantized KV caches (kv_bits) are not batched"
        else:
            try:
                self._batch, self.batch_refusal = Batch(self.model), None
            except Unsupported as exc:
                self.batch_refusal = str(exc)

    def _steps(self, request: Request, box: list) -> Any:
        """The token source of a batched request (``None``: it decodes alone); its
        row is recorded on the job in ``box`` once made."""
        if self._batch is None:
            return None
        s = self.settings
        return self._batch.tokens(
            drive=self._drive,
            temp=s.temp if request.temp is None else request.temp,
            top_p=s.top_p if request.top_p is None else request.top_p,
            seed=request.seed,
            on_row=lambda row: setattr(box[0], "row", row),
        )

    def _drive(self, row: Any) -> None:
        """One batch round while a newcomer waits for its first token (its prompt
        goes in a chunk per round): the other sessions get their tokens meanwhile."""
        self._batch.step()
        for job in list(self._active):
            if job.row is not None and job.row is not row and job.row.inbox:
                self._advance_safely(job)

    def _run(self) -> None:
        if self.cluster is not None:
            self._run_in_step()
            return
        while not self._stopping:
            try:
                item = self._queue.get(timeout=None if not self._active else 0)
            except queue.Empty:
                item = False
            while item is not False:
                if item is None:
                    return
                self._handle(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = False
            self._round()

    def _run_in_step(self) -> None:
        """The worker of a sharded engine: one request at a time, run to its end,
        taken from the queue (rank 0, which hands it on) or from rank 0 (followers)."""
        from mlx_stream.distributed import is_peer_lost

        cluster = self.cluster
        try:
            while True:
                item = self._queue.get()
                if item is FOLLOW:
                    item = cluster.share_text(None)
                    self._queue.put(FOLLOW)
                    if item is None:
                        return
                    item = Request(emit=lambda event: None, **json.loads(item))
                elif item is None or isinstance(item, Request):
                    wire = None if item is None else {k: getattr(item, k) for k in WIRE}
                    cluster.share_text(None if wire is None else json.dumps(wire))
                    if item is None:
                        return
                self._handle(item)
                while self._active:
                    self._round()
        except Exception as exc:  # noqa: BLE001 - the ranks are out of step: all stop
            import sys

            if not is_peer_lost(exc) or cluster.is_root:  # a follower's own error only
                sys.stderr.write(f"Error: {type(exc).__name__}: {exc}\n")
                sys.stderr.flush()
            getattr(sys.stderr, "report", lambda: None)()  # a follower's held line
            os._exit(1)

    def _fatal(self, exc: Exception) -> bool:
        """Whether ``exc`` ends a sharded server (a rank is gone) rather than a request."""
        from mlx_stream.distributed import is_peer_lost

        return self.cluster is not None and is_peer_lost(exc)

    def _handle(self, item: Any) -> None:
        if isinstance(item, tuple):
            fn, future = item
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            return
        try:
            self._admit(item)
        except Busy as exc:
            self.refusals += 1
            item.emit(("error", 429, str(exc), exc.retry_after))
        except RuntimeFailure as exc:  # the server's fault (a session it could not save)
            item.emit(("error", 500, str(exc), None))
        except UserError as exc:
            item.emit(("error", 400, str(exc), None))
        except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
            if self._fatal(exc):
                raise
            item.emit(("error", 500, f"{type(exc).__name__}: {exc}", None))
        self._publish()

    def _round(self) -> None:
        """One scheduler round: newcomers start (their prefill interleaved with the
        batch), one batched step for every session with decode work, then each request
        takes its tokens; a request that decodes alone advances ``chunk`` tokens."""
        for job in [j for j in self._active if j.batched and j.row is None]:
            self._advance_safely(job)
        if self._batch is not None and self._batch.busy:
            self._batch.step()
        for job in list(self._active):
            if job in self._active and not job.running:
                self._advance_safely(job)
        if self._active and time.monotonic() - self._published > PUBLISH_EVERY:
            self._publish()

    def _advance_safely(self, job: _Job) -> None:
        try:
            self._advance(job)
        except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
            if self._fatal(exc):
                raise
            job.running = False
            self._end(job, rollback=True)
            job.request.emit(("error", 500, f"{type(exc).__name__}: {exc}", None))

    def _advance(self, job: _Job) -> None:
        """Emit up to ``chunk`` tokens of ``job`` (a batched one: the tokens its row
        has ready, or its first token)."""
        job.running, ending = True, False
        for i in range(self.chunk if not job.batched else 1 << 30):
            if self._cancelled(job, i == 0):
                job.running = False
                self._end(job, rollback=True)
                return
            if job.batched and job.row is not None and not job.row.inbox and not ending:
                break  # its next token comes with the next batch step
            response = next(job.tokens, None)
            if response is None:
                job.running = False
                self._finish(job)
                return
            ending = response.finish_reason is not None
            logprob = None
            top = job.request.logprobs
            if top is not None and not (ending and response.token in self._eos):
                logprob = self._logprobs.entry(response.token, response.logprobs, top)
            if response.text or logprob is not None:
                job.request.emit(("text", response.text, logprob))
        job.running = False

    def _cancelled(self, job: _Job, first: bool) -> bool:
        """Whether the request was cancelled; sharded: rank 0's answer, asked at the
        start of each chunk (a collective per token would stall the decode)."""
        if self.cluster is None:
            return job.request.cancelled.is_set()
        return first and bool(self.cluster.share_int(int(job.request.cancelled.is_set())))

    def _new_id(self, n: int) -> str:
        """A fresh ``n``-hex-digit id (the same on every rank of a cluster)."""
        if self._ids is None:
            return uuid.uuid4().hex[:n]
        return f"{self._ids.getrandbits(4 * n):0{n}x}"

    def _finish(self, job: _Job) -> None:
        entry = job.entry
        session = entry.session
        reply = session.last
        finish = reply.finish_reason if reply is not None else None
        self._end(job, rollback=False)
        sinks, window = session.sinks, session.settings.cache.window
        seen = cache_count(session.caches)
        prompt = reply.prompt_tokens if reply is not None else 0
        usage = {
            "prompt_tokens": job.cached + prompt,
            "completion_tokens": reply.tokens if reply is not None else 0,
            "total_tokens": job.cached + prompt + (reply.tokens if reply is not None else 0),
            "prompt_tokens_details": {"cached_tokens": job.cached},
            "evicted_tokens": max(0, seen - sinks - window),
        }
        self._publish()
        job.request.emit(("end", usage, finish or "stop"))

    def _end(self, job: _Job, rollback: bool) -> None:
        """Close the request's generator; on ``rollback`` its session goes back to the
        checkpoint from before the turn."""
        if job in self._active:
            self._active.remove(job)
        job.tokens.close()
        entry = job.entry
        entry.busy = False
        entry.last_used = time.monotonic()
        if entry.transient:
            self._drop(entry)
            return
        if rollback and entry.checkpoint is not None:
            entry.session.restore(entry.checkpoint)
        entry.messages = [dict(m) for m in entry.session.messages]
        entry.tokens_seen = cache_count(entry.session.caches)
        if rollback:
            self._publish()

    # ----- admission --------------------------------------------------------------------

    def session_bytes(self, sinks: int) -> int:
        """Bytes of one resident session with ``sinks`` sinks: its caches and its
        checkpoint, measured once from real caches (after their one allocation)."""
        if sinks not in self._bytes_by_sinks:
            import mlx.core as mx

            policy = self.settings.cache.replace(sinks=sinks)
            settings = dataclasses.replace(self.settings, cache=policy)
            probe = ChatSession(
                self.model, self.tokenizer, settings, draft_model=self.draft_model
            )  # fmt: skip
            probe.prefill(self.tokenizer.decode([0]) or " ")
            mx.eval([c.state for c in probe.caches])
            cache = sum(int(getattr(c, "nbytes", 0) or 0) for c in probe.caches)
            self._bytes_by_sinks[sinks] = 2 * cache
        return self._bytes_by_sinks[sinks]

    def used_bytes(self) -> int:
        """Weights + snapshots + resident sessions."""
        snaps = sum(b for _, b in self.snapshots.values())
        return self.weights + snaps + sum(e.bytes for e in self.entries.values() if e.session)

    def _make_room(self, need: int, keep: Entry) -> None:
        """Evict idle sessions (least recently used first) until ``need`` more bytes
        fit the budget and the session count; :class:`Busy` when none is left."""
        while True:
            resident = [e for e in self.entries.values() if e.session is not None]
            over_count = self.max_sessions is not None and len(resident) >= self.max_sessions
            if not over_count and self.used_bytes() + need <= self.budget:
                return
            idle = [e for e in resident if not e.busy and e is not keep]
            if not idle:
                raise Busy(
                    f"no memory for another session: {len(resident)} sessions are busy "
                    f"({self.used_bytes():,} of {self.budget:,} bytes); retry shortly"
                )
            self._evict(min(idle, key=lambda e: e.last_used))

    def _evict(self, entry: Entry) -> None:
        """Save a resident session to disk and free its memory."""
        # The id may come from the client (X-Session-ID): the file is named by its hash,
        # so no id reads as a path out of the state folder.
        name = f"{entry.owner}\0{entry.id}".encode()
        path = self.state_dir / ("session-" + hashlib.sha256(name).hexdigest()[:32])
        entry.session.save(path)
        entry.path, entry.session, entry.checkpoint = path, None, None
        self.evictions += 1
        stored = [e for e in self.entries.values() if e.session is None]
        if len(stored) > MAX_STORED:
            self._drop(min(stored, key=lambda e: e.last_used))

    def _drop(self, entry: Entry) -> None:
        self.entries.pop(entry.key, None)
        if entry.path is not None:
            for suffix in (".safetensors", ".json", ".draft.safetensors"):
                with contextlib.suppress(OSError):
                    entry.path.with_name(entry.path.name + suffix).unlink()

    def _new_session(self, system: str | None) -> ChatSession:
        """A session for ``system`` whose caches are not allocated yet."""
        settings = dataclasses.replace(self.settings, keep_system=self.keep_system)
        try:
            session = ChatSession(
                self.model, self.tokenizer, settings, system=system, draft_model=self.draft_model
            )
        except UserError:  # keep_system without any system prompt: plain sinks
            settings.keep_system = False
            session = ChatSession(
                self.model, self.tokenizer, settings, system=system, draft_model=self.draft_model
            )
        if session.sinks > settings.cache.window:
            raise BadRequest(
                f"the system prompt has {session.sinks} tokens; the server pins at most "
                f"--window ({settings.cache.window}) tokens of it"
            )
        return session

    def _from_snapshot(self, session: ChatSession, keep: Entry) -> None:
        """Start ``session`` from its system prompt's shared prefilled snapshot (made,
        and admitted by bytes, on first use)."""
        head = session.system_text() if session.settings.keep_system else ""
        if not head:
            return
        snap = self.snapshots.pop(head, None)
        if snap is None:
            size = self.session_bytes(session.sinks) // 2
            self._make_room(size, keep)
            session.prefill(head)
            snap = (session.checkpoint(), size)
        else:
            session.restore(snap[0])
        self.snapshots[head] = snap  # most recently used last
        while len(self.snapshots) > MAX_SNAPSHOTS:
            self.snapshots.pop(next(iter(self.snapshots)))

    def _resident(self, entry: Entry) -> None:
        """Make ``entry`` resident: admitted by bytes, then loaded from disk or new."""
        if entry.session is not None:
            return
        session = self._new_session(entry.system)
        need = self.session_bytes(session.sinks)
        self._make_room(need, entry)
        if entry.path is not None:
            session.load(entry.path)
            self.restores += 1
        else:
            self._from_snapshot(session, entry)
        entry.session, entry.bytes, entry.sinks = session, need, session.sinks

    # ----- requests -------------------------------------------------------------------

    def _admit(self, request: Request) -> None:
        if request.messages is None:
            self._admit_completion(request)
            return
        system, history, user = split_messages(request.messages)
        entry, mode, source = self._find(request, system, history)
        try:
            self._resident(entry)
        except BaseException:
            if entry.session is None and entry.path is None:  # refused before it began
                self._drop(entry)
            raise
        session, tail = entry.session, None
        if mode == "restore":  # the checkpoint encodes exactly ``history``
            session.restore(source.checkpoint)
            entry.checkpoint = source.checkpoint
        elif mode == "rebuild":
            self._rebuild(entry, system, history)
            session = entry.session
            tail = self.settings.cache.window if history else None
        else:
            entry.checkpoint = session.checkpoint()
        entry.messages = [dict(m) for m in session.messages]  # true even if the start fails
        cached = cache_count(session.caches)
        box: list = []
        tokens = session.stream(
            user, tail=tail, max_tokens=request.max_tokens, temp=request.temp,
            top_p=request.top_p, stop=request.stop, seed=request.seed,
            steps=self._steps(request, box),
        )  # fmt: skip
        box.append(self._start(request, entry, tokens, cached, batched=self._batch is not None))

    def _rebuild(self, entry: Entry, system: str | None, history: list[dict]) -> None:
        """Start ``entry`` over from its system prompt's snapshot with ``history`` as
        its transcript (the next turn feeds the tail of it that fits the window)."""
        session = self._new_session(system)
        need = self.session_bytes(session.sinks)
        if need > entry.bytes:
            self._make_room(need - entry.bytes, entry)
        self._from_snapshot(session, entry)
        session.messages = [dict(m) for m in history]
        entry.session, entry.bytes, entry.sinks, entry.system = session, need, session.sinks, system
        entry.checkpoint = session.checkpoint()

    def _find(self, request: Request, system: str | None, history: list) -> tuple:
        """``(entry, mode, source)`` for a chat request, among its owner's sessions only.

        ``append``: the entry's transcript is the history. ``restore``: ``source``'s
        checkpoint encodes exactly the history (an edit or a regeneration of the last
        turn); with the session's own id it restores in place, without one it forks a new
        session and the original stays for its owner. ``rebuild``: from the history alone
        (an id whose transcript does not match, or a history no session holds). ``new``:
        no history. Without an id, only a history that is not empty is matched, and only
        when the server is not ``isolate``-d.
        """
        owner, session_id = request.owner, request.session_id
        if session_id is not None:
            entry = self.entries.get((owner, session_id))
            if entry is None:
                entry = self._add(Entry(id=session_id, system=system, owner=owner))
                return entry, "rebuild" if history else "new", None
            if entry.busy:
                raise Busy(f"session {entry.id} is answering another request; retry shortly")
            if entry.system == system and entry.messages == history:
                return entry, "append", None
            if self._restorable(entry, system, history):
                return entry, "restore", entry
            return entry, "rebuild", None
        if history and not self.isolate:
            mine = [
                e for e in self.entries.values()
                if e.owner == owner and not e.busy and not e.transient
            ]  # fmt: skip
            mine.sort(key=lambda e: -e.last_used)
            for entry in mine:
                if entry.system == system and entry.messages == history:
                    return entry, "append", None
            for entry in mine:
                if self._restorable(entry, system, history):
                    fork = self._add(Entry(id=self._new_id(16), system=system, owner=owner))
                    return fork, "restore", entry
        entry = self._add(Entry(id=self._new_id(16), system=system, owner=owner))
        return entry, "rebuild" if history else "new", None

    @staticmethod
    def _restorable(entry: Entry, system: str | None, history: list) -> bool:
        """Whether ``entry``'s checkpoint encodes exactly ``system`` + ``history``."""
        cp = entry.checkpoint
        return (
            entry.session is not None
            and cp is not None
            and cp.system == system
            and cp.messages == history
        )

    def _add(self, entry: Entry) -> Entry:
        self.entries[entry.key] = entry
        return entry

    def _admit_completion(self, request: Request) -> None:
        entry = Entry(
            id="completion-" + self._new_id(12), system=None, transient=True, owner=request.owner
        )
        self._add(entry)
        try:
            self._make_room(self.session_bytes(self.settings.cache.sinks) // 2, entry)
            settings = dataclasses.replace(self.settings, keep_system=False)
            session = ChatSession(
                self.model, self.tokenizer, settings, draft_model=self.draft_model
            )
        except BaseException:
            self._drop(entry)
            raise
        entry.session, entry.bytes = session, self.session_bytes(session.sinks) // 2
        tokens = list(self.tokenizer.encode(clean_text(request.prompt or "")))
        if not tokens:
            self._drop(entry)
            raise BadRequest("prompt: must not be empty")
        box: list = []
        generator = self._completion(session, tokens, request, self._steps(request, box))
        box.append(self._start(request, entry, generator, 0, batched=self._batch is not None))

    @staticmethod
    def _completion(
        session: ChatSession, tokens: list[int], request: Request, steps: Any = None
    ) -> Iterator[Any]:
        """A plain completion of ``tokens`` on ``session``'s caches; sets ``session.last``."""
        generator = session.generate(
            tokens, max_tokens=request.max_tokens, temp=request.temp, top_p=request.top_p,
            stop=request.stop, seed=request.seed, steps=steps,
        )  # fmt: skip
        last, generated = None, 0
        try:
            for last in generator:
                generated += 1
                yield last
        finally:
            generator.close()
            session.last = Reply(
                text="",
                tokens=generated,
                tps=float(getattr(last, "generation_tps", 0.0) or 0.0),
                prompt_tokens=len(tokens),
                finish_reason=getattr(last, "finish_reason", None),
            )

    def _start(
        self, request: Request, entry: Entry, tokens: Iterator[Any], cached: int, batched: bool
    ) -> _Job:
        entry.busy = True
        entry.last_used = time.monotonic()
        job = _Job(request, entry, tokens, cached, batched=batched)
        self._active.append(job)
        request.emit(("start", {"session_id": None if entry.transient else entry.id}))
        return job

    # ----- inspection -------------------------------------------------------------------

    def _publish(self) -> None:
        """Refresh :attr:`stats` (read by other threads without locking)."""
        import mlx.core as mx

        now = self._published = time.monotonic()
        sessions = []
        for e in self.entries.values():
            if e.transient:
                continue
            seen = cache_count(e.session.caches) if e.session else e.tokens_seen
            window = self.settings.cache.window
            sessions.append(
                {
                    "id": e.id,
                    "owner": e.owner,
                    "resident": e.session is not None,
                    "turns": len(e.messages) // 2,
                    "tokens_seen": seen,
                    "tokens_evicted": max(0, seen - e.sinks - window),
                    "sinks": e.sinks,
                    "window": window,
                    "cache": self.settings.cache_spec(e.sinks).to_json(),
                    "cache_bytes": e.bytes if e.session else 0,
                    "idle_s": round(now - e.last_used, 3),
                    "busy": e.busy,
                }
            )
        self.stats = {
            "sessions": sessions,
            "memory": {
                "budget_bytes": self.budget,
                "used_bytes": self.used_bytes(),
                "weights_bytes": self.weights,
                "session_bytes": self._bytes_by_sinks.get(self.settings.cache.sinks),
                "snapshots": len(self.snapshots),
                "mlx_active_bytes": mx.get_active_memory(),
                "mlx_cache_bytes": mx.get_cache_memory(),
            },
            "batch": {
                "enabled": self._batch is not None,
                "reason": self.batch_refusal,
                "rows": len(self._batch.rows) if self._batch is not None else 0,
                "steps": self._batch.steps if self._batch is not None else 0,
            },
            "counters": {
                "evictions": self.evictions,
                "restores": self.restores,
                "refusals": self.refusals,
                "active": len(self._active),
            },
        }


def split_messages(messages: list[dict[str, str]]) -> tuple[str | None, list[dict], str]:
    """``(system, history, user)`` of a chat request: a leading system message, the
    turns before the last, and the last (a user message). Text is decoded leniently."""
    messages = [{"role": m["role"], "content": clean_text(m["content"])} for m in messages]
    if not messages:
        raise BadRequest("messages: must hold at least one message")
    system = None
    if messages[0]["role"] in ("system", "developer"):
        system = messages[0]["content"]
        messages = messages[1:]
    if not messages or messages[-1]["role"] != "user":
        raise BadRequest("messages: the last message must be from the user")
    return system, messages[:-1], messages[-1]["content"]
