"""A real ``mlx-stream serve`` process on a free loopback port, and plain HTTP to it
(urllib: no extra client), for every test module that talks to a server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

SYSTEM = "you are a captain"


class Response:
    """Status, headers and JSON of a plain HTTP exchange (urllib: no extra client)."""

    def __init__(self, status: int, body: bytes):
        self.status_code, self.text = status, body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body: bytes | None = None, timeout: float = 30) -> Response:
    headers = {"content-type": "application/json"} if body is not None else {}
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Response(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, e.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``mlx-stream serve`` subprocess on 127.0.0.1."""

    def __init__(self, model_dir, *args: str, port: int | None = None, greedy: bool = True):
        self.port = port or free_port()  # a given port: a restart at the same address
        self.url = f"http://127.0.0.1:{self.port}"
        if greedy and "--temp" not in args:  # requests without a temperature: greedy
            args = (*args, "--temp", "0", "--repetition-penalty", "1")
        cmd = [sys.executable, "-c", "from cli.main import main; main()", "serve", "-m",
               str(model_dir), "--port", str(self.port), *args]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []  # its stderr (the access log), read as it comes
        self.reader = reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                reader.join(timeout=5)
                raise RuntimeError(f"serve exited: {self.log()}")
            try:
                if http("GET", self.url + "/health", timeout=1).status_code == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError("serve did not start within 60 s")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def _read(self) -> None:
        for line in self.proc.stderr:  # a full pipe would block the server's writes
            self.lines.append(line)

    def log(self) -> str:
        """What the server wrote to stderr so far."""
        return "".join(self.lines)

    def get(self, path: str) -> dict:
        return http("GET", self.url + path, timeout=10).json()

    def sessions(self) -> dict[str, dict]:
        return {s["id"]: s for s in self.get("/v1/sessions")["data"]}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=5)  # the last lines it wrote


def chat(server, messages, **kw):
    return server.client.chat.completions.create(model="tiny-llama", messages=messages, **kw)


def conversation(*turns: str, system: str | None = SYSTEM) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": t} for t in turns]
