"""Tool calls for ``serve``, in OpenAI's shape, shared by every API the server speaks.

Contract: messages reach the engine in one canonical shape
(:func:`canonical_message`), and a reply that called tools is written into the
session's transcript in it, so a follow-up echoing it matches the session.
:class:`ToolSet` renders the transcript for the chat template (``tools=`` where the
template supports tools, else the definitions and our ``<tool_call>`` convention in
the system prompt); :class:`ToolPlan` adds ``tool_choice`` (constrained by llguidance
where calls are JSON); :class:`CallStream` wraps a request's event callback, turning
text inside the markers into :class:`~mlx_stream.serve.event_types.ToolCall` events
and the finish reason into ``tool_calls``. Bad input is a
:class:`~mlx_stream.errors.UserError` naming the field, raised before any session is
touched. In full: ``docs/serve.md``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from mlx_stream.errors import UserError
from mlx_stream.mlxlm import hf_tokenizer
from mlx_stream.serve.event_types import Delta, End, ToolCall

START, END = "<tool_call>", "</tool_call>"
SYSTEM_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _arguments(value: Any, where: str) -> str:
    """Arguments as canonical JSON text (an object), from text or an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            raise UserError(f"{where}: not valid JSON") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: must be a JSON object")
    return json.dumps(value, ensure_ascii=False)


def canonical_message(message: dict, index: int = 0) -> dict:
    """One message in the engine's shape (see the module docstring)."""
    role, content = message.get("role"), message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if role == "assistant" and message.get("tool_calls"):
        calls = []
        for j, call in enumerate(message["tool_calls"]):
            fn = call.get("function") or {}
            where = f"messages.{index}.tool_calls.{j}"
            if not fn.get("name"):
                raise UserError(f"{where}.function.name: required")
            args = _arguments(fn.get("arguments", "{}"), f"{where}.function.arguments")
            calls.append(
                {"id": call.get("id") or f"call_{index}_{j}", "type": "function",
                 "function": {"name": fn["name"], "arguments": args}}
            )  # fmt: skip
        out["tool_calls"] = calls
    if role == "tool":
        if not message.get("tool_call_id"):
            raise UserError(f"messages.{index}.tool_call_id: required on a tool message")
        out["tool_call_id"] = message["tool_call_id"]
    return out


def canonical_messages(messages: list[dict]) -> list[dict]:
    """Every message in the engine's shape (a new list: ``messages`` is untouched)."""
    return [canonical_message(m, i) for i, m in enumerate(messages)]


def check_results(messages: list[dict]) -> None:
    """Every tool result answers a call of the assistant message before it."""
    open_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            open_ids = {c["id"] for c in m.get("tool_calls", ())}
        elif m["role"] == "tool":
            if m["tool_call_id"] not in open_ids:
                raise UserError(
                    f"messages.{i}.tool_call_id: {m['tool_call_id']!r} answers no tool call "
                    "of the assistant message before it"
                )
        elif m["role"] == "user":
            open_ids = set()


def function_tools(tools: list[dict] | None) -> list[dict]:
    """OpenAI function tools (``{"type": "function", "function": {...}}``), checked."""
    out = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not fn:
            raise UserError(f"tools.{i}: only function tools are supported")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UserError(f"tools.{i}.function.name: required")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        arguments_schema(json.dumps(params, ensure_ascii=False), f"tools.{i}.function.parameters")
        spec = {
            "name": fn["name"],
            "description": fn.get("description") or "",
            "parameters": params,
        }
        out.append({"type": "function", "function": spec})
    return out


@functools.lru_cache(maxsize=512)
def arguments_schema(schema: str, field: str = "parameters") -> str:
    """The schema (JSON text) a call's arguments are held to, for a tool's
    ``parameters`` (JSON text): closed to the keys it lists, or looser where
    llguidance cannot enforce a feature (:func:`~mlx_stream.serve.structured.
    tool_arguments_schema`); agents send the same tools every turn, hence the cache.
    The definitions the model reads stay as the client sent them."""
    from mlx_stream.serve.structured import tool_arguments_schema

    return json.dumps(tool_arguments_schema(json.loads(schema), field), ensure_ascii=False)


@dataclass(frozen=True)
class ToolSet:
    """The tool definitions of a session and how its template shows them."""

    tools: tuple  # of canonical function tools, as JSON text (hashable, comparable)
    native: bool

    @classmethod
    def make(cls, tools: list[dict], tokenizer: Any) -> ToolSet | None:
        if not tools:
            return None
        from mlx_stream.serve import call_formats

        native = bool(getattr(tokenizer, "has_tool_calling", False))
        native = native or call_formats.native(tokenizer) is not None
        return cls(tuple(json.dumps(t, ensure_ascii=False) for t in tools), native)

    @property
    def definitions(self) -> list[dict]:
        return [json.loads(t) for t in self.tools]

    def for_template(self, messages: list[dict]) -> tuple[list[dict], dict]:
        """``messages`` as the chat template takes them, and its extra arguments."""
        if self.native:
            out = []
            for m in messages:
                m = dict(m)
                if m.get("tool_calls"):
                    m["tool_calls"] = [
                        {**c, "function": {**c["function"],
                                           "arguments": json.loads(c["function"]["arguments"])}}
                        for c in m["tool_calls"]
                    ]  # fmt: skip
                out.append(m)
            return out, {"tools": self.definitions}
        block = SYSTEM_BLOCK.format(tools="\n".join(self.tools))
        out: list[dict] = []
        if messages and messages[0]["role"] in ("system", "developer"):
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
        for m in messages:
            if m["role"] == "tool":
                text = f"<tool_response>\n{m['content']}\n</tool_response>"
                if out[-1]["role"] == "user" and out[-1].get("results"):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                else:
                    out.append({"role": "user", "content": text, "results": True})
            elif m.get("tool_calls"):
                calls = [call_text(c["function"]["name"], c["function"]["arguments"])
                         for c in m["tool_calls"]]  # fmt: skip
                text = m["content"] + "\n".join(calls)  # as the auto grammar writes it
                out.append({"role": "assistant", "content": text})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        return [{"role": m["role"], "content": m["content"]} for m in out], {}


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it without native tool support."""
    body = json.dumps({"name": name, "arguments": json.loads(arguments)}, ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


@dataclass
class ToolPlan:
    """One request's tools: its :class:`ToolSet`, ``tool_choice`` and the grammar
    its reply is held to (a forced call, or ``auto``'s text or valid calls)."""

    toolset: ToolSet
    choice: str  # auto | none | required | a function name
    start: str = START
    end: str = END
    parser: Any = None
    grammar: str | None = None

    @classmethod
    def make(cls, tools: list[dict] | None, choice: Any, tokenizer: Any) -> ToolPlan | None:
        """The plan of a request (``None`` without tools); checks ``tool_choice``."""
        defs = function_tools(tools)
        name = _choice(choice)
        if not defs:
            if name not in ("auto", "none"):
                raise UserError("tool_choice: needs tools")
            return None
        names = [t["function"]["name"] for t in defs]
        if name not in ("auto", "none", "required") and name not in names:
            raise UserError(f"tool_choice: no tool named {name!r} (tools: {', '.join(names)})")
        from mlx_lm.tool_parsers import json_tools

        from mlx_stream.serve import call_formats

        toolset = ToolSet.make(defs, tokenizer)
        plan, fmt = cls(toolset, name), call_formats.native(tokenizer)
        if fmt is not None:  # a family mlx-lm has no parser for
            plan.start, plan.end, plan.parser = fmt.start, fmt.end, fmt.parse
        elif toolset.native:
            plan.start, plan.end = tokenizer.tool_call_start, tokenizer.tool_call_end
            plan.parser = tokenizer.tool_parser
        else:
            plan.parser = json_tools.parse_tool_call
        # A forced call needs its end, and markers the grammar may write (not harmony's).
        if name not in ("auto", "none") and (not plan.end or not getattr(fmt, "forced", True)):
            plan.start, plan.end = START, END
        special = _special_tokens(tokenizer, plan.start, plan.end)
        if name not in ("auto", "none"):
            chosen = [t for t in defs if name == "required" or t["function"]["name"] == name]
            plan.grammar = call_grammar(chosen, plan.start, plan.end, special=special)
            # The grammar wrote JSON, whatever the template's own call format.
            plan.parser = json_tools.parse_tool_call
        elif name == "auto" and plan.parser is json_tools.parse_tool_call:
            # Calls are JSON between markers (ours, or a json_tools template's): a call
            # the model opens is held to its tool's schema. Other call formats
            # (qwen3_coder's XML, pythonic, ...) are parsed from free text as written.
            plan.grammar = call_grammar(defs, plan.start, plan.end, True, special)
        return plan


def _special_tokens(tokenizer: Any, *markers: str) -> dict[str, int]:
    """The ``markers`` that are one special token of ``tokenizer``, with its id."""
    hf = hf_tokenizer(tokenizer)
    encode, added = getattr(hf, "encode", None), getattr(hf, "added_tokens_decoder", None)
    out = {}
    for marker in markers:
        ids = encode(marker, add_special_tokens=False) if encode and marker else []
        if len(ids) == 1 and getattr((added or {}).get(ids[0]), "special", False):
            out[marker] = ids[0]
    return out


def _choice(choice: Any) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise UserError(
                f"tool_choice: must be auto, none, required or a function, not {choice!r}"
            )
        return choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise UserError("tool_choice: must be auto, none, required or {'type': 'function', ...}")


def call_grammar(
    defs: list[dict], start: str, end: str, optional: bool = False, special: dict | None = None
) -> str:
    """The llguidance grammar of exactly one call of one of ``defs``; ``optional``:
    of free text without ``start``, or text then one or more calls (``auto``:
    whatever the model writes, a call it begins is a valid one). A call's arguments
    are held to :func:`arguments_schema` of its tool. ``special``: the markers that
    are one special token, with its id (the grammar names the token: its text would
    spell other tokens)."""
    key = json.dumps([[t["function"]["name"], t["function"]["parameters"]] for t in defs],
                     ensure_ascii=False)  # fmt: skip
    return _call_grammar(key, start, end, optional, tuple(sorted((special or {}).items())))


@functools.lru_cache(maxsize=64)
def _call_grammar(key: str, start: str, end: str, optional: bool, special: tuple) -> str:
    # Cached: agents send the same tools every turn and compiling them takes a while.
    from mlx_stream.serve.structured import JSON_OPTIONS, lark_grammar

    options = []
    for i, (name, params) in enumerate(json.loads(key)):
        text = json.dumps(params, ensure_ascii=False)
        args = json.loads(arguments_schema(text, f"tools.{i}.function.parameters"))
        # Its own resource: a "#/$defs/..." reference inside resolves against it.
        args.setdefault("$id", f"urn:mlx-stream:tool:{i}")
        options.append(
            {"type": "object", "properties": {"name": {"const": name}, "arguments": args},
             "required": ["name", "arguments"], "additionalProperties": False}
        )  # fmt: skip
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": True}}
    ids = dict(special)
    head = f'<[{ids[start]}]> "\\n"' if start in ids else json.dumps(start + "\n")
    tail = f'"\\n" <[{ids[end]}]>' if end in ids else json.dumps("\n" + end)
    if not optional:
        lark = f"start: {head} call {tail}\n"
    else:
        text, marker = json.dumps(start)[1:-1], json.dumps(start + "\n")[1:-1]
        lark = (
            f'start: TEXT | prefix call {tail} ("\\n" {head} call {tail})*\n'
            f"TEXT: /(?s:.*)/ & ~/(?s:.*{_regex(text)}.*)/\n"  # text that begins none
        )
        if start in ids:  # a special token is never text: text ends where it comes
            lark += f"prefix: TEXT? {head}\n"
        else:
            lark += f"prefix[lazy]: /(?s:.*){_regex(marker)}/\n"  # text up to the first call
    lark += f"call: %json {json.dumps(schema)}\n"
    return lark_grammar(lark, "tools")


def _regex(text: str) -> str:
    """``text`` (JSON-escaped, as Lark reads it) as a regex matching it literally."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|/" else c for c in text)


@dataclass
class CallStream:
    """A request's event callback that turns tool-call text into call events."""

    # By hand: mlx-lm splits call text from replies inside its server's loop (token
    # markers), not in a function it exports; its parsers then read each call.

    plan: ToolPlan
    emit: Any
    salt: str = ""
    text: list[str] = field(default_factory=list)  # visible text of the reply
    calls: list[dict] = field(default_factory=list)
    held: str = ""  # text that may begin a start marker
    inside: str | None = None  # text of an open call

    def __call__(self, event: Any) -> None:
        if isinstance(event, Delta) and self.plan.choice != "none":
            self._feed(event.text, event.logprob)
        elif isinstance(event, End):
            self._flush()
            finish = event.finish_reason
            if self.calls and finish == "stop":
                finish = "tool_calls"
            self.emit(End(event.usage, finish))
        else:
            if isinstance(event, Delta):
                self.text.append(event.text)
            self.emit(event)

    def _feed(self, text: str, logprob: Any) -> None:
        if self.inside is not None:
            self.inside += text
        else:
            self.held += text
            at = self.held.find(self.plan.start)
            if at < 0:
                out, self.held = hold_back(self.held, self.plan.start)
                if out or logprob is not None:
                    self._text(out, logprob)
                return
            before, self.inside = self.held[:at], self.held[at + len(self.plan.start) :]
            self.held = ""
            if before:
                self._text(before, None)
        if not self.plan.end:  # the call runs to the end of the reply (read at flush)
            return
        at = self.inside.find(self.plan.end)
        if at >= 0:
            body, rest = self.inside[:at], self.inside[at + len(self.plan.end) :]
            self.inside = None
            self._call(body)
            if rest.strip():
                self._feed(rest, None)

    def _text(self, text: str, logprob: Any) -> None:
        self.text.append(text)
        self.emit(Delta(text, logprob))

    def _call(self, body: str) -> None:
        try:
            parsed = self.plan.parser(body, self.plan.toolset.definitions)
            items = parsed if isinstance(parsed, list) else [parsed]
            # Arguments as the echo of the call will read (canonical_message).
            items = [(i["name"], _arguments(i.get("arguments", {}), "arguments")) for i in items]
        except (ValueError, KeyError, TypeError, AttributeError, UserError):
            self._text(self.plan.start + body + self.plan.end, None)  # not a call: text
            return
        for name, args in items:
            index = len(self.calls)
            digest = hashlib.sha256(f"{self.salt}|{index}|{name}|{args}".encode())
            call = {"id": "call_" + digest.hexdigest()[:24], "type": "function",
                    "function": {"name": name, "arguments": args}}  # fmt: skip
            self.calls.append(call)
            self.emit(ToolCall(index, call))

    def _flush(self) -> None:
        if self.inside is not None:
            body, self.inside = self.inside, None
            self._call(body)
        if self.held:
            held, self.held = self.held, ""
            self._text(held, None)

    def settle(self, session: Any) -> None:
        """Write the reply into ``session``'s transcript in the canonical shape."""
        if not self.calls or not session.messages:
            return
        reply = {"role": "assistant", "content": "".join(self.text),
                 "tool_calls": [dict(c) for c in self.calls]}  # fmt: skip
        session.messages[-1] = reply


def settle_after(emit: Any, session: Any) -> None:
    """A filter's ``settle``: the tool-call reader's behind it
    (:meth:`CallStream.settle`), when ``emit`` is one."""
    settle = getattr(emit, "settle", None)
    if settle is not None:
        settle(session)


def hold_back(text: str, marker: str) -> tuple[str, str]:
    """``text`` split into what may go out and its longest end that begins ``marker``
    (held until the next text says whether the marker follows)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n], text[-n:]
    return text, ""
