"""The HTTP side of one engine request, shared by the APIs of :mod:`mlx_stream.serve`.

Contract: :func:`start` builds an engine :class:`~mlx_stream.serve.engine.Request` whose
events (:mod:`~mlx_stream.serve.event_types`, emitted on the engine's worker thread)
arrive on an asyncio queue, submits it and waits for the first event: ``Started`` or
``Failed``. Given the starlette request (``http``), it takes the caller's owner from it
and feeds its access-log record (:mod:`mlx_stream.serve.accesslog`). The engine's
``Prefill`` events never reach the queue: they become at most one :class:`Ping` per
:data:`PING_EVERY` seconds (a streaming reply's keepalive). Consumers ignore event
kinds they do not know. :func:`drain` collects a whole reply (and stops it when its
client leaves); a caller streaming the events itself sets ``request.cancelled`` when
its client goes away.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mlx_stream.serve import accesslog
from mlx_stream.serve.event_types import (
    Delta,
    End,
    Event,
    Failed,
    Prefill,
    Reasoning,
    Started,
    ToolCall,
)
from mlx_stream.serve.fields import session_header
from mlx_stream.serve.statuses import status_of

PING_EVERY = 5.0  # seconds between keepalive pings while a prompt goes in
POLL_EVERY = 0.25  # seconds between checks that a whole reply's client is still there
CORE = (Started, Delta, Reasoning, ToolCall, End, Failed)  # what the engine's contract names
GONE = (499, "the client closed the connection")


@dataclass(frozen=True)
class Ping:
    """A prompt is going in: ``done`` of its ``total`` tokens (a keepalive)."""

    done: int
    total: int


class Job:
    """A request's events as an asyncio queue (filled from the worker thread); with a
    ``record``, the events also fill its access-log line."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, record: accesslog.Record | None = None,
        clock=time.monotonic,
    ):  # fmt: skip
        self.loop, self.events, self.record, self.clock = loop, asyncio.Queue(), record, clock
        self.pinged: float | None = None
        self.checked = clock()  # when its client was last seen connected (drain)

    def emit(self, event: Event) -> None:
        """Hand ``event`` to the event loop (any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.take, event)
        except RuntimeError:  # the event loop is gone (shutting down)
            pass

    def take(self, event: Event) -> None:
        """Queue ``event`` (on the loop's thread); prefill progress becomes pings."""
        now = self.clock()
        if self.record is not None:
            self.record.event(event, now)
        if isinstance(event, Prefill):
            if self.pinged is None or now - self.pinged >= PING_EVERY:
                self.pinged = now
                self.events.put_nowait(Ping(event.done, event.total))
            return
        self.events.put_nowait(event)


AGENT_HEADERS = ("x-claude-code-session-id", "session-id")  # Claude Code's, Codex's


def agent_key(headers: Any) -> str:
    """The agent client's key for its session, from the headers it sends every
    request (a malformed one is ignored: it only steers forking)."""
    for name in AGENT_HEADERS:
        value = headers.get(name)
        if value and session_header(value) is None:
            return value
    return ""


async def start(engine: Any, http: Any = None, **fields: Any) -> tuple[Job, Any, Event]:
    """Submit an engine request with ``fields``; returns (job, request, first event).

    ``http``: the starlette request; its owner is the default ``owner`` and its
    access-log record follows the events. A prompt over the engine's limit is refused
    here (``Failed`` with ``TooLarge``), counted off the event loop and the worker."""
    from mlx_stream.serve.engine import Request, TooLarge

    if http is not None:
        fields.setdefault("owner", (http.scope.get("state") or {}).get("owner", ""))
        fields.setdefault("agent", agent_key(getattr(http, "headers", None) or {}))
    ceiling, asked = getattr(engine, "max_tokens_ceiling", None), fields.get("max_tokens")
    if ceiling is not None and asked is not None and asked > ceiling:
        note(http, f"max_tokens {asked} capped at --max-tokens-ceiling {ceiling}")
    job = Job(asyncio.get_running_loop(), accesslog.record_of(http))
    request = Request(emit=job.emit, progress=True, **fields)
    precheck = getattr(engine, "precheck", None)
    if precheck is not None:
        try:
            await asyncio.to_thread(precheck, request)
        except TooLarge as exc:
            first = Failed(exc)
            if job.record is not None:
                job.record.event(first, job.clock())
            return job, request, first
    engine.submit(request)
    while not isinstance(first := await job.events.get(), CORE):
        pass  # a ping before the start says nothing yet
    return job, request, first


async def engine_for(models: Any, name: str | None) -> tuple[Any, Any]:
    """``(engine, None)`` of the model ``name`` names (loaded first, off the event
    loop, if needed), else ``(None, status)``: the refusal's
    :class:`~mlx_stream.serve.statuses.Status` (404 not served, 503 no room, 500 a
    load that failed)."""
    from mlx_stream.serve.models import LoadFailed, NoRoom, NotServed

    engine = models.ready(name)
    if engine is not None:
        return engine, None
    try:
        return await asyncio.to_thread(models.get, name), None
    except (NotServed, NoRoom, LoadFailed) as exc:
        return None, status_of(Failed(exc))


def note(http: Any, text: str) -> None:
    """Add ``text`` to the request's access-log line."""
    accesslog.note(http, text)


async def next_event(job: Job, http: Any = None) -> Event | Ping | None:
    """The job's next event, or ``None`` once ``http``'s client has gone away (a plain
    response's handler is not cancelled when its client leaves: ask every
    :data:`POLL_EVERY` seconds, however fast the events come)."""
    if http is None:
        return await job.events.get()
    get = asyncio.ensure_future(job.events.get())
    try:
        while True:
            wait = max(0.0, job.checked + POLL_EVERY - job.clock())
            done, _ = await asyncio.wait({get}, timeout=wait)
            if done:
                return get.result()
            job.checked = job.clock()
            if await http.is_disconnected():
                return None
    finally:
        get.cancel()  # a no-op once it is done


@dataclass
class Reply:
    """A whole reply: its text, tool calls, usage and finish reason (or an error);
    ``logprobs``: (text, entry) per token where the request asked for them."""

    text: str = ""
    reasoning: str = ""  # the thought before the answer (serve.reasoning)
    calls: list[dict] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    finish: str = "stop"
    error: tuple | None = None  # (status, message)
    logprobs: list[tuple[str, Any]] = field(default_factory=list)


async def drain(job: Job, request: Any, http: Any = None) -> Reply:
    """Collect the rest of a request's events into a :class:`Reply`. With ``http``
    (the starlette request), a client that leaves stops the request: the reply's
    ``error`` is then (499, ...)."""
    reply, texts, thoughts = Reply(), [], []
    try:
        while True:
            event = await next_event(job, http)
            if event is None:  # the client left: its request stops (mid-prefill too)
                request.cancelled.set()
                reply.error = GONE
                break
            match event:
                case Delta(text, logprob):
                    texts.append(text)
                    if logprob is not None:
                        reply.logprobs.append((text, logprob))
                case Reasoning(text):
                    thoughts.append(text)
                case ToolCall(_, call):
                    reply.calls.append(call)
                case End(usage, finish):
                    reply.usage, reply.finish = usage, finish
                    break
                case Failed() as failed:
                    reply.error = status_of(failed)[:2]
                    break
    except asyncio.CancelledError:
        request.cancelled.set()
        raise
    reply.text, reply.reasoning = "".join(texts), "".join(thoughts)
    return reply


def repair_counts(usage: dict) -> dict[str, int]:
    """The engine's repair counts of ``usage`` (present after a repaired edit), for the
    APIs' own usage shapes."""
    return {k: usage[k] for k in ("repaired_tokens", "reused_tokens") if k in usage}
