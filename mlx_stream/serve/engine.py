"""The engine of ``mlx-stream serve``: chat sessions in fixed memory, admitted by bytes,
all model work on one MLX thread.

Contract:
- Every session is a :class:`~mlx_stream.generate.session.ChatSession` whose SinkCaches have a
  fixed size, so a session costs a known number of bytes (its caches plus the
  checkpoint taken before its current turn, measured from real caches). Admission:
  ``weights + snapshots + resident sessions x bytes <= budget``. A session that does
  not fit evicts the least recently used idle session to disk (``save_cache``) or
  shared snapshot (never one in use; room is made for a session and its snapshot
  together, so the sum never exceeds the budget); it comes back on its next request.
  When nothing can be evicted the request is refused (:class:`Busy`: HTTP 429 with
  ``Retry-After``, only while a session is busy), never an out-of-memory.
- The state folder: each saved session is listed in ``index.json`` (written
  atomically, with the sha256 of its files), so a restart finds it again; files the
  index does not name are removed at start; a lost or corrupt file means the session
  is rebuilt from the client's history; a folder that cannot be written refuses the
  request that needed the room (:class:`Unsaved`: 507) and the session stays.
  :meth:`Engine.drain` (SIGTERM) ends every request and saves every resident session.
- A session's caches always encode exactly the transcript it records, after every
  ending (complete, stop, cancel, disconnect, error, eviction, restore); its checkpoint
  encodes the transcript one turn shorter and is restored only for that transcript.
  Sessions belong to an owner (a hash of the caller's API key; one owner without keys)
  and a request only ever sees its owner's sessions. A request names its session
  (``X-Session-ID``) or is matched on its transcript: one whose messages extend a
  session's transcript by one user message feeds only that message; one that replaces
  the last turn (an edit or a regeneration) restores the checkpoint from before it, in
  place with the session's id, as a new session (a fork) without one; anything else is
  repaired in place where ``repair_tokens`` is set and the conversation fits in the
  window (an edit in the middle: :mod:`~mlx_stream.generate.repair`; without an id, a
  copy of the closest session is), else rebuilt from the pinned system prompt plus the
  tail that fits the window. A request
  without an id never takes over a session whose transcript it does not extend
  (``isolate``: it is never matched at all). A wrapped ring matches no token prefix, so
  matching is on the transcript, never on the KV cache.
- Pinned system prompt (``keep_system``): the rendered system prompt is the session's
  sinks; sessions with the same system prompt start from one prefilled snapshot. A
  prefix store on disk (``prefix_store``, :mod:`mlx_stream.prefix_store`) holds that
  state across processes: a system prompt with no snapshot yet is read from it when
  there (never another model's, dtype's or policy's entry), else prefilled and put.
- One worker thread runs every MLX call, fed by a queue. Each scheduler round, every
  session with decode work steps together in ONE batched model call
  (:class:`~mlx_stream.generate.batch.Batch`: one row per session, each in its own fixed-size
  cache, its own sampling parameters and stop strings); a newcomer's prompt is
  prefilled a chunk per round meanwhile (batched or not: token sources are polled),
  so running sessions keep streaming and new requests are admitted; a prompt over
  ``max_prompt_tokens`` is refused before any prefill (:class:`TooLarge`: 413). Where
  batching is refused (a draft model, quantized KV, a model whose batched step is not
  exact: the reason is in the stats), each round advances every request by at most
  ``chunk`` tokens instead (fair interleaving: no request waits for another's long
  reply). A cancelled request (a client that went away) stops at the next token or
  prefill chunk and its session goes back to the checkpoint from before the turn.
- Recall (``settings.cache.recall``, ``serve --recall``): every session's caches get
  their own recall tier and store (:mod:`~mlx_stream.serve.recall`: a folder per
  session, rewound with its checkpoints); such sessions decode alone, interleaved
  (recall serves one sequence per cache), start from no shared snapshot, and a fork
  is rebuilt from the client's history. Admission counts a recall session's caches,
  checkpoint, region and store host-memory cap. An evicted recall session's store
  goes to the state folder with it (``session.save``: a ``.recall/`` folder beside
  its cache file); a session whose save fails with a ``UserError`` is not written
  there when room is needed: its caches are dropped (counted in ``dropped``) and its
  next request rebuilds it from the client's history.

Parts, one concern each: :mod:`~mlx_stream.serve.admission` (the byte budget: what a
session and a snapshot cost, what to evict), :mod:`~mlx_stream.serve.store` (the state
folder), :mod:`~mlx_stream.serve.matching` (which session a request continues, and
how), :mod:`~mlx_stream.serve.refusals` (the errors a request is refused with). This
module composes them: the worker thread, its scheduler and the sessions' lifecycle;
it re-exports the names the HTTP side imports (:class:`Entry`, :func:`split_messages`,
the refusals).

The HTTP side (:mod:`mlx_stream.serve.app`) only translates requests into :class:`Request`
objects and events back into responses.

Sharded (``cluster``: ``serve --distributed``): rank 0 owns HTTP; its worker takes one
request at a time, hands it to the other ranks (:meth:`Engine.follow`) with MLX's
collectives and runs it to its end in step with them; batching is off. The ranks agree
on session ids and on a cancelled request (once per ``chunk`` of tokens), so every
rank's sessions stay the same.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_stream.defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PIN_TOKENS
from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.generate.session import (
    ChatSession,
    Checkpoint,
    Reply,
    Settings,
    cache_count,
    clean_text,
)
from mlx_stream.serve import matching
from mlx_stream.serve import recall as recalled
from mlx_stream.serve.admission import Admission, weights_bytes
from mlx_stream.serve.logprobs import TokenLogprobs
from mlx_stream.serve.matching import Entry, split_messages
from mlx_stream.serve.refusals import (
    DEFAULT_RETRY_AFTER,  # noqa: F401 - re-exported
    BadRequest,
    Busy,
    TooLarge,
    Unsaved,
)
from mlx_stream.serve.store import MAX_STORED, SessionStore

DEFAULT_CHUNK = 8  # tokens a request advances per scheduler round
PUBLISH_EVERY = 0.25  # seconds between refreshes of the stats while requests run


@dataclass
class Request:
    """One generation request, built by the HTTP side.

    ``messages`` (chat) or ``prompt`` (plain completion). ``owner`` names the caller's
    namespace of sessions (a hash of its API key; ``""`` without keys): a request only
    ever sees and continues sessions of its own owner. Events reach ``emit`` from the
    worker thread: ``("start", info)``, ``("text", str, logprob)`` per segment (the
    token's entry from :class:`~mlx_stream.serve.logprobs.TokenLogprobs` when ``logprobs``
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
    # Agents (mlx_stream.serve): OpenAI's sampling fields, a grammar the reply must
    # match (llguidance), tools and tool_choice; a tool call reaches ``emit`` as
    # ("tool_call", index, call) and ends the reply with finish_reason "tool_calls".
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    grammar: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    top_k: int | None = None
    matched_stop: str | None = None  # set by the engine: the stop string that ended it
    progress: bool = False  # also emit ("prefill", done, total) while its prompt goes in
    cancelled: threading.Event = field(default_factory=threading.Event)


WIRE = ("messages", "prompt", "session_id", "max_tokens", "temp", "top_p", "stop", "seed",
        "logprobs", "owner", "logit_bias", "presence_penalty", "frequency_penalty", "grammar",
        "tools", "tool_choice", "top_k")  # fmt: skip
FOLLOW = "follow"  # a follower's worker: take requests from rank 0 from now on


@dataclass
class _Job:
    request: Request
    entry: Entry
    tokens: Iterator[Any]
    cached: int
    started: float = field(default_factory=time.perf_counter)
    batched: bool = False
    row: Any = None  # its mlx_stream.generate.batch.Row, once its first token was asked for
    running: bool = False  # inside next(tokens): never re-entered
    sent: int = 0  # tokens its consumer got
    prompt: int = 0  # tokens its turn feeds
    head: int = 0  # of those, the system prompt's, fed before the turn (_head_first)
    fed: int = 0  # of those, about how many went in (a prefill chunk per poll)
    repaired: Any = None  # the generate.repair.Repaired of an edit repaired first


class Engine:
    """Sessions and the one MLX worker thread that runs them, admitted by bytes
    (:class:`~mlx_stream.serve.admission.Admission`), saved to the state folder
    (:class:`~mlx_stream.serve.store.SessionStore`).

    Args:
        model, tokenizer: The loaded model.
        settings (Settings): Session defaults (sinks, window, kv bits, max tokens...).
        model_id (str): The name the API serves the model under.
        draft_model: A draft model for speculative decoding.
        keep_system (bool): Make the rendered system prompt the sinks. Default: True.
        budget (int, optional): Memory budget in bytes. Default: 75% of the machine.
        max_sessions (int, optional): Most resident sessions. Default: no limit.
        state_dir (Path, optional): Where evicted sessions go, listed in its
            ``index.json`` (a restart with the same folder finds them again).
            Default: a temp folder.
        max_prompt_tokens (int): Most tokens one request may feed (HTTP 413 over it).
        pin (int, optional): Most tokens of a rendered system prompt kept as sinks
            (``keep_system``); the rest of it flows through the window. Default:
            ``DEFAULT_PIN_TOKENS`` or the window if smaller.
        max_tokens_ceiling (int, optional): The operator's cap on any request's
            ``max_tokens``. Default: none (a request's own value is served).
        chunk (int): Tokens a request advances per scheduler round when not batched.
        batching (bool): Decode sessions together in one batched call per round.
            Default: True (refused, with the reason in the stats, where inexact).
        cluster (distributed.Cluster, optional): The ranks a sharded model runs on.
        isolate (bool): Never match a request without ``X-Session-ID`` to a session
            (each starts its own). Default: False (a request that extends one of its
            owner's transcripts continues that session).
        prefix_store (PrefixStore, optional): The prefix store on disk
            (:mod:`mlx_stream.prefix_store`): a system prompt with no shared snapshot
            yet is looked up there before it is prefilled, and put there after (so a
            restarted server, ``chat`` or another server start from it). Default: none.
        sampling (Sampling): What a request that gives no temperature samples with
            (:func:`mlx_stream.serve.sampling.resolve`). Default: greedy.
        repair_tokens (int): Tokens after an edit in the middle of a transcript computed
            again (:mod:`~mlx_stream.generate.repair`); 0: such a request is rebuilt.
            Default: 0.
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
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        pin: int | None = None,
        max_tokens_ceiling: int | None = None,
        prefix_store: Any = None,
        sampling: Any = None,
        repair_tokens: int = 0,
    ):
        from mlx_stream.generate.model_config import Sampling

        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.sampling = sampling if sampling is not None else Sampling()  # greedy
        self.prefixes, self.repair_tokens = prefix_store, repair_tokens
        self.max_prompt_tokens, self.max_tokens_ceiling = max_prompt_tokens, max_tokens_ceiling
        self.pin = min(DEFAULT_PIN_TOKENS, settings.cache.window) if pin is None else pin
        self._closing = False  # draining: requests are refused (503)
        self._logprobs = TokenLogprobs(tokenizer)
        self._grammars, self._vocab = None, None
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ()) | set(settings.stop_tokens)
        self.cluster, self._ids = cluster, None
        if cluster is not None:
            self._ids = random.Random(cluster.share_int(random.getrandbits(62)))
            if state_dir is not None:  # ranks on one machine must not share files
                state_dir = Path(state_dir) / f"rank-{cluster.rank}"
                state_dir.mkdir(exist_ok=True)
        self.settings, self.model_id, self.keep_system = settings, model_id, keep_system
        weights = weights_bytes(model) + (weights_bytes(draft_model) if draft_model else 0)
        self.chunk, self.isolate = chunk, isolate
        self.recall = settings.cache.recall  # a RecallSpec: each session its own store
        recalled.remove_stale(self.recall)
        self.store = SessionStore(state_dir, self._config)
        self.entries: dict[tuple[str, str], Entry] = {}  # by (owner, id)
        self.admission = Admission(
            self.entries, weights, budget, max_sessions, measure=self._measure, evict=self._evict,
            fixed=lambda sinks: recalled.fixed_bytes(model, self.recall, sinks),
        )  # fmt: skip
        self._dropped: set[tuple[str, str]] = set()  # caches dropped: rebuilt on next use
        self._active: list[_Job] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats: dict[str, Any] = {}
        self._published = 0.0
        self.evictions = self.restores = self.refusals = self.dropped = 0
        self.batching, self._batch, self.batch_refusal = batching, None, "off (--no-batch)"
        if cluster is not None:
            self.batching = False
            self.batch_refusal = "off (--distributed: one request at a time, on every rank)"

    # ----- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; measure a session's bytes first and refuse a budget
        that cannot hold the weights and one session. Sessions the state folder's
        index lists (and whose files are intact) are found again."""
        for entry in self.store.load(discard=self.cluster is not None):
            self.entries[entry.key] = entry  # on disk: loaded on its next request
        self._thread = threading.Thread(target=self._run, name="mlx-worker", daemon=True)
        self._thread.start()
        self.call(self._make_batch).result()
        sinks = self.settings.cache.sinks
        need = self.call(lambda: self.weights + self.session_bytes(sinks)).result()
        self.call(self._publish).result()
        if need > self.budget:
            self.stop()
            ram = " (--recall-ram counts for each session)" if self.recall is not None else ""
            raise UserError(
                f"--memory-budget {self.budget:,} bytes cannot hold the weights "
                f"({self.weights:,}) and one session ({need - self.weights:,}{ram}); "
                f"give at least {need:,}"
            )

    def stop(self) -> None:
        """Drain (see :meth:`drain`), then stop the worker."""
        self._closing = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._stopping = True
        for entry in self.entries.values():  # the worker is gone: their stores close
            recalled.release(entry.session)
        self.store.cleanup()

    def drain(self) -> None:
        """Stop taking requests (503 from now on) and end the running ones at the
        worker's next round (a stream gets its end, cut short); :meth:`stop` then
        saves the resident sessions. Any thread, a signal handler included: it only
        sets a flag (a lock taken here could be held by the code it interrupted)."""
        self._closing = True

    def submit(self, request: Request) -> None:
        """Queue a generation request (any thread)."""
        if self._closing:
            request.emit(("error", 503, "the server is shutting down", None))
            return
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
        elif self.recall is not None:
            self.batch_refusal = "--recall: each session keeps its own store and decodes alone"
        else:
            try:
                self._batch, self.batch_refusal = Batch(self.model), None
            except Unsupported as exc:
                self.batch_refusal = str(exc)

    def _steps(self, request: Request, box: list) -> Any:
        """The token source of a request, polled: it yields ``None`` while its prompt
        goes in (a chunk per round, between the other requests' tokens and the
        newcomers' admission). Batched, its row is recorded on the job in ``box``."""
        if self._batch is None:
            from mlx_stream.generate.batch import DEFAULT_PREFILL_CHUNK
            from mlx_stream.generate.decode import generate_step

            def alone(*args: Any, **kw: Any) -> Any:  # prefilled in a batch's chunks
                return generate_step(
                    *args, **{**kw, "prefill_step_size": DEFAULT_PREFILL_CHUNK, "poll": True}
                )

            return alone
        source = self._batch.tokens(  # the request's sampling, resolved by _agents
            temp=request.temp,
            top_p=request.top_p,
            seed=request.seed,
            on_row=lambda row: setattr(box[0], "row", row),
        )
        return functools.partial(source, poll=True)

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
                    self._drain()
                    self._quiesce()
                    return
                self._handle(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = False
            if self._closing:
                self._end_all()
            self._round()

    def _quiesce(self) -> None:
        """Finish MLX's work queued from this thread: the process may exit next, and
        MLX aborts ("terminate called") when an exit finds a worker's evaluation
        still running."""
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        self._batch = None
        mx.synchronize(generation_stream)
        mx.synchronize()
        mx.clear_streams()  # MLX's cleanup for a thread that used it, before it ends

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
                        self._quiesce()
                        return
                    item = Request(emit=lambda event: None, **json.loads(item))
                elif item is None or isinstance(item, Request):
                    wire = None if item is None else {k: getattr(item, k) for k in WIRE}
                    cluster.share_text(None if wire is None else json.dumps(wire))
                    if item is None:
                        self._quiesce()
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
        if self._closing:
            item.emit(("error", 503, "the server is shutting down", None))
            return
        try:
            self._bound(item)
            self._admit(item)
        except Busy as exc:
            self.refusals += 1
            item.emit(("error", 429, str(exc), exc.retry_after))
        except Unsaved as exc:  # the state folder is full: only this request is refused
            item.emit(("error", 507, str(exc), None))
        except RuntimeFailure as exc:  # the server's fault (a session it could not save)
            item.emit(("error", 500, str(exc), None))
        except TooLarge as exc:
            item.emit(("error", 413, str(exc), None))
        except UserError as exc:
            item.emit(("error", 400, str(exc), None))
        except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
            if self._fatal(exc):
                raise
            item.emit(("error", 500, f"{type(exc).__name__}: {exc}", None))
        self._publish()

    def _bound(self, request: Request) -> None:
        """The request's ``max_tokens``: its own, else the server's default, never over
        the operator's ``max_tokens_ceiling``; :class:`TooLarge` for a new message
        over ``max_prompt_tokens``, counted before any matching or prefill (what a
        turn feeds in all, its history included, is checked once it is matched)."""
        if request.max_tokens is None or request.max_tokens <= 0:
            request.max_tokens = self.settings.max_tokens
        ceiling = self.max_tokens_ceiling
        if ceiling is not None and request.max_tokens > ceiling:
            request.max_tokens = ceiling
        if request.messages is not None:
            text = request.messages[-1].get("content", "") if request.messages else ""
        else:
            text = request.prompt or ""
        given = self._count(clean_text(text))
        if given > self.max_prompt_tokens:
            raise TooLarge(
                f"the prompt has {given:,} tokens; this server takes at most "
                f"{self.max_prompt_tokens:,} per request (--max-prompt-tokens)"
            )

    def _count(self, text: str) -> int:
        """Tokens of ``text``; with a fast tokenizer's Rust core (which keeps no
        per-call state and lets go of the GIL), from any thread."""
        core = getattr(getattr(self.tokenizer, "_tokenizer", None), "backend_tokenizer", None)
        if core is not None:
            return len(core.encode(text, add_special_tokens=False).ids)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def precheck(self, request: Request) -> None:
        """The worker's size check, run by the HTTP side on its own thread before the
        request is queued (a 4 MB prompt takes seconds to count: the worker serves
        the others meanwhile); :class:`TooLarge` over the limit. Without a fast
        tokenizer (not safe off the worker) the worker alone checks."""
        if getattr(getattr(self.tokenizer, "_tokenizer", None), "backend_tokenizer", None):
            try:
                self._bound(request)
            except TooLarge:
                raise
            except Exception:  # noqa: BLE001 - the worker checks again and says why
                pass

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
        has ready, or its first token); one prefill chunk of a prompt still going in."""
        job.running, ending = True, False
        for i in range(self.chunk if not job.batched else 1 << 30):
            if self._cancelled(job, i == 0):
                job.running = False
                self._end(job, rollback=True)
                return
            if job.batched and job.row is not None and not job.row.inbox and not ending:
                break  # its next token comes with the next batch step
            try:
                response = next(job.tokens)
            except StopIteration:
                job.running = False
                self._finish(job)
                return
            if response is None:  # a prefill chunk went in: the others' turn
                from mlx_stream.generate.batch import DEFAULT_PREFILL_CHUNK

                job.fed = min(job.prompt, job.fed + DEFAULT_PREFILL_CHUNK)
                if job.request.progress:
                    job.request.emit(("prefill", job.fed, job.prompt))
                break
            job.sent += 1
            ending = response.finish_reason is not None
            if ending and getattr(response, "stop_string", None):
                job.request.matched_stop = response.stop_string
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

    def _finish(self, job: _Job, cut: bool = False) -> None:
        entry = job.entry
        session = entry.session
        reply = session.last
        finish = "length" if cut else reply.finish_reason if reply is not None else None
        if hasattr(job.request.emit, "settle"):  # a reply that called tools: its transcript
            job.request.emit.settle(session)
        self._end(job, rollback=False)
        sinks, window = session.sinks, session.settings.cache.window
        seen = cache_count(session.caches)
        prompt = (reply.prompt_tokens if reply is not None else 0) + job.head
        usage = {
            "prompt_tokens": job.cached + prompt,
            "completion_tokens": reply.tokens if reply is not None else 0,
            "total_tokens": job.cached + prompt + (reply.tokens if reply is not None else 0),
            "prompt_tokens_details": {"cached_tokens": job.cached},
            "evicted_tokens": max(0, seen - sinks - window),
        }
        if job.repaired is not None:  # tokens the edit's repair computed again or kept
            usage["prompt_tokens_details"]["cached_tokens"] -= job.repaired.recomputed
            usage["repaired_tokens"] = job.repaired.recomputed
            usage["reused_tokens"] = job.repaired.reused
        self._publish()
        job.request.emit(("end", usage, finish or "stop"))

    def _drain(self) -> None:
        """End every running request (:meth:`_end_all`), then save every resident
        session to the state folder."""
        self._end_all()
        if self.store.temporary or self.cluster is not None:
            return  # a temporary folder outlives nothing; ranks save only in step
        for entry in [e for e in self.entries.values() if e.session and not e.transient]:
            try:
                self._evict(entry, drop=False)
            except (UserError, Unsaved) as exc:  # UserError: a session save refused
                import sys

                sys.stderr.write(f"Error: session {entry.id} not saved: {exc}\n")

    def _end_all(self) -> None:
        """End every running request: one that has sent tokens keeps its reply so far
        (its stream ends with ``length``), one still prefilling goes back to its
        checkpoint (503); queued ones are refused as they come."""
        self._closing = True
        for job in list(self._active):
            if job.sent:
                job.tokens.close()  # the reply so far joins the transcript and cache
                self._finish(job, cut=True)
            else:
                self._end(job, rollback=True)
                job.request.emit(("error", 503, "the server is shutting down", None))

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
            entry.session.restore(entry.checkpoint)  # its recall tier too
        entry.messages = [dict(m) for m in entry.session.messages]
        entry.tokens_seen = cache_count(entry.session.caches)
        if rollback:
            self._publish()

    # ----- admission --------------------------------------------------------------------

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

    def _measure(self, sinks: int) -> int:
        """Bytes of one session's caches with ``sinks`` sinks, from real caches (after
        their one allocation)."""
        import mlx.core as mx

        settings = self._settings(sinks=sinks)
        probe = ChatSession(
            self.model, self.tokenizer, settings, draft_model=self.draft_model
        )  # fmt: skip
        try:
            probe.prefill(self.tokenizer.decode([0]) or " ")
            mx.eval([c.state for c in probe.caches])
            return sum(int(getattr(c, "nbytes", 0) or 0) for c in probe.caches)
        finally:
            recalled.release(probe)

    def _settings(self, sinks: int | None = None, **changes: Any) -> Settings:
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
        except RuntimeFailure:  # Unsaved (507): the folder, not the session
            raise
        except UserError:
            if not drop:
                raise
            recalled.release(entry.session)
            entry.session, entry.checkpoint = None, None
            self._dropped.add(entry.key)
            self.dropped += 1
            return
        recalled.release(entry.session)  # the saved files hold it now
        entry.path, entry.session, entry.checkpoint = path, None, None
        entry.tokens_seen = record["tokens_seen"]
        self.evictions += 1
        stored = [e for e in self.entries.values() if e.session is None]
        if len(stored) > MAX_STORED:
            self._drop(min(stored, key=lambda e: e.last_used))

    def _drop(self, entry: Entry) -> None:
        self.entries.pop(entry.key, None)
        self._dropped.discard(entry.key)
        recalled.release(entry.session)
        if entry.path is not None:
            self.store.forget(entry)

    def _new_session(self, system: str | None, tools: Any = None) -> ChatSession:
        """A session for ``system`` (and ``tools``) whose caches are not allocated yet."""
        settings = self._settings(keep_system=self.keep_system, pin_limit=self.pin)
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
        (:meth:`_head_first`), then shares it."""
        admission = self.admission
        head = session.system_text() if session.settings.keep_system else ""
        if not head:
            admission.make_room(extra, keep)
            return
        snap = admission.snapshots.get(head) if self.recall is None else None
        if snap is None and self._unfed_head(session):
            admission.make_room(extra, keep)
            return
        if self.recall is not None:  # a snapshot's copy would share its tier
            admission.make_room(extra, keep)
            session.prefill(head)
            return
        if snap is not None:
            admission.make_room(extra, keep, head)
            self._restore_head(session, head)
        else:
            size = admission.cache_bytes(session.sinks)
            shared = admission.fits(extra + size, keep, head)
            admission.make_room(extra + size if shared else extra, keep, head)
            for _ in session.prefill_stored(head, self.prefixes):  # or from the store
                pass
            if shared:
                admission.add_snapshot(head, session.checkpoint(), size)

    def _unfed_head(self, session: ChatSession) -> str:
        """The rendered system prompt of a session whose caches do not hold it yet,
        when it is longer than the pin (fed a chunk per round); else ``""``."""
        if session.fed_text or not session.settings.keep_system:
            return ""
        head = session.system_text()
        return head if head and len(session.encode(head)) > session.sinks else ""

    def _restore_head(self, session: ChatSession, head: str) -> None:
        """``session``'s caches from ``head``'s shared snapshot, its transcript kept."""
        messages = session.messages
        session.restore(self.admission.snapshots[head][0])
        session.messages = messages
        self.admission.touch_snapshot(head)

    def _head_first(
        self, job: _Job, session: ChatSession, head: str, turn: Iterator[Any]
    ) -> Iterator[Any]:
        """``turn``'s token source, after ``head`` goes into ``session``'s empty caches a
        chunk per poll (``None``); the head is then shared as its system prompt's
        snapshot where the budget has room without evicting anything."""
        for _ in session.prefill_stored(head, self.prefixes):
            yield None
        job.head = len(session.encode(head))
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

    # ----- the state folder -------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        """What saved caches depend on: a restart with another model or cache shape
        finds none of them (they would load with sizes the budget does not count)."""
        return {
            "model": self.model_id, "weights_bytes": self.weights,
            "cache": self.settings.cache.to_json(), "keep_system": self.keep_system,
            **({"recall": recalled.config(self.recall)} if self.recall is not None else {}),
            "num_draft_tokens": self.settings.num_draft_tokens,
            "draft_model": self.draft_model is not None,
        }  # fmt: skip

    # ----- requests -------------------------------------------------------------------

    def _admit(self, request: Request) -> None:
        if request.messages is None:
            self._admit_completion(request)
            return
        plan, extra = self._agents(request)
        system, history, user = split_messages(request.messages)
        toolset = plan.toolset if plan is not None else None
        repairs = self.repair_tokens > 0 and self.recall is None and self.draft_model is None
        entry, mode, source = matching.find(
            self.entries, request, system, history, toolset,
            isolate=self.isolate, new_id=self._new_id, repair=repairs,
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
                self._drop(entry)
            raise
        session, repaired = entry.session, None
        if mode == "repair":
            fork = checkpoint if source is not entry else None
            repaired = self._repair(entry, fork, history, user)
            mode = "rebuild" if repaired is None else mode
        if mode == "restore":  # the checkpoint encodes exactly ``history``
            session.restore(checkpoint)
            entry.checkpoint = checkpoint
        elif mode == "rebuild":  # the whole history goes in with the new turn
            self._rebuild(entry, system, history, toolset)
            session = entry.session
        elif mode != "repair":
            entry.checkpoint = session.checkpoint()
        entry.messages = [dict(m) for m in session.messages]  # true even if the start fails
        head = self._unfed_head(session)
        if head and self.recall is None and head in self.admission.snapshots:
            self._restore_head(session, head)  # a fork or rebuild of a shared prompt
            head = ""
        turn = session.turn_tokens(user)  # with an unfed head: the head too
        if len(turn[0]) > self.max_prompt_tokens:
            if mode in ("rebuild", "new"):  # its caches would not encode its transcript
                self._drop(entry)
            raise TooLarge(
                f"the prompt has {len(turn[0]):,} tokens to feed; this server takes at most "
                f"{self.max_prompt_tokens:,} per request (--max-prompt-tokens)"
            )
        cached = cache_count(session.caches)
        box: list = []
        tokens = session.stream(
            user, turn=None if head else turn, max_tokens=request.max_tokens,
            temp=request.temp, top_p=request.top_p, stop=request.stop, seed=request.seed,
            steps=self._steps(request, box), **extra,
        )  # fmt: skip
        job = self._start(request, entry, tokens, cached, batched=self._batch is not None)
        job.prompt, job.repaired = len(turn[0]), repaired
        if head:
            job.tokens = self._head_first(job, session, head, tokens)
        box.append(job)

    def _repair(self, entry: Entry, source: Checkpoint | None, history: list, user: Any) -> Any:
        """Repair ``entry``'s session to encode ``history`` (from ``source``, a copy of
        the session it forks, when given); its checkpoint is the state before (what a
        failed turn goes back to). The ``Repaired`` counts, or ``None`` where a repair
        cannot serve (the caller rebuilds)."""
        from mlx_stream.generate import repair

        session = entry.session
        if source is not None:
            session.restore(source)
        plan = repair.plan(session, history, user, self.repair_tokens)
        if isinstance(plan, str):
            return None
        entry.checkpoint = session.checkpoint()
        try:
            return repair.apply(session, history, plan)
        except BaseException:
            session.restore(entry.checkpoint)
            raise

    def _agents(self, request: Request) -> tuple[Any, dict]:
        """A request's tool plan and sampling arguments (mlx_stream.serve), checked
        before any session is touched; with tools, its ``emit`` becomes a
        :class:`~mlx_stream.serve.tools.CallStream`."""
        from mlx_stream.serve import sampling, tools
        from mlx_stream.serve.structured import Grammars

        plan = None
        if request.messages is not None:
            messages = request.messages
            request.messages = [tools.canonical_message(m, i) for i, m in enumerate(messages)]
            tools.check_results(request.messages)
            plan = tools.ToolPlan.make(request.tools, request.tool_choice, self.tokenizer)
        elif request.tools:
            raise BadRequest("tools: only chat requests take tools")
        grammar = request.grammar  # a response_format outranks an auto call's grammar
        if plan is not None and plan.grammar and (grammar is None or plan.choice != "auto"):
            grammar = plan.grammar
        if self._vocab is None:
            self._vocab = len(self.tokenizer.get_vocab())
        constraint = None
        if grammar is not None:
            self._grammars = self._grammars or Grammars(self.tokenizer)
            constraint = self._grammars.constraint(grammar)
        draft = self.draft_model is not None
        penalty = sampling.resolve(request, self.sampling, draft=draft)  # fills request's
        extra = sampling.overrides(
            request, request.temp, request.top_p, self._vocab, constraint, draft=draft,
            repetition_penalty=penalty,
        )  # fmt: skip
        if plan is not None and not isinstance(request.emit, tools.CallStream):
            salt = json.dumps(request.messages[-1], sort_keys=True) + str(len(request.messages))
            request.emit = tools.CallStream(plan, request.emit, salt=salt)
        return plan, extra

    def _rebuild(
        self, entry: Entry, system: str | None, history: list[dict], tools: Any = None
    ) -> None:
        """Start ``entry`` over from its system prompt's snapshot with ``history`` as
        its transcript (the next turn feeds the tail of it that fits the window)."""
        session = self._new_session(system, tools)
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

    def _add(self, entry: Entry) -> Entry:
        self.entries[entry.key] = entry
        return entry

    def _admit_completion(self, request: Request) -> None:
        entry = Entry(
            id="completion-" + self._new_id(12), system=None, transient=True, owner=request.owner
        )
        self._add(entry)
        try:
            self.admission.make_room(self.admission.single_bytes(self.settings.cache.sinks), entry)
            settings = self._settings(keep_system=False)
            session = ChatSession(
                self.model, self.tokenizer, settings, draft_model=self.draft_model
            )
        except BaseException:
            self._drop(entry)
            raise
        entry.session, entry.bytes = session, self.admission.single_bytes(session.sinks)
        tokens = list(self.tokenizer.encode(clean_text(request.prompt or "")))
        if not tokens:
            self._drop(entry)
            raise BadRequest("prompt: must not be empty")
        box: list = []
        try:
            _, extra = self._agents(request)
        except BaseException:
            self._drop(entry)
            raise
        generator = self._completion(session, tokens, request, self._steps(request, box), extra)
        job = self._start(request, entry, generator, 0, batched=self._batch is not None)
        job.prompt = len(tokens)
        box.append(job)

    @staticmethod
    def _completion(
        session: ChatSession, tokens: list[int], request: Request, steps: Any = None,
        extra: dict | None = None,
    ) -> Iterator[Any]:  # fmt: skip
        """A plain completion of ``tokens`` on ``session``'s caches; sets ``session.last``."""
        generator = session.generate(
            tokens, max_tokens=request.max_tokens, temp=request.temp, top_p=request.top_p,
            stop=request.stop, seed=request.seed, steps=steps, **(extra or {}),
        )  # fmt: skip
        last, generated = None, 0
        try:
            for response in generator:
                if response is not None:  # None: polled during the prefill
                    last, generated = response, generated + 1
                yield response
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
        totals = dict.fromkeys(recalled.TOTALS, 0)
        for e in self.entries.values():
            held = recalled.stats(e.session)  # zeros for a session on disk
            if e.session is not None and not held["device_bytes"] and e.busy:
                # decoding in the batch, its rows live in the batch's buffers: the bytes
                # of its full cache (what its own buffers hold between turns)
                spec = self.settings.cache_spec(e.sinks, drafting=self.draft_model is not None)
                held["device_bytes"] = spec.bytes(self.model)
            for k in totals:
                totals[k] += held[k]
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
                    "cache": self.settings.cache_spec(
                        e.sinks, drafting=self.draft_model is not None
                    ).to_json(),
                    "cache_bytes": e.bytes if e.session else 0,
                    # flat: caches + recall region; growing: the recall store (RAM, disk)
                    **held,
                    "idle_s": round(now - e.last_used, 3),
                    "busy": e.busy,
                }
            )
        recall = None
        if self.recall is not None:
            recall = {**recalled.config(self.recall), "folder": self.recall.folder,
                      "ram_bytes_per_session": self.recall.ram_bytes}  # fmt: skip
        self.stats = {
            "sessions": sessions,
            "memory": {
                "budget_bytes": self.budget,
                "used_bytes": self.used_bytes(),
                "weights_bytes": self.weights,
                "session_bytes": self.admission.bytes_by_sinks.get(self.settings.cache.sinks),
                "snapshots": len(self.snapshots),
                "mlx_active_bytes": mx.get_active_memory(),
                "mlx_cache_bytes": mx.get_cache_memory(),
                **totals,  # over every resident session: device (flat) and store (growing)
                "recall": recall,
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
                "dropped": self.dropped,
                "active": len(self._active),
            },
            "prefix_store": self._prefix_stats(),
        }

    def _prefix_stats(self) -> dict[str, Any] | None:
        """The prefix store's folder and counters (``None`` without one)."""
        p = self.prefixes
        if p is None:
            return None
        return {"folder": str(p.root), "enabled": p.enabled, "max_bytes": p.max_bytes,
                "hits": p.hits, "misses": p.misses, "writes": p.writes,
                "rejected": p.rejected}  # fmt: skip
