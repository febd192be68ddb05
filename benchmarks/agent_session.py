"""A real coding-agent session replayed side by side on ``mlx-stream serve``, vllm-mlx
and ``mlx_lm.server``: time to first token per step kind, tokens computed, memory.

The session is ``agent_script.py``'s: Claude Code's real first request, then one step
per request the way the client sends them (tool calls reading this repository's files,
the whole transcript resent, ``<system-reminder>`` blocks that change, ``cache_control``
markers), with the prefix shifts agents make (results cleared, a compaction, an edited
message, forks, a second session, a server restart). Assistant turns are scripted, so
every server gets the same requests. Servers run at once and take each step in turn
(interleaved: machine noise hits all alike), the same float32 weights (a dequantized
copy of ``--model`` that all three load), greedy, the same ``max_tokens``.

Routes: mlx-stream and vllm-mlx get the Anthropic Messages body as Claude Code sends it;
``mlx_lm.server``, which serves no Messages API, gets the same conversation on its
OpenAI chat route, rendered as our server renders tools for a template without them
(Hermes' ``<tools>``/``<tool_call>``/``<tool_response>``), so its prompt is the same text.

Per request: its kind, status, prompt tokens, the tokens the server says were cached
(where it says), time to the first streamed token (the first non-empty delta: pings
and empty deltas while a long prompt goes in do not count) and total time. Per server:
summed and per-kind time to first token, RSS and MLX active memory sampled in the
server process every 0.5 s, bytes its caches left on disk, failures. Then
``--concurrent`` sessions at once per server (aggregate throughput, summed time to first
token). One JSON line per server and phase and a summary with the ratios.

    python benchmarks/agent_session.py --tools 3 --system-chars 3000 --steps 32 \
        --plot benchmarks/results/agent_session/memory.png
    python benchmarks/agent_session.py --quick --servers mlx-stream   # a smoke test

vllm-mlx runs from its own virtual environment (``--vllm``, the path of its
``vllm-mlx`` command): it pulls torch and an older mlx-lm, so never into this one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import common
import server as server_bench
from agent_script import TASKS, Conversation, Step, base_request, plan, sources
from server import SAMPLER, free_port

SERVERS = ("mlx-stream", "vllm-mlx", "mlx-lm")
# vllm-mlx's configuration for agents (its docs: prefix cache on by default, batching,
# the SSD tier); --vllm-flags changes it.
VLLM_FLAGS = "--continuous-batching --use-paged-cache --enable-prefix-cache --ssd-cache-dir {cache}"
# Runs inside each server process (server.SAMPLER samples its memory), then the server.
WRAPPER = (
    SAMPLER
    + r"""
if kind == "mlx-lm":
    import runpy
    sys.argv = ["mlx_lm.server", *args]
    runpy.run_module("mlx_lm.server", run_name="__main__")
elif kind == "vllm-mlx":
    from vllm_mlx.cli import main
    sys.argv = ["vllm-mlx", "serve", *args]
    main()
else:
    from cli.main import main
    sys.argv = ["mlx-stream", "serve", *args]
    main()
"""
)
TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)


class Server:
    """One contender: its process (restartable), its port, its caches' folder."""

    def __init__(self, kind: str, model_dir: str, root: Path, args):
        self.kind, self.model_dir, self.args = kind, model_dir, args
        self.port = free_port()
        self.root = root / kind
        self.cache_dir = self.root / "cache"
        self.cache_dir.mkdir(parents=True)
        self.samples = self.root / "memory.txt"
        self.log = open(self.root / "server.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc: subprocess.Popen | None = None
        self.model_id = model_dir

    def command(self) -> tuple[list[str], dict]:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(common.REPO))
        port = str(self.port)
        if self.kind == "mlx-stream":  # as it starts: no flags but where its files live
            # (its prefix store; its state folder, temporary by default, where SIGTERM
            # saves the sessions for the restart step, as vllm-mlx's --ssd-cache-dir)
            state = self.cache_dir / "sessions"
            state.mkdir(exist_ok=True)
            flags = ["-m", self.model_dir, "--port", port, "--prefix-store", str(self.cache_dir),
                     "--state-dir", str(state)]  # fmt: skip
            return [sys.executable, "-c", WRAPPER, str(self.samples), self.kind, *flags], env
        if self.kind == "mlx-lm":
            flags = ["--model", self.model_dir, "--port", port, "--log-level", "WARNING"]
            return [sys.executable, "-c", WRAPPER, str(self.samples), self.kind, *flags], env
        python = str(Path(self.args.vllm).parent / "python")
        blas = common.blas.active_blas()
        if blas:
            env["LD_PRELOAD"] = blas
        flags = [self.model_dir, "--port", port, "--offline",
                 *shlex.split(self.args.vllm_flags.replace("{cache}", str(self.cache_dir)))]  # fmt: skip
        env.pop("PYTHONPATH")
        env["HOME"] = str(self.cache_dir)  # its prefix cache goes under ~/.cache: counted
        return [python, "-c", WRAPPER, str(self.samples), self.kind, *flags], env

    def start(self) -> None:
        cmd, env = self.command()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.kind} exited with {self.proc.returncode}: {self.root}")
            if self.kind == "mlx-lm":  # its /v1/models lists the Hugging Face cache
                self.model_id = "default_model"
                if up(f"{self.url}/health"):
                    return
            elif self.kind == "vllm-mlx" and up(f"{self.url}/health"):
                return
            elif self.kind == "mlx-stream" and up(f"{self.url}/health"):
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as r:
                    self.model_id = json.load(r)["data"][0]["id"]
                return
            time.sleep(0.5)
        raise SystemExit(f"{self.kind} did not start in 600 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.cache_dir.rglob("*") if f.is_file())

    def memory(self, since: float) -> list[tuple[float, float, float]]:
        """``(seconds since since, RSS MB, MLX active MB)`` samples."""
        rows = []
        for line in self.samples.read_text().splitlines():
            t, rss, active = map(float, line.split())
            if t >= since:
                rows.append((round(t - since, 1), round(rss / 1e6, 1), round(active / 1e6, 1)))
        return rows

    def send(self, step: Step) -> dict:
        """One streamed request: status, prompt and cached tokens, time to first token."""
        headers = {"content-type": "application/json", "x-api-key": "none",
                   "anthropic-version": "2023-06-01", **step.headers}  # fmt: skip
        if self.kind == "mlx-lm" or (self.kind == "vllm-mlx" and self.args.vllm_route == "openai"):
            body, path = openai_body(step.body, self.model_id), "/v1/chat/completions"
        elif self.kind == "mlx-stream" and self.args.route == "responses":  # as Codex sends it
            body, path = responses_body(step.body, self.model_id), "/v1/responses"
            headers = {"content-type": "application/json", "authorization": "Bearer none",
                       "session-id": next(iter(step.headers.values()), "")}  # fmt: skip
        else:
            body, path = {**step.body, "model": self.model_id}, "/v1/messages"
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), headers)
        logged = self.log_size()
        tic = time.perf_counter()
        row: dict = {"kind": step.kind, "session": step.conversation, "status": None}
        first = None
        try:
            with urllib.request.urlopen(req, timeout=self.args.timeout) as r:
                row["status"] = r.status
                for event in sse(r):
                    if first is None and has_text(event):
                        first = time.perf_counter()
                    usage_fields(event, row)
        except urllib.error.HTTPError as exc:
            row["status"], row["error"] = exc.code, exc.read().decode(errors="replace")[:300]
        except OSError as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        done = time.perf_counter()
        row["ttft_s"] = round((first or done) - tic, 3)
        row["total_s"] = round(done - tic, 3)
        if first is None and "error" not in row:
            row["error"] = "no token streamed"
        if self.kind == "vllm-mlx":  # its log says what its scheduler prefilled
            self.logged_counts(logged, row)
        return row

    def log_size(self) -> int:
        self.log.flush()
        return (self.root / "server.log").stat().st_size

    def logged_counts(self, since: int, row: dict) -> None:
        """vllm-mlx's ``[schedule] ... prompt_tokens=N tokens_to_prefill=M`` lines
        written during the request: its prompt and cached tokens (N - M)."""
        with open(self.root / "server.log", "rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
        found = re.findall(r"prompt_tokens=(\d+) tokens_to_prefill=(\d+)", text)
        if found:
            prompt, fed = map(int, found[-1])
            row["prompt_tokens"], row["cached_tokens"] = prompt, prompt - fed


def up(url: str) -> bool:
    """Whether a server answers ``url`` with 200."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def sse(response):
    """The JSON payload of each server-sent event of a streamed response."""
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                try:
                    yield json.loads(data)
                except ValueError:
                    continue


def has_text(event: dict) -> bool:
    """Whether ``event`` carries the reply's first text or tool call (Anthropic,
    OpenAI chat or Responses streams; empty keep-alive deltas do not count)."""
    kind = event.get("type", "")
    if kind in ("response.output_text.delta", "response.reasoning_text.delta"):
        return bool(event.get("delta"))
    if kind == "response.output_item.added":
        return event.get("item", {}).get("type") == "function_call"
    if event.get("type") == "content_block_delta":
        d = event.get("delta", {})
        return bool(d.get("text") or d.get("partial_json") or d.get("thinking"))
    if event.get("type") == "content_block_start":
        return event.get("content_block", {}).get("type") == "tool_use"
    for choice in event.get("choices") or []:
        d = choice.get("delta") or {}
        if d.get("content") or d.get("tool_calls") or d.get("reasoning_content"):
            return True
    return False


def usage_fields(event: dict, row: dict) -> None:
    """Prompt and cached tokens from an Anthropic or OpenAI stream's usage."""
    usage = event.get("usage") or event.get("message", {}).get("usage")
    usage = usage or (event.get("response") or {}).get("usage")
    if not usage:
        return
    if "input_tokens_details" in usage:  # Responses: input_tokens are all of them
        row["prompt_tokens"] = usage["input_tokens"]
        row["cached_tokens"] = usage["input_tokens_details"].get("cached_tokens", 0)
    elif "input_tokens" in usage:  # Anthropic: input_tokens are the uncached ones
        cached = usage.get("cache_read_input_tokens") or 0
        if usage["input_tokens"] or cached:
            row["prompt_tokens"] = usage["input_tokens"] + cached
            row["cached_tokens"] = cached
    elif usage.get("prompt_tokens"):
        row["prompt_tokens"] = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            row["cached_tokens"] = details["cached_tokens"]
    if "output_tokens" in usage or "completion_tokens" in usage:
        row["output_tokens"] = usage.get("output_tokens", usage.get("completion_tokens"))


def block_text(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content if b.get("type") == "text")


def openai_body(body: dict, model: str) -> dict:
    """The Anthropic body as an OpenAI chat request whose rendered text is the same
    conversation: tools and calls written as Hermes' tags (the default model's template
    has no tool support; ``mlx-stream serve`` renders them so)."""
    tools = [{"type": "function", "function": {"name": t["name"],
              "description": t.get("description", ""), "parameters": t["input_schema"]}}
             for t in body.get("tools", [])]  # fmt: skip
    system = "\n\n".join(b["text"] for b in body["system"])
    if tools:
        system += "\n\n" + TOOLS_HEAD + "\n".join(json.dumps(t) for t in tools) + "\n</tools>"
    messages = [{"role": "system", "content": system}]
    for m in body["messages"]:
        if isinstance(m["content"], str):
            messages.append({"role": m["role"], "content": m["content"]})
            continue
        parts = []
        for b in m["content"]:
            if b["type"] == "text":
                parts.append(b["text"])
            elif b["type"] == "tool_use":
                call = {"name": b["name"], "arguments": b["input"]}
                parts.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
            elif b["type"] == "tool_result":
                parts.append(f"<tool_response>\n{block_text(b['content'])}\n</tool_response>")
        messages.append({"role": m["role"], "content": "\n".join(parts)})
    return {"model": model, "messages": messages, "max_tokens": body["max_tokens"],
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


def responses_body(body: dict, model: str) -> dict:
    """The Anthropic body as Codex would send the same conversation on the Responses
    API: ``instructions``, input items (messages, ``function_call`` and
    ``function_call_output``), function tools, ``store: false``."""
    tools = [{"type": "function", "name": t["name"], "description": t.get("description", ""),
              "parameters": t["input_schema"]} for t in body.get("tools", [])]  # fmt: skip
    items: list[dict] = []
    for m in body["messages"]:
        blocks = (
            m["content"]
            if isinstance(m["content"], list)
            else [{"type": "text", "text": m["content"]}]
        )
        for b in blocks:
            if b["type"] == "text":
                part = "output_text" if m["role"] == "assistant" else "input_text"
                items.append({"type": "message", "role": m["role"],
                              "content": [{"type": part, "text": b["text"]}]})  # fmt: skip
            elif b["type"] == "tool_use":
                items.append({"type": "function_call", "name": b["name"], "call_id": b["id"],
                              "arguments": json.dumps(b["input"])})  # fmt: skip
            elif b["type"] == "tool_result":
                items.append({"type": "function_call_output", "call_id": b["tool_use_id"],
                              "output": block_text(b["content"])})  # fmt: skip
    return {"model": model, "instructions": "\n\n".join(b["text"] for b in body["system"]),
            "input": items, "tools": tools, "tool_choice": "auto", "stream": True,
            "store": False, "max_output_tokens": body["max_tokens"], "temperature": 0.0}  # fmt: skip


def float32_copy(model: str) -> str:
    """A float32 MLX folder of ``model`` that every server loads (mlx-stream dequantizes
    to float32 on a CPU itself; the others would run the 4-bit weights, whose CPU matmul
    is several times slower): made once, kept in the user cache."""
    from mlx_stream.models import loader, registry

    folder = Path(model)
    source = folder if folder.is_dir() else loader.model_path(model)
    config = json.loads((source / "config.json").read_text())
    if "quantization" not in config:
        return str(source)
    out = registry.home_dir() / "bench" / f"{source.name}-float32"
    if not (out / "config.json").exists():
        from mlx_lm import convert

        shutil.rmtree(out, ignore_errors=True)
        convert(str(source), mlx_path=str(out), dequantize=True, dtype="float32")
    return str(out)


def per_kind(rows: list[dict]) -> dict:
    kinds: dict[str, list[float]] = {}
    for r in rows:
        kinds.setdefault(r["kind"], []).append(r["ttft_s"])
    return {k: round(statistics.median(v), 3) for k, v in kinds.items()}


def summarize(server: Server, rows: list[dict], tic: float, note: dict) -> dict:
    series = server.memory(tic)
    ok = [r for r in rows if r.get("status") == 200 and "error" not in r]
    rss = [s[1] for s in series]
    after5 = [s[1] for s in series if s[0] >= rows[5]["at"]] if len(rows) > 5 else rss
    return {
        "server": server.kind, **note,
        "requests": len(rows), "ok": len(ok),
        "failed": [{"i": i, **{k: r.get(k) for k in ("kind", "status", "error")}}
                   for i, r in enumerate(rows) if r not in ok],
        "ttft_sum_s": round(sum(r["ttft_s"] for r in rows), 2),
        "total_sum_s": round(sum(r["total_s"] for r in rows), 2),
        "ttft_median_by_kind": per_kind(rows),
        "prompt_tokens_last": rows[-1].get("prompt_tokens"),
        "rss_mb_after_step5": after5[0] if after5 else None,
        "rss_mb_last": rss[-1] if rss else None,
        "rss_mb_max": max(rss) if rss else None,
        "rss_growth_after_step5": round(after5[-1] / after5[0] - 1, 3) if after5 else None,
        "active_mb_max": max(s[2] for s in series) if series else None,
        "disk_bytes": server.disk_bytes(),
        "rows": rows,
        "series": series,
    }  # fmt: skip


def replay(servers: list[Server], steps: list[Step], args) -> list[dict]:
    """Each step sent to every server in turn; a restart step restarts them all first."""
    rows: dict[str, list[dict]] = {s.kind: [] for s in servers}
    tic = time.time()
    for i, step in enumerate(steps):
        if step.restart:
            for s in servers:
                s.stop()
                s.start()
        for s in servers:
            row = s.send(step)
            row["at"] = round(time.time() - tic, 1)
            rows[s.kind].append(row)
            print(f"step {i:>2} {step.kind:<10} {s.kind:<10} {row.get('status')} "
                  f"prompt={row.get('prompt_tokens')} cached={row.get('cached_tokens')} "
                  f"ttft={row['ttft_s']:.2f}s", file=sys.stderr, flush=True)  # fmt: skip
    time.sleep(1.0)  # one more memory sample after the last reply
    return [summarize(s, rows[s.kind], tic, {"phase": "session"}) for s in servers]


def concurrent(server: Server, sessions: int, steps: int, args) -> dict:
    """``sessions`` agent sessions at once (each its own id and task, appends only)."""
    base = base_request(args.tools, args.system_chars)
    files = sources()
    out: list[dict] = []

    def run(n: int) -> None:
        conv = Conversation.start(base, f"{n:08d}-concurrent", f"{TASKS[n % 2]} (session {n})")
        for i in range(steps):
            if i:
                path = files[(n * steps + i) % len(files)]
                conv.messages += conv.exchange(path, 1, args.read_lines, i)
            step = Step("append" if i else "first", str(n), conv.body(args.max_tokens),
                        {"x-claude-code-session-id": conv.session_id})  # fmt: skip
            row = server.send(step)
            out.append(row)

    tic = time.time()
    threads = [threading.Thread(target=run, args=(n,)) for n in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - tic
    tokens = sum(r.get("prompt_tokens") or 0 for r in out)
    generated = sum(r.get("output_tokens") or 0 for r in out)
    return {
        "server": server.kind, "phase": "concurrent", "sessions": sessions,
        "steps_each": steps,
        "ok": sum(1 for r in out if r.get("status") == 200 and "error" not in r),
        "requests": len(out), "wall_s": round(wall, 1),
        "ttft_sum_s": round(sum(r["ttft_s"] for r in out), 2),
        "prompt_tokens_per_s": round(tokens / wall, 1),
        "generated_tokens_per_s": round(generated / wall, 2),
        "requests_per_min": round(60 * len(out) / wall, 2),
    }  # fmt: skip


def ratios(records: list[dict]) -> dict:
    by = {r["server"]: r for r in records if r.get("phase") == "session"}
    out: dict = {"bench": "agent_session", "summary": True}
    ours = by.get("mlx-stream")
    if ours is None:
        return out
    for kind, rec in by.items():
        if kind == "mlx-stream":
            continue
        out[f"ttft_sum_{kind}_over_ours"] = round(rec["ttft_sum_s"] / ours["ttft_sum_s"], 2)
        out[f"kinds_{kind}_over_ours"] = {
            k: round(v / max(ours["ttft_median_by_kind"].get(k, 0), 1e-9), 2)
            for k, v in rec["ttft_median_by_kind"].items()
        }
    conc = {r["server"]: r for r in records if r.get("phase") == "concurrent"}
    if "mlx-stream" in conc:
        for kind, rec in conc.items():
            if kind != "mlx-stream":
                out[f"concurrent_ttft_sum_{kind}_over_ours"] = round(
                    rec["ttft_sum_s"] / max(conc["mlx-stream"]["ttft_sum_s"], 1e-9), 2
                )
                out[f"concurrent_throughput_ours_over_{kind}"] = round(
                    conc["mlx-stream"]["prompt_tokens_per_s"]
                    / max(rec["prompt_tokens_per_s"], 1e-9),
                    2,
                )
    return out


def plot(records: list[dict], path: Path) -> None:
    sessions = [r for r in records if r.get("phase") == "session"]
    server_bench.plot(sessions, path, "seconds into the replayed agent session",
                "The same agent session on each server")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="requests of session A")
    parser.add_argument("--read-lines", type=int, default=60, help="lines per file read")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tools", type=int, default=None, help="keep the first N tools")
    parser.add_argument("--system-chars", type=int, default=None,
                        help="keep the first N characters of the long system block")  # fmt: skip
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--vllm", default=shutil.which("vllm-mlx") or "vllm-mlx",
                        help="vllm-mlx's command, in its own virtual environment")  # fmt: skip
    parser.add_argument("--vllm-flags", default=VLLM_FLAGS,
                        help="vllm-mlx's flags ({cache}: its cache folder)")  # fmt: skip
    parser.add_argument("--vllm-route", choices=("openai", "anthropic"), default="openai",
                        help="vllm-mlx's route: openai (the same rendered text as the others) "
                        "or anthropic (its Messages API leaves out tools the template lacks)")  # fmt: skip
    parser.add_argument("--route", choices=("anthropic", "responses"), default="anthropic",
                        help="mlx-stream's route: Claude Code's Messages API or the same "
                        "session as Codex sends it (Responses API)")  # fmt: skip
    parser.add_argument("--concurrent", type=int, default=4, help="sessions at once (0: none)")
    parser.add_argument("--concurrent-steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--plot", type=Path, help="save a PNG of memory over the session")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.read_lines, args.max_tokens = min(args.steps, 3), 8, 4
        args.tools = 1 if args.tools is None else args.tools
        args.system_chars = 400 if args.system_chars is None else args.system_chars
        args.concurrent, args.concurrent_steps = min(args.concurrent, 2), 2
    model_dir = float32_copy(args.model)
    steps = plan(args.steps, args.read_lines, args.max_tokens, args.tools, args.system_chars)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        servers = [Server(k, model_dir, Path(tmp), args) for k in args.servers.split(",")]
        try:
            for s in servers:
                s.start()
            note = dict(steps=args.steps, read_lines=args.read_lines, max_tokens=args.max_tokens,
                        route=args.route,
                        tools=args.tools, system_chars=args.system_chars,
                        vllm_flags=args.vllm_flags if "vllm-mlx" in args.servers else None,
                        vllm_route=args.vllm_route if "vllm-mlx" in args.servers else None,
                        vllm_mlx=vllm_version(args.vllm) if "vllm-mlx" in args.servers else None)  # fmt: skip
            for rec in replay(servers, steps, args):
                records.append(common.emit(common.base_record(
                    "agent_session", model_dir, "float32", **note, **rec), args.out))  # fmt: skip
            for s in servers if args.concurrent else []:
                s.stop()
                s.start()  # a fresh process: its sessions and memory start over
                rec = concurrent(s, args.concurrent, args.concurrent_steps, args)
                records.append(common.emit(common.base_record(
                    "agent_session", model_dir, "float32", **note, **rec), args.out))  # fmt: skip
        finally:
            for s in servers:
                s.stop()
    records.append(common.emit(ratios(records), args.out))
    if args.plot:
        plot(records, args.plot)
    return records


def vllm_version(command: str) -> str | None:
    python = Path(command).parent / "python"
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm-mlx'))"], capture_output=True, text=True)  # fmt: skip
        return out.stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    common.main_guard(main)
