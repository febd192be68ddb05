"""The scripted coding-agent session that ``agent_session.py`` replays: Claude Code's
request bodies, step by step, the same for every server.

It starts from Claude Code's real first request (``tests/fixtures/agents/
claude_code_first.json``: its system prompt, 24 tool definitions, a user message with a
``<system-reminder>`` and the task, then the system message listing agent types) and
goes on the way the client does: each step the assistant's turn (a line of text and a
``Read`` tool call) and the user's turn (the ``tool_result``, a file of this repository
read whole or in part with ``cat -n`` numbering as the real tool returns it, and a
``<system-reminder>`` that changes every step), the whole transcript resent, a
``cache_control`` marker on the system prompt and on the newest block. Assistant turns
are scripted (a recorded session replayed), never the server's own reply, so every
server gets byte-identical requests.

The prefix shifts agents make, each a step kind of its own: ``cleared`` (the oldest
tool results replaced by Claude Code's "[Old tool result content cleared]"),
``compaction`` (the history replaced by a summary and the last exchange), ``edit`` (the
task message edited, the rest kept), ``fork`` (the last exchange replaced by another),
``fork-edit`` (the same after an earlier tool result was pruned), ``second`` (another
session with the same system prompt), and ``restart`` (the next step after the server
restarted). Everything else is ``append``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "agents" / "claude_code_first.json"
CLEARED = "[Old tool result content cleared]"
# Claude Code's compaction: the history becomes one user message with a summary.
SUMMARY = (
    "This session is being continued from a previous conversation that ran out of "
    "context. The conversation is summarized below:\n"
    "Summary:\n1. Primary Request and Intent: the user asked for a review of how the "
    "server keeps sessions in fixed memory.\n2. Files read: {files}.\n3. Pending Tasks: "
    "finish the review of the remaining modules.\n"
    "Please continue the conversation from where we left it off without asking the "
    "user any further questions. Continue with the last task that you were asked to work on."
)
TASKS = (
    "Review how this repository's server keeps each session in fixed memory. Read the "
    "relevant modules one by one and tell me where memory could still grow.",
    "Find where the prefix store writes its files and check what happens when a file "
    "is damaged. Read the code first.",
)
# Step kinds in the order of the plan below (after ``first``); ``append`` fills the rest.
SPECIAL = {
    7: "second",
    10: "cleared",
    14: "edit",
    17: "fork",
    20: "restart",
    21: "second",
    24: "fork-edit",
    27: "compaction",
}


def sources() -> list[Path]:
    """The files the agent reads: this repository's engine sources and docs, in a
    fixed order."""
    files = sorted((REPO / "mlx_stream").rglob("*.py")) + sorted((REPO / "docs").glob("*.md"))
    return [f for f in files if f.stat().st_size > 2000]


def read_tool(path: Path, offset: int, lines: int) -> str:
    """What Claude Code's ``Read`` returns: ``lines`` lines from ``offset`` (1-based),
    each behind its right-aligned number and a tab."""
    text = path.read_text(encoding="utf-8").splitlines()[offset - 1 : offset - 1 + lines]
    return "\n".join(f"{offset + i:>6}\t{line}" for i, line in enumerate(text))


def reminder(step: int, read: list[str]) -> dict:
    """The ``<system-reminder>`` block Claude Code appends to a user turn; it changes
    every step (here: the files read so far and the step)."""
    text = (
        "<system-reminder>\nThe TodoWrite tool hasn't been used recently. If you're working "
        "on tasks that would benefit from tracking progress, consider using it. "
        f"Files read so far: {len(read)} (last: {read[-1] if read else 'none'}). "
        f"Turn {step}.\n</system-reminder>"
    )
    return {"type": "text", "text": text}


@dataclass
class Conversation:
    """One agent session's transcript (Anthropic messages) and what it read."""

    base: dict  # the first request's body (system, tools, first messages)
    session_id: str
    messages: list[dict] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    calls: int = 0

    @classmethod
    def start(cls, base: dict, session_id: str, task: str | None = None) -> Conversation:
        messages = copy.deepcopy(base["messages"])
        if task is not None:  # another session: its own task in the first user message
            blocks = messages[0]["content"]
            blocks[-1] = {**blocks[-1], "text": task}
        return cls(base, session_id, messages)

    def exchange(self, path: Path, offset: int, lines: int, step: int) -> list[dict]:
        """The assistant's Read call and the user's turn with its result."""
        self.calls += 1
        call_id = f"toolu_{self.session_id[:8]}{self.calls:04d}"
        name = str(path.relative_to(REPO))
        self.read.append(name)
        return [
            {"role": "assistant", "content": [
                {"type": "text", "text": f"I'll read {name}."},
                {"type": "tool_use", "id": call_id, "name": "Read",
                 "input": {"file_path": str(path), "offset": offset, "limit": lines}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id,
                 "content": read_tool(path, offset, lines)},
                reminder(step, self.read),
            ]},
        ]  # fmt: skip

    def results(self) -> list[dict]:
        """The tool_result blocks of the transcript, oldest first."""
        return [
            b for m in self.messages if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_result"
        ]  # fmt: skip

    def body(self, max_tokens: int) -> dict:
        """The request body: the base's fields with this transcript, the cache marker on
        the newest block only (Claude Code moves it forward each turn)."""
        messages = copy.deepcopy(self.messages)
        for m in messages:
            if isinstance(m["content"], list):
                for b in m["content"]:
                    b.pop("cache_control", None)
        last = messages[-1]["content"]
        if isinstance(last, list):
            last[-1]["cache_control"] = {"type": "ephemeral"}
        return {**self.base, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True}  # fmt: skip


@dataclass
class Step:
    kind: str
    conversation: str  # which session: "A", "B"
    body: dict
    headers: dict
    restart: bool = False  # restart the server before this request


def base_request(tools: int | None = None, system_chars: int | None = None) -> dict:
    """Claude Code's first request body, optionally smaller: its first ``tools`` tool
    definitions and the first ``system_chars`` characters of its long system block
    (``None``: all of it, ~19k tokens)."""
    body = json.loads(FIXTURE.read_text())["body"]
    body = {k: v for k, v in body.items() if k not in ("thinking", "context_management")}
    if tools is not None:
        body["tools"] = body["tools"][:tools]
    if system_chars is not None:
        body["system"] = [
            {**b, "text": b["text"][:system_chars]} for b in body["system"]
        ]
    return body


def plan(
    steps: int = 32,
    read_lines: int = 60,
    max_tokens: int = 16,
    tools: int | None = None,
    system_chars: int | None = None,
) -> list[Step]:
    """The whole replay: ``steps`` requests of session A (its first request, then one
    step per index, special kinds at the indices of ``SPECIAL`` that fit) with session
    B's requests among them."""
    base = base_request(tools, system_chars)
    files = sources()
    a = Conversation.start(base, "a" * 8 + "-agent-session-a")
    b = Conversation.start(base, "b" * 8 + "-agent-session-b", TASKS[1])
    cursor = {"file": 0}

    def next_file(conv: Conversation, step: int) -> list[dict]:
        path = files[cursor["file"] % len(files)]
        offset = 1 + (cursor["file"] // len(files)) * read_lines
        cursor["file"] += 1
        return conv.exchange(path, offset, read_lines, step)

    def step(kind: str, conv: Conversation, restart: bool = False) -> Step:
        headers = {"x-claude-code-session-id": conv.session_id}
        return Step(kind, "A" if conv is a else "B", conv.body(max_tokens), headers, restart)

    out = [step("first", a)]
    for i in range(1, steps):
        kind = SPECIAL.get(i, "append")
        if kind == "second":
            if any(x.conversation == "B" for x in out):  # B's next step, not its first
                b.messages += next_file(b, i)
            out.append(step("second", b))
            continue
        if kind == "restart":
            a.messages += next_file(a, i)
            out.append(step("restart", a, restart=True))
            continue
        if kind == "cleared":
            for block in [r for r in a.results() if r["content"] != CLEARED][:2]:
                block["content"] = CLEARED
        elif kind == "edit":
            first = a.messages[0]["content"]
            first[-1] = {**first[-1], "text": first[-1]["text"] + " Start with the cache."}
        elif kind in ("fork", "fork-edit"):
            del a.messages[-2:]  # the last exchange goes, another takes its place
            cursor["file"] += 3
            if kind == "fork-edit":
                kept = [r for r in a.results() if r["content"] != CLEARED]
                if kept:
                    kept[0]["content"] = kept[0]["content"][:200] + "\n[truncated]"
        elif kind == "compaction":
            head = a.messages[: len(base["messages"])]
            summary = SUMMARY.format(files=", ".join(a.read[-6:]))
            head[0] = {"role": "user", "content": [{"type": "text", "text": summary}]}
            a.messages = head + a.messages[-2:]
        a.messages += next_file(a, i)
        out.append(step(kind, a))
    return out
