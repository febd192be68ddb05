"""What a browser may do to ``serve``: the answer to cross-site requests and DNS rebinding.

Contract: :class:`BrowserGuard` (ASGI middleware, outside the API key check) refuses,
with one line of JSON, a request whose ``Host`` is not one of :class:`Browsers`'
hosts (421: a page whose name was rebound to this machine) and one whose ``Origin``
is neither the server's own (the ``Host`` it was sent to) nor one the operator allowed
(403: a page of another site). An allowed origin gets CORS headers, and its preflight
(``OPTIONS`` with ``Access-Control-Request-Method``) is answered here (204). A request
without ``Origin`` (curl, the SDKs, the agent CLIs) is not a browser's cross-site one
and goes on. :class:`JsonOnly` refuses a POST whose body is not labelled
``application/json`` (415): a page could otherwise send one without a preflight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mlx_stream.serve.accesslog import clean

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
ANY = "*"  # --cors-origin '*': every origin (and --allowed-host '*': every Host)
ALLOW_METHODS = "GET, POST, OPTIONS"
EXPOSE = "X-Session-ID, X-Max-Tokens-Ceiling, Retry-After"
PREFLIGHT_SECONDS = "600"


def host_name(value: str) -> str:
    """The host of a ``Host`` header or address, lowercased, without its port or the
    brackets of an IPv6 address (``[::1]:8080`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    return value.partition(":")[0].rstrip(".")


@dataclass(frozen=True)
class Browsers:
    """Which ``Host`` names and which other origins the server answers.

    Attributes:
        hosts: Accepted ``Host`` names (lowercase, no port); holding ``"*"``: any.
        origins: Other origins allowed (``scheme://host[:port]``); ``"*"``: any.
    """

    hosts: frozenset[str] = LOOPBACK
    origins: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def make(cls, bind: str, allowed_hosts=(), cors_origins=(), keyed: bool = False) -> Browsers:
        """The policy of a server bound to ``bind``: loopback names and the bound
        address (not a wildcard's); any Host on a wildcard address with API keys
        (clients reach it by whatever name the network gives it, and need a key)."""
        hosts = set(LOOPBACK) | {host_name(h) for h in allowed_hosts}
        if host_name(bind) not in WILDCARDS:
            hosts.add(host_name(bind))
        elif keyed:
            hosts.add(ANY)
        origins = {normal_origin(o) for o in cors_origins}
        return cls(frozenset(hosts), frozenset(origins))

    def host_ok(self, host: str | None) -> bool:
        """Whether a request sent to ``host`` (its ``Host`` header) is answered; a
        request without one (HTTP/1.0) is no browser's."""
        return host is None or ANY in self.hosts or host_name(host) in self.hosts

    def listed(self, origin: str) -> bool:
        """Whether the operator allowed ``origin`` (``--cors-origin``)."""
        return ANY in self.origins or normal_origin(origin) in self.origins


def normal_origin(origin: str) -> str:
    """An origin as browsers send it: lowercase, no trailing slash."""
    return origin.strip().lower().rstrip("/")


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` is the page's own server: its ``host:port`` is the ``Host``
    the request was sent to (the server's own chat page)."""
    parts = urlsplit(normal_origin(origin))
    return host is not None and parts.scheme in ("http", "https") and parts.netloc == host.lower()


class BrowserGuard:
    """ASGI middleware applying :class:`Browsers` (see the module's contract);
    ``refuse(path, status, message)`` is the error response in the shape of the API
    ``path`` belongs to."""

    def __init__(self, app, browsers: Browsers, refuse: Callable):
        self.app, self.browsers, self.refuse = app, browsers, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = _text(headers.get(b"host"))
        if not self.browsers.host_ok(host):
            message = (
                f"Host {clean(host or '')!r} is not this server's (a page whose name points "
                "here?); serve --allowed-host NAME to answer it"
            )
            return await self.refuse(scope["path"], 421, message)(scope, receive, send)
        origin = _text(headers.get(b"origin"))
        if origin is None or same_origin(origin, host):
            return await self.app(scope, receive, send)
        if not self.browsers.listed(origin):
            message = (
                f"Origin {clean(origin)!r} may not use this server (a cross-site request); "
                "serve --cors-origin ORIGIN allows it"
            )
            return await self.refuse(scope["path"], 403, message)(scope, receive, send)
        cors = [(b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
        if scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers:
            asked = headers.get(b"access-control-request-headers", b"")
            cors += [
                (b"access-control-allow-methods", ALLOW_METHODS.encode()),
                (b"access-control-allow-headers", asked),
                (b"access-control-max-age", PREFLIGHT_SECONDS.encode()),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": cors})
            return await send({"type": "http.response.body", "body": b""})
        cors.append((b"access-control-expose-headers", EXPOSE.encode()))

        async def with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        return await self.app(scope, receive, with_cors)


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


class JsonOnly:
    """415 for a POST whose ``Content-Type`` is not ``application/json``: a web page can
    send ``text/plain``, a form or no type at all to any site without asking first
    (a "simple" request); ``application/json`` needs a preflight, which
    :class:`BrowserGuard` refuses for an origin not allowed. ``refuse``: as
    :class:`BrowserGuard`'s."""

    def __init__(self, app, refuse: Callable):
        self.app, self.refuse = app, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST":
            kind = dict(scope.get("headers") or []).get(b"content-type", b"")
            if kind.partition(b";")[0].strip().lower() != b"application/json":
                message = (
                    "the request body must be sent as Content-Type: application/json "
                    "(curl: -H 'Content-Type: application/json')"
                )
                return await self.refuse(scope["path"], 415, message)(scope, receive, send)
        return await self.app(scope, receive, send)
