"""The real coding agents on ``mlx-stream serve``: Claude Code (``claude -p``, Anthropic's
Messages API) and Codex CLI (``codex exec``, OpenAI's Responses API), installed from npm
and driven as their users drive them, against a real server started with its default
settings (only the model folder and a free port are passed) and the embedded default
model.

Each run must exit 0 with a non-empty reply, and every request the server got must have
been answered 2xx and logged (the server's access log on stderr, see
:func:`failed_requests`). A turn that asks for a shell command records whether the
135M model did call the CLI's shell tool (it may not: it is asked to copy one call);
when it did, the CLI must have run it and the follow-up turn (carrying the tool's
output) must have been answered too. The CLIs' total request timeouts are raised (a
prefill of ~20k tokens on a CPU takes minutes) but their stream idle timeouts are
theirs (300 s): keeping a stream alive through a long prefill is the server's job.

The CLIs come from ``$MLX_STREAM_AGENT_CLIS``, an npm prefix holding
``node_modules/.bin/claude`` and ``node_modules/.bin/codex`` (``.ci/agents`` installs
them); without it these tests are skipped. Their request bodies, captured once, are in
``tests/fixtures/agents/``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support.server import Server

pytestmark = [pytest.mark.agents, pytest.mark.real_model, pytest.mark.slow]

CLIS_ENV = "MLX_STREAM_AGENT_CLIS"
# One CLI run, seconds: Claude Code's first request is ~21k tokens of system prompt and
# tools, Codex's ~10k, all prefilled on a CPU.
RUN_TIMEOUT = 1800
CLAUDE_MAX_OUTPUT = 1024  # tokens a Claude Code reply may take (its own default: 32,000)
PLAIN_PROMPT = "Reply with one short sentence: what is 2+2?"
# The 135M model rarely calls a tool when asked in words ("Run `echo hello` using the
# Bash tool" gets a code block); asked to copy a call in the convention serve gives a
# template without tool support (Hermes' <tool_call> JSON), it calls it, and answers the
# tool's output with text (measured on Codex's request: one call, then a text reply).
TOOL_PROMPT = 'Reply with exactly this line and nothing else: <tool_call>{{"name": "{name}", "arguments": {{"{arg}": "echo hello"}}}}</tool_call>'  # fmt: skip
CLAUDE_TOOL_PROMPT = TOOL_PROMPT.format(name="Bash", arg="command")  # Claude Code's shell tool
CODEX_TOOL_PROMPT = TOOL_PROMPT.format(name="exec_command", arg="cmd")  # Codex's

# One access-log line: method, path, then the status as the next field (mlx-stream's
# "HH:MM:SS POST /v1/messages 200 session=..." and uvicorn's '"POST /x HTTP/1.1" 200 OK').
ACCESS_LINE = re.compile(
    r'\b(GET|POST|HEAD|PUT|PATCH|DELETE|OPTIONS) (/\S*)(?: HTTP/[\d.]+"?)? ([1-5]\d\d)\b'
)
SESSION = re.compile(r"\bsession=(\w+)")
# Environment variables of the caller that must not reach the CLIs (a real key, another
# base URL, a user's own config home).
FOREIGN_ENV = ("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_")


# ------------------------------------------------------------------ the server's log


def access_lines(lines: list[str]) -> list[tuple[str, str, int, str]]:
    """``(method, path, status, line)`` of each access-log line among ``lines``."""
    found = []
    for line in lines:
        m = ACCESS_LINE.search(line)
        if m:
            found.append((m.group(1), m.group(2), int(m.group(3)), line.rstrip()))
    return found


def failed_requests(lines: list[str]) -> list[str]:
    """The access-log lines whose status is not 2xx (4xx, 5xx; 499: the client left)."""
    return [line for _, _, status, line in access_lines(lines) if not 200 <= status < 300]


class ServerLog:
    """The server's stderr lines (``Server`` reads its pipe as the lines come);
    :meth:`mark` / :meth:`since` give one test's share."""

    def __init__(self, server: Server):
        self.lines = server.lines  # appended to by the server's reader thread
        self._lock = threading.Lock()  # list appends are atomic: it only orders reads

    def mark(self) -> int:
        with self._lock:
            return len(self.lines)

    def since(self, mark: int, quiet: float = 3.0, limit: float = 60.0) -> list[str]:
        """The lines from ``mark`` on, once the server has settled: a request's line is
        written when its response's body has ended, which may be after the client has
        read its last event. Waits until every session a progress line named has its
        status line and nothing new came for ``quiet`` seconds (at most ``limit``)."""
        start = last = time.monotonic()
        count = -1
        while True:
            with self._lock:
                lines = list(self.lines[mark:])
            now = time.monotonic()
            if len(lines) != count:
                count, last = len(lines), now
            done = {m.group(1) for m in map(SESSION.search, (e[3] for e in access_lines(lines)))
                    if m}  # fmt: skip
            going = {m.group(1) for m in map(SESSION.search, lines) if m} - done
            if (not going and now - last >= quiet) or now - start >= limit:
                return lines
            time.sleep(0.25)

    def logs_requests(self) -> bool:
        """Whether the server writes an access log (its startup's /health polls are in it)."""
        with self._lock:
            return bool(access_lines(self.lines))


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    """``{"claude": path, "codex": path}`` from ``$MLX_STREAM_AGENT_CLIS``, else skip."""
    prefix = os.environ.get(CLIS_ENV)
    if not prefix:
        pytest.skip(f"${CLIS_ENV} is not set (an npm prefix with @anthropic-ai/claude-code "
                    "and @openai/codex; .ci/agents installs them)")  # fmt: skip
    found = {name: Path(prefix) / "node_modules" / ".bin" / name for name in ("claude", "codex")}
    missing = [str(p) for p in found.values() if not os.access(p, os.X_OK)]
    if missing:
        message = f"${CLIS_ENV}={prefix} lacks {', '.join(missing)}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)  # CI installed them (.ci/agents): their absence is a bug
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def served(clis, real_model_path):
    """``(server, log, model name)``: ``mlx-stream serve`` with its default settings."""
    server = Server(real_model_path, greedy=False)  # only -m and --port: all else its default
    server.home = os.environ["MLX_STREAM_HOME"]  # its user folder: its prefix store's
    log = ServerLog(server)
    model = server.get("/v1/models")["data"][0]["id"]
    yield server, log, model
    server.stop()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_ENV)}
    env.update(extra)
    return env


class Run:
    """One CLI run: exit code, stdout, stderr, seconds, and the server's lines meanwhile."""

    def __init__(self, cmd: list[str], env: dict, cwd: Path, log: ServerLog):
        self.mark, start = log.mark(), time.monotonic()
        try:
            done = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=RUN_TIMEOUT)  # fmt: skip
            self.code, self.stdout, self.stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as e:
            self.code = None
            self.stdout = _text(e.stdout)
            self.stderr = _text(e.stderr) + f"\n(killed after {RUN_TIMEOUT} s)"
        self.seconds = time.monotonic() - start
        self.log, self.server_lines = log, log.since(self.mark)

    def explain(self) -> str:
        tail = "".join(self.server_lines[-40:])
        return (f"exit {self.code} after {self.seconds:.0f} s\n--- stdout\n{self.stdout[-4000:]}"
                f"\n--- stderr\n{self.stderr[-4000:]}\n--- server stderr (tail)\n{tail}")  # fmt: skip

    def check_server(self, path: str, at_least: int) -> list[tuple[str, str, int, str]]:
        """Every request answered 2xx, and (when the server writes an access log) at
        least ``at_least`` requests to ``path`` logged; returns their access lines."""

        def logged() -> list[tuple[str, str, int, str]]:
            return [e for e in access_lines(self.server_lines) if e[1].startswith(path)]

        deadline = time.monotonic() + 60  # a line may come late: give it a minute
        while (self.log.logs_requests() and len(logged()) < at_least
               and time.monotonic() < deadline):  # fmt: skip
            time.sleep(1)
            self.server_lines = self.log.since(self.mark, quiet=0)
        assert failed_requests(self.server_lines) == [], self.explain()
        if self.log.logs_requests():
            assert len(logged()) >= at_least, f"{at_least} requests made\n" + self.explain()
        return logged()


def _text(data) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


def _jsonl(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def _report(what: str, run: Run, **facts) -> None:
    extra = "".join(f", {k}={v}" for k, v in facts.items())
    print(f"[agents] {what}: exit {run.code} in {run.seconds:.1f} s{extra}")


# ------------------------------------------------------------------- Claude Code


def claude(clis, served, tmp_path, prompt: str, *args: str) -> tuple[Run, list[dict]]:
    """``claude -p PROMPT`` as a user runs it against the server (a throwaway HOME in
    ``tmp_path``, kept by a later run in the same ``tmp_path``); returns the run and its
    stream-json events."""
    server, log, model = served
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = clean_env(
        HOME=str(home),
        ANTHROPIC_BASE_URL=server.url,
        ANTHROPIC_API_KEY="none",
        ANTHROPIC_SMALL_FAST_MODEL=model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=model,
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        API_TIMEOUT_MS=str(RUN_TIMEOUT * 1000),  # a long prefill is no timeout
        CLAUDE_CODE_MAX_RETRIES="0",  # a failed request fails the run at once
        # Claude Code asks for 32,000 tokens a reply; a 135M model that does not stop
        # would take hours of CPU decode to reach it. Its users cap it the same way.
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(CLAUDE_MAX_OUTPUT),
    )  # its stream idle timeout stays Claude Code's: the server keeps a stream alive
    cmd = [str(clis["claude"]), "-p", prompt, "--model", model,
           "--output-format", "stream-json", "--verbose", *args]  # fmt: skip
    run = Run(cmd, env, work, log)
    return run, _jsonl(run.stdout)


def claude_result(run: Run, events: list[dict]) -> dict:
    results = [e for e in events if e.get("type") == "result"]
    assert run.code == 0 and results, run.explain()
    result = results[-1]
    assert result.get("is_error") is False and result.get("subtype") == "success", run.explain()
    assert (result.get("result") or "").strip(), run.explain()
    return result


def claude_blocks(events: list[dict], role: str, kind: str) -> list[dict]:
    return [
        block
        for e in events
        if e.get("type") == role
        for block in (e.get("message") or {}).get("content") or []
        if isinstance(block, dict) and block.get("type") == kind
    ]


def answered(events: list[dict]) -> int:
    """How many of Claude Code's requests were answered: its replies' message ids."""
    return len({(e.get("message") or {}).get("id") for e in events if e.get("type") == "assistant"})


def test_claude_code_answers_a_question(clis, served, tmp_path):
    run, events = claude(clis, served, tmp_path, PLAIN_PROMPT)
    result = claude_result(run, events)
    calls = run.check_server("/v1/messages", answered(events))
    _report("claude plain", run, requests=len(calls), reply=repr(result["result"][:80]))


def test_claude_code_runs_a_tool_and_answers_the_result(clis, served, tmp_path):
    run, events = claude(clis, served, tmp_path, CLAUDE_TOOL_PROMPT, "--allowedTools", "Bash")
    result = claude_result(run, events)
    calls = run.check_server("/v1/messages", answered(events))
    uses = claude_blocks(events, "assistant", "tool_use")
    results = claude_blocks(events, "user", "tool_result")
    if uses:  # the model called a tool: the CLI answered each call, then asked again
        assert len(results) >= len(uses), run.explain()
        assert result.get("num_turns", 0) >= 2 and answered(events) >= 2, run.explain()
        for use, res in zip(uses, results):
            if use.get("name") == "Bash" and "echo hello" in json.dumps(use.get("input")):
                assert "hello" in json.dumps(res.get("content")), run.explain()
    _report("claude tool", run, requests=len(calls), tool_calls=[u.get("name") for u in uses],
            tool_inputs=[u.get("input") for u in uses], reply=repr(result["result"][:80]))  # fmt: skip


TTFT = re.compile(r"ttft=([\d.]+)s")


def first_request(run: Run, path: str = "/v1/messages") -> tuple[int, int, float]:
    """``(fed, cached, ttft seconds)`` of the run's first answered request to ``path``
    that fed more than a title's worth (Claude Code also asks for a short title)."""
    answered = re.compile(rf"POST {path}\S* 200 .*fed=([\d,]+) cached=([\d,]+)")
    lines = [m for line in run.server_lines for m in [answered.search(line)] if m]
    fed, cached, line = max(((int(m[1].replace(",", "")), int(m[2].replace(",", "")),
                              m.string) for m in lines), key=lambda f: f[0] + f[1])  # fmt: skip
    return fed, cached, float(TTFT.search(line)[1])


def test_a_second_claude_run_starts_from_the_first_runs_prefill(clis, served, real_model_path,
                                                                tmp_path, monkeypatch):  # fmt: skip
    """Two `claude -p` runs in one folder, then a third after the server restarted: the
    later runs find Claude Code's system prompt and tools (~19k tokens) prefilled, in
    the server and then in the prefix store on disk, and feed only their messages."""
    runs = [claude(clis, served, tmp_path, PLAIN_PROMPT)[0] for _ in range(2)]
    monkeypatch.setenv("MLX_STREAM_HOME", served[0].home)  # the same user: the same store
    restarted = Server(real_model_path, greedy=False)
    try:
        again = (restarted, ServerLog(restarted), served[2])
        runs.append(claude(clis, again, tmp_path, PLAIN_PROMPT)[0])
    finally:
        restarted.stop()
    firsts = []
    for run in runs:
        assert run.code == 0, run.explain()
        run.check_server("/v1/messages", 1)
        firsts.append(first_request(run))
    prompt = firsts[0][0] + firsts[0][1]
    for fed, cached, _ in firsts[1:]:
        assert cached >= 10_000 and fed < prompt - 10_000, firsts
    _report("claude again", runs[1], first=firsts[0], second=firsts[1], restarted=firsts[2],
            ttft_ratios=[round(firsts[0][2] / f[2], 1) for f in firsts[1:]])  # fmt: skip


# ------------------------------------------------------------------------- Codex


def codex(clis, served, tmp_path, prompt: str) -> tuple[Run, list[dict], str]:
    """``codex exec PROMPT`` with a CODEX_HOME whose config.toml names the server as a
    Responses API provider; returns the run, its --json events and its last message."""
    server, log, model = served
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir(exist_ok=True)  # a later run in the same tmp_path: the same folders
    work.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "mlx-stream"\n\n'
        "[model_providers.mlx-stream]\n"
        'name = "mlx-stream"\n'
        f'base_url = "{server.url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "MLX_STREAM_AGENT_KEY"\n'
        "request_max_retries = 0\n"  # a failed request fails the run at once
        "stream_max_retries = 0\n"
    )  # stream_idle_timeout_ms stays Codex's (300 s): the server keeps a stream alive
    env = clean_env(HOME=str(tmp_path), CODEX_HOME=str(home), MLX_STREAM_AGENT_KEY="none")
    last = tmp_path / "last-message.txt"
    last.unlink(missing_ok=True)  # a reply is this run's, never an earlier one's
    cmd = [str(clis["codex"]), "exec", "--skip-git-repo-check", "--ephemeral", "--json",
           "--dangerously-bypass-approvals-and-sandbox", "-o", str(last), prompt]  # fmt: skip
    run = Run(cmd, env, work, log)
    reply = last.read_text() if last.exists() else ""
    return run, _jsonl(run.stdout), reply


def codex_items(events: list[dict], kind: str) -> list[dict]:
    return [
        e["item"]
        for e in events
        if e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == kind
    ]


def codex_check(run: Run, events: list[dict], reply: str) -> None:
    assert run.code == 0, run.explain()
    assert not [e for e in events if e.get("type") in ("turn.failed", "error")], run.explain()
    assert any(e.get("type") == "turn.completed" for e in events), run.explain()
    assert reply.strip(), run.explain()


def test_codex_answers_a_question(clis, served, tmp_path):
    run, events, reply = codex(clis, served, tmp_path, PLAIN_PROMPT)
    codex_check(run, events, reply)
    calls = run.check_server("/v1/responses", 1)
    _report("codex plain", run, requests=len(calls), reply=repr(reply[:80]))


def test_a_second_codex_run_starts_from_the_first_runs_prefill(clis, served, real_model_path,
                                                               tmp_path, monkeypatch):  # fmt: skip
    """Two `codex exec` runs, then a third after the server restarted: the later runs
    find Codex's instructions and tools (~6k tokens) prefilled, in the server and then
    in the prefix store on disk, and feed only their messages."""
    runs = [codex(clis, served, tmp_path, PLAIN_PROMPT) for _ in range(2)]
    monkeypatch.setenv("MLX_STREAM_HOME", served[0].home)  # the same user: the same store
    restarted = Server(real_model_path, greedy=False)
    try:
        again = (restarted, ServerLog(restarted), served[2])
        runs.append(codex(clis, again, tmp_path, PLAIN_PROMPT))
    finally:
        restarted.stop()
    firsts = []
    for run, events, reply in runs:
        codex_check(run, events, reply)
        run.check_server("/v1/responses", 1)
        firsts.append(first_request(run, "/v1/responses"))
    prompt = firsts[0][0] + firsts[0][1]
    for fed, cached, _ in firsts[1:]:
        assert cached >= 3_000 and fed < prompt - 3_000, firsts
    _report("codex again", runs[1][0], first=firsts[0], second=firsts[1], restarted=firsts[2],
            ttft_ratios=[round(firsts[0][2] / f[2], 1) for f in firsts[1:]])  # fmt: skip


def test_codex_runs_a_tool_and_answers_the_result(clis, served, tmp_path):
    run, events, reply = codex(clis, served, tmp_path, CODEX_TOOL_PROMPT)
    codex_check(run, events, reply)
    commands = codex_items(events, "command_execution")
    calls = run.check_server("/v1/responses", 2 if commands else 1)  # a call, then its answer
    tools = [i for e in events for i in [e.get("item") or {}]
             if e.get("type") == "item.completed" and i.get("type") not in
             ("agent_message", "reasoning", "error")]  # fmt: skip
    if commands:  # the model called the shell tool: the CLI ran it, then asked again
        for item in commands:
            assert item.get("status") in ("completed", "failed", "declined"), run.explain()
            if "echo hello" in (item.get("command") or ""):
                assert "hello" in (item.get("aggregated_output") or ""), run.explain()
    _report("codex tool", run, requests=len(calls), tool_items=[i.get("type") for i in tools],
            commands=[c.get("command") for c in commands], reply=repr(reply[:80]))  # fmt: skip
