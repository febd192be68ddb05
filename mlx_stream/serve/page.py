"""The chat page ``serve`` ships: ``GET /`` answers ``ui/index.html`` and ``GET /ui/NAME``
the page's other files, read once from the package (``mlx_stream/serve/ui/``, wheel
package data) with :mod:`importlib.resources`. The page is static and holds no secret,
so it is answered ahead of the API key check (it asks for the key itself and sends it
with its API calls); every other request, ``HEAD /`` included, goes on to the app.
Each file goes with a Content-Security-Policy that runs only the page's own script and
fetches only from this server: model output can never run as code."""

from __future__ import annotations

from importlib import resources

FOLDER = "ui"  # beside this module
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def page_files() -> dict[str, tuple[bytes, str]]:
    """``{url path: (bytes, content type)}`` of the page's files, from the package."""
    folder = resources.files("mlx_stream.serve").joinpath(FOLDER)
    found = {}
    for item in folder.iterdir():
        kind = TYPES.get("." + item.name.rpartition(".")[2])
        if kind is not None and item.is_file():
            path = "/" if item.name == "index.html" else f"/{FOLDER}/{item.name}"
            found[path] = (item.read_bytes(), kind)
    if "/" not in found:
        raise FileNotFoundError(f"the chat page is missing from the package ({folder})")
    return found


class Page:
    """ASGI middleware answering ``GET`` for the page's files; anything else goes on."""

    def __init__(self, app):
        self.app, self.files = app, page_files()

    async def __call__(self, scope, receive, send):
        found = None
        if scope["type"] == "http" and scope.get("method") == "GET":
            found = self.files.get(scope.get("path", ""))
        if found is None:
            return await self.app(scope, receive, send)
        body, kind = found
        headers = [
            (b"content-type", kind.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"content-security-policy", POLICY.encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"cache-control", b"no-cache"),  # a new version of the package shows at once
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
