"""The HTTP side of one engine request, shared by the APIs of :mod:`mlx_stream.serve`.

Contract: :func:`start` builds an engine :class:`~mlx_stream.serve.engine.Request` whose
events (emitted on the engine's worker thread) arrive on an asyncio queue, submits it
and waits for the first event: ``("start", info)`` or ``("error", status, message,
retry_after)``. :func:`drain` collects a whole reply; a caller streaming the events
itself sets ``request.cancelled`` when its client goes away.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


class Job:
    """A request's events as an asyncio queue (filled from the worker thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.events = loop, asyncio.Queue()

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutting down)
            pass


async def start(engine: Any, **fields: Any) -> tuple[Job, Any, tuple]:
    """Submit an engine request with ``fields``; returns (job, request, first event)."""
    from mlx_stream.serve.engine import Request

    job = Job(asyncio.get_running_loop())
    request = Request(emit=job.emit, **fields)
    engine.submit(request)
    return job, request, await job.events.get()


@dataclass
class Reply:
    """A whole reply: its text, tool calls, usage and finish reason (or an error)."""

    text: str = ""
    calls: list[dict] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    finish: str = "stop"
    error: tuple | None = None  # (status, message)


async def drain(job: Job, request: Any) -> Reply:
    """Collect the rest of a request's events into a :class:`Reply`."""
    reply, texts = Reply(), []
    try:
        while True:
            event = await job.events.get()
            if event[0] == "text":
                texts.append(event[1])
            elif event[0] == "tool_call":
                reply.calls.append(event[2])
            elif event[0] == "end":
                reply.usage, reply.finish = event[1], event[2]
                break
            elif event[0] == "error":
                reply.error = (event[1], event[2])
                break
    except asyncio.CancelledError:
        request.cancelled.set()
        raise
    reply.text = "".join(texts)
    return reply
