"""The connections ``serve`` keeps open: bounded in number and in time to send a request.

Contract: :func:`protocol` gives uvicorn an HTTP/1.1 protocol (its h11 one) that closes
a connection whose request line and headers are not whole ``header_timeout`` seconds
after it opened, or after the first bytes of a later request on it (a client that never
finishes its headers holds a file descriptor for nothing), and that keeps at most
``max_connections`` open: one more closes the oldest connection still waiting for its
headers (or idle between requests), so a flood of half-sent requests never stops
``/health`` or a real client from being answered; when every connection is busy with a
request, the new one gets a 503 and is closed. Idle keep-alive connections close after
uvicorn's ``timeout_keep_alive``.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlx_stream.defaults import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS

BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
BUSY_BODY = (
    b'{"error": {"message": "too many open connections (serve --max-connections)", '
    b'"type": "server_error", "param": null, "code": null}}'
)


class Guarded(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    max_connections = DEFAULT_MAX_CONNECTIONS

    def connection_made(self, transport) -> None:
        full = len(self.connections) >= self.max_connections
        if full and not self._make_room():
            super().connection_made(transport)
            transport.write(BUSY % (len(BUSY_BODY), BUSY_BODY))
            transport.close()
            return
        super().connection_made(transport)
        self.opened = self.loop.time()
        self.deadline = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def waiting(self) -> bool:
        """Whether no whole request head has come since the last response."""
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _make_room(self) -> bool:
        """Close the oldest waiting connection; ``False`` when none waits."""
        idle = [c for c in self.connections if isinstance(c, Guarded) and c.waiting()]
        if not idle:
            return False
        min(idle, key=lambda c: c.opened).transport.close()
        return True

    def _arm(self) -> None:
        if not self.waiting():
            self._disarm()
        elif getattr(self, "deadline", None) is None:
            self.deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "deadline", None) is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self) -> None:
        self.deadline = None
        if self.waiting():
            self.transport.close()


def protocol(
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> type[Guarded]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type(
        "GuardedH11", (Guarded,),
        {"header_timeout": header_timeout, "max_connections": max_connections},
    )  # fmt: skip
