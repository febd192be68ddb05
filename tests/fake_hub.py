"""A stand-in for the Hugging Face Hub on a loopback port, for huggingface_hub's real
client (``HF_ENDPOINT`` points at it): the repo info, tree and ``resolve`` routes a
download uses, byte ranges (safetensors headers), and the Hub's error answers (a 404
with ``X-Error-Code: RepoNotFound``, a 403 with ``GatedRepo``, a 500). A download can
be cut off after the first bytes of one file, as a dropped connection does.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SHA = "89abcdef0123456789abcdef0123456789abcdef"


def git_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's id


class FakeHub:
    """``with FakeHub({"org/name": {file: bytes}}) as hub: hub.url``.

    Attributes:
        repos: ``{repo_id: {file: bytes}}``, editable while it runs.
        gated: Repo ids answered as gated.
        down: Answer every request with a 500.
        cut: A file name whose download breaks after its first bytes.
        requests: ``(method, path, range header)`` of every request, in order.
    """

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos, self.gated, self.down, self.cut = repos, set(), False, None
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                hub.answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self, pattern: str) -> list[str]:
        """Paths of whole-file GETs (no byte range) matching ``pattern``."""
        return [p for m, p, r in self.requests if m == "GET" and not r and re.search(pattern, p)]

    # ------------------------------------------------------------------ answers

    @staticmethod
    def send(handler, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        handler.send_response(status)
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    def error(self, handler, status: int, code: str | None, message: str) -> None:
        headers = {"Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        self.send(handler, status, json.dumps({"error": message}).encode(), headers)

    def answer(self, handler) -> None:
        path = handler.path.split("?")[0]
        if self.down:
            return self.error(handler, 500, None, "Internal Error")
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+|/tree/[^/]+(?:/.*)?)?", path)
        r = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        repo_id = (m or r).group(1) if (m or r) else None
        if repo_id not in self.repos:
            return self.error(handler, 404, "RepoNotFound", "Repository not found")
        if repo_id in self.gated:
            return self.error(handler, 403, "GatedRepo", "Access to this model is restricted")
        files = self.repos[repo_id]
        if m and "/tree/" in path:
            tree = [{"type": "file", "path": n, "size": len(d), "oid": git_sha(d)}
                    for n, d in files.items()]  # fmt: skip
            return self.send(handler, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"})  # fmt: skip
        if m:
            siblings = [{"rfilename": n, "size": len(d), "blobId": git_sha(d)} for n, d in files.items()]  # fmt: skip
            info = {"id": repo_id, "sha": SHA, "siblings": siblings}
            return self.send(handler, 200, json.dumps(info).encode(), {"Content-Type": "application/json"})  # fmt: skip
        name = r.group(2)
        if name not in files:
            return self.error(handler, 404, "EntryNotFound", "Entry not found")
        data = files[name]
        headers = {"X-Repo-Commit": SHA, "ETag": f'"{git_sha(data)}"',
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}  # fmt: skip
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", handler.headers.get("Range") or "")
        if wanted and handler.command == "GET":
            start = int(wanted.group(1))
            end = min(int(wanted.group(2) or len(data) - 1), len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self.send(handler, 206, data[start : end + 1], headers)
        if name == self.cut and handler.command == "GET":  # a dropped connection
            handler.send_response(200)
            for key, value in headers.items():
                handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data[: len(data) // 4])
            handler.wfile.flush()
            handler.close_connection = True
            return None
        return self.send(handler, 200, data, headers)
