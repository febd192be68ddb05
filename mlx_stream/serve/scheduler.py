"""The worker of :class:`~mlx_stream.serve.engine.Engine`: one thread runs every MLX call,
fed by a queue, in scheduler rounds (:class:`Scheduler`, owned by the engine).

Contract: each round, newcomers' prompts go in a chunk at a time, every session with
decode work steps together in one batched model call, then each request takes its
tokens (unbatched: at most ``chunk`` each, fair interleaving). A cancelled request stops
at its next token or prefill chunk and its session goes back to its checkpoint. A
request's events (:mod:`~mlx_stream.serve.event_types`) reach its ``emit``; one that
fails gets the exception (``Failed``) and the server goes on. Admitting a request is
the engine's (the ``admit`` it is given), a session's lifecycle the session table's.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mlx_stream.generate.session import cache_count
from mlx_stream.serve.event_types import Delta, End, Failed, Prefill, Started
from mlx_stream.serve.matching import Entry
from mlx_stream.serve.refusals import REFUSALS, Busy, ShuttingDown

DEFAULT_CHUNK = 8  # tokens a request advances per scheduler round
PUBLISH_EVERY = 0.25  # seconds between refreshes of the stats while requests run


@dataclass
class Request:
    """One generation request, built by the HTTP side.

    ``messages`` (chat) or ``prompt`` (plain completion). ``owner`` names the caller's
    namespace of sessions (a hash of its API key; ``""`` without keys): a request only
    ever sees and continues sessions of its own owner. Events
    (:mod:`~mlx_stream.serve.event_types`) reach ``emit`` from the worker thread.
    Setting ``cancelled`` stops the request at its next token. ``logprobs``: ``None``
    for none, else how many alternatives per token.
    """

    emit: Callable[[Any], None]
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
    # An agent client's own key for its session (Claude Code's x-claude-code-session-id,
    # Codex's session-id header): a transcript it edits is repaired in place, not forked.
    agent: str = ""
    # Agents (mlx_stream.serve): OpenAI's sampling fields, a grammar the reply must
    # match (llguidance), tools and tool_choice; a tool call reaches ``emit`` as a
    # ToolCall event and ends the reply with finish_reason "tool_calls".
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    grammar: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    top_k: int | None = None
    repetition_penalty: float | None = None  # mlx-lm's, over the last 20 tokens (ollama's)
    thinking: bool | None = None  # the template's enable_thinking (None: its default)
    matched_stop: str | None = None  # set by the engine: the stop string that ended it
    progress: bool = False  # also emit Prefill events while its prompt goes in
    cancelled: threading.Event = field(default_factory=threading.Event)


WIRE = ("messages", "prompt", "session_id", "max_tokens", "temp", "top_p", "stop", "seed",
        "logprobs", "owner", "logit_bias", "presence_penalty", "frequency_penalty", "grammar",
        "tools", "tool_choice", "top_k", "agent", "repetition_penalty", "thinking")  # fmt: skip
FOLLOW = "follow"  # a follower's worker: take requests from rank 0 from now on


@dataclass
class Job:
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
    fed: int = 0  # of those, how many are in its caches (fed_so_far)
    repaired: Any = None  # the generate.repair.Repaired of an edit repaired first
    origin: Any = None  # the caller's Request (``request`` is the planned copy)


def fed_so_far(job: Job) -> int:
    """Tokens of ``job``'s prompt in its caches now: read from the caches (a poll may
    come before its chunk ran, a chunk may be cut short by the window, the system
    prompt's head may be read from the prefix store), never counted from polls."""
    from mlx_stream.generate.session import cache_count

    session = job.entry.session
    if session is None or not session.caches:
        return job.fed
    return max(0, min(job.prompt, cache_count(session.caches) - job.cached))


class Scheduler:
    """The worker thread and its rounds: it admits each queued request through
    ``admit`` and runs the jobs admitted, ending each on its session.

    Args:
        sessions (Sessions): The session table (:mod:`~mlx_stream.serve.sessions`): a
            job's end goes back to it (``end_turn``), a drain saves it (``save_all``).
        admit (Callable): Start one queued :class:`Request` (on the worker), raising
            the refusal that ends it.
        refresh (Callable): Refresh the engine's stats (:meth:`publish`).
        model, tokenizer: The loaded model.
        settings (Settings): Session defaults (the batch's constraints, stop tokens).
        drafting (bool): A draft model decodes with the model.
        chunk (int): Tokens a request advances per round when not batched.
        batching (bool): Decode sessions together in one batched call per round.
        cluster (distributed.Cluster, optional): The ranks a sharded model runs on.
        turns (optional): A lock the worker holds around each round and each queued
            item it handles (several models' engines share one: one computes at a
            time). Default: none.
    """

    def __init__(
        self, sessions: Any, admit: Callable[[Request], None], refresh: Callable[[], None],
        model: Any, tokenizer: Any, settings: Any, *, drafting: bool = False,
        chunk: int = DEFAULT_CHUNK, batching: bool = True, cluster: Any = None,
        turns: Any = None,
    ):  # fmt: skip
        from mlx_stream.serve.logprobs import TokenLogprobs

        self.sessions, self.admit, self.refresh = sessions, admit, refresh
        self.model, self.settings, self.drafting = model, settings, drafting
        self.chunk, self.cluster = chunk, cluster
        self.turns = turns if turns is not None else contextlib.nullcontext()
        self._logprobs = TokenLogprobs(tokenizer)
        self._eos = set(getattr(tokenizer, "eos_token_ids", ()) or ()) | set(settings.stop_tokens)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.closing = False  # draining: requests are refused
        self._active: list[Job] = []
        self.published = 0.0  # when the stats were last refreshed
        self.refusals = 0
        self.batching, self._batch, self.batch_refusal = batching, None, "off (--no-batch)"
        if cluster is not None:
            self.batching = False
            self.batch_refusal = "off (--distributed: one request at a time, on every rank)"

    @property
    def running(self) -> int:
        """Requests running now (started, not ended); read on the worker thread."""
        return len(self._active)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._run, name="mlx-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Drain, save the sessions (:meth:`_drain`), then end the worker thread."""
        self.closing = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._stopping = True

    def drain(self) -> None:
        """Stop taking requests and end the running ones at the next round. Any thread,
        a signal handler included: it only sets a flag."""
        self.closing = True

    def publish(self) -> None:
        """Refresh the stats now (on the worker thread)."""
        self.published = time.monotonic()
        self.refresh()

    def submit(self, request: Request) -> None:
        """Queue a generation request (any thread)."""
        if self.closing:
            request.emit(Failed(ShuttingDown()))
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

    @property
    def current_batch(self) -> Any:
        """The batch every session decodes in (``None``: each decodes alone)."""
        return self._batch

    def make_batch(self) -> None:
        """The batch every session decodes in, or the reason there is none."""
        from mlx_stream.errors import Unsupported
        from mlx_stream.generate.batch import Batch

        if not self.batching:
            return
        if self.drafting:
            self.batch_refusal = "a draft model: each request decodes alone, interleaved"
        elif self.settings.cache.kv_bits is not None:
            self.batch_refusal = "quantized KV caches (kv_bits) are not batched"
        elif self.settings.cache.recall is not None:
            self.batch_refusal = "--recall: each session keeps its own store and decodes alone"
        else:
            try:
                self._batch, self.batch_refusal = Batch(self.model), None
            except Unsupported as exc:
                self.batch_refusal = str(exc)

    def start_job(
        self, request: Request, entry: Entry, tokens: Iterator[Any], cached: int,
        note: str | None = None,
    ) -> Job:  # fmt: skip
        """Run ``request``'s ``tokens`` on ``entry`` from the next round (batched where
        there is a batch); its :class:`Started` event carries ``note`` for the log."""
        entry.busy = True
        entry.last_used = time.monotonic()
        job = Job(request, entry, tokens, cached, batched=self._batch is not None)
        self._active.append(job)
        request.emit(Started(None if entry.transient else entry.id, note))
        return job

    def steps(self, request: Request, box: list) -> Any:
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
            with self.turns:  # several models: one computes at a time
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
                if self.closing:
                    self._end_all()
                self._round()

    def _quiesce(self) -> None:
        """Finish MLX's work queued from this thread: the process may exit next, and
        MLX aborts ("terminate called") when an exit finds a worker's evaluation
        still running."""
        import mlx.core as mx

        from mlx_stream.mlxlm import generation_stream

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
        if self.closing:
            item.emit(Failed(ShuttingDown()))
            return
        try:
            self.admit(item)
        except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
            if not isinstance(exc, REFUSALS) and self._fatal(exc):
                raise
            self.refusals += isinstance(exc, Busy)
            item.emit(Failed(exc))
        self.publish()

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
        if self._active and time.monotonic() - self.published > PUBLISH_EVERY:
            self.publish()

    def _advance_safely(self, job: Job) -> None:
        try:
            self._advance(job)
        except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
            if self._fatal(exc):
                raise
            job.running = False
            self._end(job, rollback=True)
            job.request.emit(Failed(exc, crashed=True))

    def _advance(self, job: Job) -> None:
        """Emit up to ``chunk`` tokens of ``job`` (a batched one: the tokens its row
        has ready, or its first token); one prefill chunk of a prompt still going in."""
        job.running, ending = True, False
        for i in range(self.chunk if not job.batched else 1 << 30):
            if self._cancelled(job, i == 0):
                job.running = False
                self._end(job, rollback=True)
                return
            if job.batched and job.row is not None and not job.row.inbox and not ending:
                if not job.row.joined and job.request.progress:  # still prefilling
                    job.fed = fed_so_far(job)
                    job.request.emit(Prefill(job.fed, job.prompt))
                break  # its next token comes with the next batch step
            try:
                response = next(job.tokens)
            except StopIteration:
                job.running = False
                self._finish(job)
                return
            if response is None:  # a prefill chunk went in (or not yet): the others' turn
                job.fed = fed_so_far(job)
                if job.request.progress:
                    job.request.emit(Prefill(job.fed, job.prompt))
                break
            job.sent += 1
            ending = response.finish_reason is not None
            if ending and getattr(response, "stop_string", None):
                job.request.matched_stop = response.stop_string
                if job.origin is not None:
                    job.origin.matched_stop = response.stop_string
            logprob = None
            top = job.request.logprobs
            if top is not None and not (ending and response.token in self._eos):
                logprob = self._logprobs.entry(response.token, response.logprobs, top)
            if response.text or logprob is not None:
                job.request.emit(Delta(response.text, logprob))
        job.running = False

    def _cancelled(self, job: Job, first: bool) -> bool:
        """Whether the request was cancelled; sharded: rank 0's answer, asked at the
        start of each chunk (a collective per token would stall the decode)."""
        if self.cluster is None:
            return job.request.cancelled.is_set()
        return first and bool(self.cluster.share_int(int(job.request.cancelled.is_set())))

    def _finish(self, job: Job, cut: bool = False) -> None:
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
        self.publish()
        job.request.emit(End(usage, finish or "stop"))

    def _drain(self) -> None:
        """End every running request (:meth:`_end_all`), then save every resident
        session to the state folder."""
        self._end_all()
        if self.cluster is None:  # ranks save only in step
            self.sessions.save_all()

    def _end_all(self) -> None:
        """End every running request: one that has sent tokens keeps its reply so far
        (its stream ends with ``length``), one still prefilling goes back to its
        checkpoint (``ShuttingDown``); queued ones are refused as they come."""
        self.closing = True
        for job in list(self._active):
            if job.sent:
                job.tokens.close()  # the reply so far joins the transcript and cache
                self._finish(job, cut=True)
            else:
                self._end(job, rollback=True)
                job.request.emit(Failed(ShuttingDown()))

    def _end(self, job: Job, rollback: bool) -> None:
        """Close the request's generator; its session ends the turn
        (:meth:`Sessions.end_turn`), back to its checkpoint on ``rollback``."""
        if job in self._active:
            self._active.remove(job)
        job.tokens.close()
        self.sessions.end_turn(job.entry, rollback)
        if rollback and not job.entry.transient:
            self.publish()
