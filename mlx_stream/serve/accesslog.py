"""The access log of ``serve``: one line per HTTP request on stderr.

Contract: :class:`AccessLog` (ASGI middleware, outermost) puts a :class:`Record` into
``scope["state"]`` (``request.state`` in starlette) under :data:`KEY` and writes its
line once the response's body ended (or the app returned without ending it: the client
left, logged as 499). The engine side fills the record through
:class:`~mlx_stream.serve.events.Job`: the session on ``Started``, time to first token,
usage on ``End``, prefill progress (a line of its own at most every
:data:`PROGRESS_EVERY` seconds while a prompt goes in). Route code adds notes with
:func:`note`. Lines look like::

    16:42:07 POST /v1/messages 200 session=ab12cd fed=18,718 cached=0 gen=42 ttft=71.3s total=75.0s
    16:42:08 GET /health 200 total=0.00s
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from starlette.requests import ClientDisconnect

from mlx_stream.serve.event_types import Delta, End, Event, Failed, Prefill, Started, ToolCall
from mlx_stream.serve.statuses import status_of

KEY = "access"  # the record's name in scope["state"]
PROGRESS_EVERY = 10.0  # seconds between prefill progress lines of one request
LOOP_NOTE = "stopped a loop: the reply repeated one span (--stop-loops)"


# C0 and C1 control characters, DEL, line separators and bidi overrides: a request's
# path or names must not end a log line (``%0a`` forging one), reach the operator's
# terminal (``ESC[...``) or reorder what it shows.
_UNSAFE = (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F))
_CONTROL = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _UNSAFE}
_CONTROL.update({c: f"\\u{c:04x}" for c in range(0x2066, 0x206A)})
_CONTROL.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def clean(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n``, ``\\x1b``):
    what anything taken from a request reads as in a log line."""
    return text.translate(_CONTROL)


def _cleaned(out):
    """``out`` writing each line :func:`clean`: one request, one line."""
    return lambda line: out(clean(line))


def _eta(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f} min"


def write(line: str) -> None:
    """One line to stderr (looked up at each call: tests capture it)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _clock() -> str:
    return time.strftime("%H:%M:%S")


def _seconds(s: float) -> str:
    return f"{s:.2f}s" if s < 10 else f"{s:.1f}s"


class Record:
    """What one request's log line says; ``now`` values are ``time.monotonic()``."""

    def __init__(
        self, method: str, path: str, started: float | None = None, out=None, observe=None
    ):  # fmt: skip
        self.method, self.path, self.observe = method, path, observe
        self.started = time.monotonic() if started is None else started
        self.out = _cleaned(out or write)
        self.status: int | None = None
        self.engine = False  # an engine request started (its fields below are known)
        self.session: str | None = None
        self.first: float | None = None  # when the first token came
        self.usage: dict | None = None
        self.notes: list[str] = []
        self.progressed = self.started  # when the last progress line was written
        self.fed = 0  # prompt tokens in at that line
        self.done = False

    def _progress(self, fed: int, total: int, now: float) -> str:
        """A prefill progress line: the prompt tokens in (read from the caches), the
        rate since the last line and the time left at that rate."""
        line = (
            f"{_clock()} {self.method} {self.path} prefill session={self.session or '-'} "
            f"{fed:,}/{total:,} tokens"
        )
        rate = (fed - self.fed) / max(now - self.progressed, 1e-9)
        if rate > 0 and fed < total:
            line += f" · {rate:,.0f} tok/s · ~{_eta((total - fed) / rate)} left"
        return line

    def event(self, event: Event, now: float) -> None:
        """Take one engine event (on the event loop's thread)."""
        match event:
            case Started(session, note):
                self.engine, self.session = True, session
                if note:
                    self.notes.append(note)
            case Delta() | ToolCall() if self.first is None:
                self.first = now
            case End(usage, finish):
                self.usage = usage
                if finish == "loop":
                    self.notes.append(LOOP_NOTE)
            case Failed() as failed:
                status, message, _ = status_of(failed)
                self.notes.append(f"error {status}: {message}")
            case Prefill(done, total) if now - self.progressed >= PROGRESS_EVERY and not self.done:
                self.out(self._progress(done, total, now))
                self.progressed, self.fed = now, done

    def line(self, now: float) -> str:
        parts = [_clock(), self.method, self.path, str(self.status or "-")]
        if self.engine:
            parts.append(f"session={self.session or '-'}")
        if self.usage is not None:
            prompt = int(self.usage.get("prompt_tokens", 0))
            cached = int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            gen = int(self.usage.get("completion_tokens", 0))
            parts += [f"fed={prompt - cached:,}", f"cached={cached:,}", f"gen={gen:,}"]
        if self.first is not None:
            parts.append(f"ttft={_seconds(self.first - self.started)}")
        parts.append(f"total={_seconds(now - self.started)}")
        return " ".join(parts) + "".join(f" · {n}" for n in self.notes)

    def finish(self, now: float | None = None) -> None:
        """Write the line (once)."""
        if not self.done:
            self.done = True
            now = time.monotonic() if now is None else now
            self.out(self.line(now))
            if self.observe is not None:  # the metrics (serve.metrics)
                self.observe(self, now)


def record_of(http: Any) -> Record | None:
    """The record of a starlette request (``None`` without one: ``quiet``)."""
    if http is None:
        return None
    return (http.scope.get("state") or {}).get(KEY)


def note(http: Any, text: str) -> None:
    """Add ``text`` to the request's log line (nothing when the log is off)."""
    record = record_of(http)
    if record is not None:
        record.notes.append(text)


class AccessLog:
    """ASGI middleware writing each HTTP request's :class:`Record` line. Add it last
    (outermost): refusals by the other middleware are logged too, and their copies of
    ``scope["state"]`` carry the record on."""

    def __init__(self, app, out=None, quiet: bool = False, observe=None):
        self.app, self.observe = app, observe
        self.out = (lambda line: None) if quiet else out  # quiet: records for the metrics only

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = Record(
            scope.get("method", ""), scope.get("path", ""), out=self.out, observe=self.observe
        )
        scope = {**scope, "state": {**(scope.get("state") or {}), KEY: record}}

        async def logged(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                record.finish()

        try:
            await self.app(scope, receive, logged)
        except BaseException as exc:
            if not isinstance(exc, OSError | ClientDisconnect | asyncio.CancelledError):
                record.status = 500  # a failure, not a client that left
                record.notes.append(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if not record.done and record.status != 500:
                record.status = 499  # no whole response: its client went away
            record.finish()
