"""``serve`` on a machine that also browses the web: cross-site requests, DNS rebinding,
half-sent connections, control characters in the log, and what a caller without a key
is told. A real server process on a loopback port, driven with plain HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import time
from types import SimpleNamespace

import pytest

from tests.support.server import Server

ALLOWED = "https://allowed.example"
HI = [{"role": "user", "content": "hi"}]
CHAT = json.dumps({"messages": HI, "max_tokens": 2})


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server(
        tiny_model_dir, "--window", "64", "--max-tokens", "4", "--cors-origin", ALLOWED,
        "--max-connections", "8", "--header-timeout", "2",
    )  # fmt: skip
    yield s
    s.stop()


def send(server, method: str, path: str, body: str | None = None, **headers: str):
    """``(status, headers, body)`` of one request; ``headers`` with ``_`` for ``-``,
    ``content_type`` defaulting to JSON for a body."""
    given = {k.replace("_", "-"): v for k, v in headers.items()}
    if body is not None:
        given.setdefault("content-type", "application/json")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=given)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def sessions(server) -> int:
    return len(server.get("/v1/sessions")["data"])


def one_line(body: bytes) -> str:
    message = json.loads(body)["error"]["message"]
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ cross-site


def test_a_page_of_another_site_cannot_post_even_as_plain_text(server):
    before = sessions(server)
    for kind in ("text/plain", "application/json"):
        status, _, body = send(
            server, "POST", "/v1/chat/completions", CHAT, origin="https://evil.example",
            content_type=kind,
        )  # fmt: skip
        assert status == 403 and "--cors-origin" in one_line(body)
    status, _, _ = send(server, "GET", "/v1/sessions", origin="null")  # a sandboxed page
    assert status == 403
    assert sessions(server) == before  # nothing ran


def test_the_servers_own_page_and_clients_without_an_origin_are_served(server):
    own = f"http://127.0.0.1:{server.port}"
    assert send(server, "POST", "/v1/chat/completions", CHAT, origin=own)[0] == 200
    local = f"http://localhost:{server.port}"
    assert send(server, "POST", "/v1/chat/completions", CHAT, origin=local,
                host=f"localhost:{server.port}")[0] == 200  # fmt: skip
    assert send(server, "POST", "/v1/chat/completions", CHAT)[0] == 200  # curl, SDKs


def test_an_allowed_origin_gets_cors_and_its_preflight_is_answered(server):
    status, headers, _ = send(
        server, "OPTIONS", "/v1/chat/completions", origin=ALLOWED,
        access_control_request_method="POST",
        access_control_request_headers="content-type, authorization",
    )  # fmt: skip
    assert status == 204
    assert headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "content-type, authorization"
    status, headers, body = send(server, "POST", "/v1/chat/completions", CHAT, origin=ALLOWED)
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED
    assert "X-Session-ID" in headers["access-control-expose-headers"]
    status, headers, _ = send(
        server, "OPTIONS", "/v1/chat/completions", origin="https://evil.example",
        access_control_request_method="POST",
    )  # fmt: skip
    assert status == 403 and "access-control-allow-origin" not in headers


def test_the_chat_page_sends_json():
    from importlib import resources

    script = resources.files("mlx_stream.serve").joinpath("ui/app.js").read_text()
    assert '"Content-Type": "application/json"' in script


# ------------------------------------------------------------------ rebinding


def test_a_host_that_is_not_this_machine_is_421(server):
    port = server.port
    for host in (f"evil.example:{port}", "evil.example", f"192.168.1.9:{port}"):
        status, _, body = send(server, "GET", "/v1/sessions", host=host)
        assert status == 421 and "--allowed-host" in one_line(body)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert send(server, "GET", "/v1/sessions", host=host)[0] == 200, host


def test_browsers_policy_for_each_bind():
    from mlx_stream.serve.guard import Browsers, host_name, same_origin

    assert [host_name(h) for h in ("[::1]:80", "LocalHost:8080", "a.example.", "::1")] == [
        "::1", "localhost", "a.example", "::1"
    ]  # fmt: skip
    assert Browsers.make("192.168.1.5").host_ok("192.168.1.5:8080")
    assert not Browsers.make("0.0.0.0").host_ok("192.168.1.5:8080")
    assert Browsers.make("0.0.0.0", keyed=True).host_ok("any.name:8080")
    assert Browsers.make("0.0.0.0", allowed_hosts=["box.lan"]).host_ok("box.lan:8080")
    assert same_origin("http://127.0.0.1:8080/", "127.0.0.1:8080")
    assert not same_origin("http://127.0.0.1:9999", "127.0.0.1:8080")


# ------------------------------------------------------------------ connections


def half_sent(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # never finished
    return sock


def closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_half_sent_requests_never_hold_health_or_the_file_limit(server):
    fds = f"/proc/{server.proc.pid}/fd"
    held = [half_sent(server.port) for _ in range(40)]  # 5x the cap of 8
    try:
        start = time.monotonic()
        assert send(server, "GET", "/health")[0] == 200
        assert time.monotonic() - start < 2  # well before the header timeout
        if os.path.isdir(fds):
            assert len(os.listdir(fds)) < 8 + 40  # the oldest were closed, not kept
        assert closed(held[0], within=1)  # the oldest went first
    finally:
        for sock in held:
            sock.close()


def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    sock = half_sent(server.port)
    try:
        start = time.monotonic()
        assert closed(sock, within=10)
        assert 1.5 < time.monotonic() - start < 6  # --header-timeout 2
    finally:
        sock.close()


# ------------------------------------------------------------------ the log


def test_control_characters_from_a_request_never_reach_the_log_raw(server):
    send(server, "GET", "/v1/nothing%0a12:00:00%20GET%20/forged%20200%1b[31m%C2%85")
    deadline = time.monotonic() + 5
    while "/v1/nothing" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(ln for ln in server.log().splitlines() if "/v1/nothing" in ln)
    assert "\\n12:00:00 GET /forged 200\\x1b[31m\\x85" in line
    assert "\x1b" not in server.log() and "\x85" not in server.log()
    assert not any(ln.startswith("12:00:00 GET /forged") for ln in server.log().splitlines())


def test_clean_escapes_every_control_character():
    from mlx_stream.serve.accesslog import Record, clean

    assert clean("a\nb\rc\td\x00\x1b\x7f\x9f é") == "a\\nb\\rc\\td\\x00\\x1b\\x7f\\x9f é"
    assert clean("\u202eevil\u2028") == "\\u202eevil\\u2028"
    lines = []
    record = Record("POST", "/v1/messages", out=lines.append)
    record.notes.append("hosted tool web\nsearch\x1b[2J left out")
    record.finish()
    assert len(lines) == 1 and "\n" not in lines[0] and "\x1b" not in lines[0]


# ------------------------------------------------------------------ limits, /health


def test_max_tokens_has_a_ceiling_by_default(server):
    status, headers, _ = send(server, "POST", "/v1/chat/completions", CHAT)
    from mlx_stream.defaults import DEFAULT_MAX_TOKENS_CEILING

    assert status == 200 and headers["x-max-tokens-ceiling"] == str(DEFAULT_MAX_TOKENS_CEILING)


def fake_engine(encode=None):
    """What ``create_app`` reads of an engine, with a tokenizer whose ``encode`` is
    ``encode`` (no chat template)."""
    tokenizer = SimpleNamespace(encode=encode or (lambda text, **kw: text.split()))
    return SimpleNamespace(model_id="tiny", stats={"memory": {"budget_bytes": 1}},
                           tokenizer=tokenizer, max_tokens_ceiling=None)  # fmt: skip


def test_health_says_only_ok_without_a_key_when_keys_are_set():
    from fastapi.testclient import TestClient

    from mlx_stream.serve.app import create_app

    with TestClient(create_app(fake_engine(), api_keys=["k"], quiet=True)) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/health", headers={"authorization": "Bearer no"}).json() == {
            "status": "ok"
        }
        full = client.get("/health", headers={"authorization": "Bearer k"}).json()
        assert full["model"] == "tiny" and full["budget_bytes"] == 1
    with TestClient(create_app(fake_engine(), quiet=True)) as client:  # no keys: all
        assert client.get("/health").json()["model"] == "tiny"


async def asgi(app, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request straight to an ASGI app: ``(status, body)``."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
    }  # fmt: skip
    sent, given = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return given.pop(0) if given else await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_count_tokens_runs_off_the_event_loop():
    """A body that takes a second to count leaves /health answering meanwhile."""
    import mlx_stream.serve.tools  # noqa: F401 - imported as a running server has it
    from mlx_stream.serve.app import create_app

    def slow(text, **kw):
        time.sleep(1.0)
        return text.split()

    app = create_app(fake_engine(slow), quiet=True)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "a b c"}]})

    async def both():
        await asgi(app, "GET", "/health")  # the app's middleware built, as when serving
        counting = asyncio.ensure_future(
            asgi(app, "POST", "/v1/messages/count_tokens", body.encode())
        )
        await asyncio.sleep(0.2)
        start = time.monotonic()
        health = await asgi(app, "GET", "/health")
        waited = time.monotonic() - start
        return await counting, health[0], waited

    (status, counted), health, waited = asyncio.run(both())
    assert status == 200 and json.loads(counted)["input_tokens"] == 3 and health == 200
    assert waited < 0.5


def test_a_wildcard_bind_without_a_key_warns_and_answers_loopback_names_only(tiny_model_dir):
    s = Server(tiny_model_dir, "--host", "0.0.0.0", "--window", "64", "--max-tokens", "2")
    try:
        assert "warning: --host 0.0.0.0 without --api-key" in s.log()
        assert send(s, "GET", "/v1/models", host=f"192.168.1.9:{s.port}")[0] == 421
        assert send(s, "GET", "/v1/models", host=f"127.0.0.1:{s.port}")[0] == 200
    finally:
        s.stop()


# ------------------------------------------------------------------ a real browser

ATTACKER = """<!doctype html><script>
window.results = {};
(async () => {
  const target = "http://127.0.0.1:PORT", body = JSON.stringify({messages: [{role: "user",
    content: "from another site"}], max_tokens: 2});
  try {
    await fetch(target + "/v1/chat/completions", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body});
    results.nocors = "sent";
  } catch (e) { results.nocors = "error"; }
  for (const [name, init] of [["read", {}], ["json", {method: "POST", body,
      headers: {"Content-Type": "application/json"}}]]) {
    try { results[name] = (await fetch(target + (name == "read" ? "/v1/sessions" :
      "/v1/chat/completions"), init)).status; } catch (e) { results[name] = "blocked"; }
  }
  results.done = true;
})();
</script>"""


@pytest.fixture(scope="module")
def chromium():
    from tests.test_serve_ui import browser_missing

    if browser_missing():
        pytest.skip(browser_missing())
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--host-resolver-rules=MAP rebound.test 127.0.0.1"):  # fmt: skip
        options.add_argument(arg)
    d = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield d
    d.quit()


@pytest.fixture
def attacker(server, tmp_path):
    """A page on another origin (another port) that tries the server three ways."""
    import functools
    import http.server
    import threading

    (tmp_path / "evil.html").write_text(ATTACKER.replace("PORT", str(server.port)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://localhost:{httpd.server_address[1]}/evil.html"
    httpd.shutdown()


def test_a_page_of_another_site_in_chromium_runs_nothing_and_reads_nothing(
    server, chromium, attacker
):
    from selenium.webdriver.support.ui import WebDriverWait

    before = sessions(server)
    chromium.get(attacker)
    results = WebDriverWait(chromium, 30).until(
        lambda d: d.execute_script("return window.results.done && window.results")
    )
    assert results["read"] == "blocked" and results["json"] == "blocked", results
    assert sessions(server) == before  # the no-cors text/plain POST ran nothing
    assert "POST /v1/chat/completions 403" in server.log()


def test_a_name_rebound_to_this_machine_reads_nothing_in_chromium(server, chromium):
    chromium.get(f"http://rebound.test:{server.port}/v1/sessions")
    text = chromium.find_element("tag name", "body").text
    assert "--allowed-host" in text and '"data"' not in text, text


def test_the_default_budget_holds_a_few_sessions_not_the_machine(server, loaded):
    from mlx_stream.cache import CacheSpec
    from mlx_stream.defaults import DEFAULT_PIN_TOKENS
    from mlx_stream.serve import admission

    model, _ = loaded
    per = admission.token_bytes(model, CacheSpec(sinks=4, window=64))
    session = (4 + DEFAULT_PIN_TOKENS + 64) * per
    want = admission.weights_bytes(model) + (admission.COPIES * admission.AUTO_SESSIONS + 2) * session
    assert server.get("/health")["budget_bytes"] == want  # --window 64, --memory-budget auto
    assert want < admission.physical_memory() * 0.75
