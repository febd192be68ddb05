"""Anthropic's Messages API on ``serve``: ``POST /v1/messages`` (whole or streamed)
and ``POST /v1/messages/count_tokens``, what Claude Code speaks.

Contract: a request is translated into the engine's one request type (the same
sessions, batching, admission by bytes and cancellation as chat completions) and its
events back into Anthropic's shapes: ``system``, text, ``tool_use`` and
``tool_result`` blocks become messages and tool calls (a result without its call is
a 400 naming the field; images and documents are refused, hosted tools left out and
logged); replies are ``thinking``, ``text`` and ``tool_use`` blocks with
``stop_reason`` and ``usage``, streamed as Anthropic's event sequence (a long prefill
keeps Claude Code's idle timer alive). Errors: ``{"type": "error", "error": {"type",
"message"}}`` (:func:`error`). In full: ``docs/serve.md``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from mlx_stream.errors import UserError
from mlx_stream.serve import events
from mlx_stream.serve.event_types import Delta, End, Failed, Reasoning, ToolCall
from mlx_stream.serve.fields import owner_of, sampling_args, session_header
from mlx_stream.serve.statuses import status_of

PREFIX = "/v1/messages"
KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}
# a reply stopped as a loop (serve --stop-loops) ended its turn, as far as a client knows
STOP = {"stop": "end_turn", "loop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """Anthropic's error body."""
    body = {"type": "error", "error": {"type": KINDS.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str | None = None  # None or "custom": a client tool; else a hosted one
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @property
    def hosted(self) -> bool:
        return self.type not in (None, "custom") or self.input_schema is None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class CountRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None


SKIPPED = ("thinking", "redacted_thinking")  # the model's own reasoning: not replayed
MEDIA = ("image", "document")


def _refuse_media(kind: str, where: str) -> None:
    if kind in MEDIA:
        raise UserError(f"{where}.type: {kind} blocks are not supported: this model reads text")


def _billing(block: Any) -> bool:
    """Whether a system block is Claude Code's ``x-anthropic-billing-header`` line: an
    attribution for Anthropic's billing with a per-prompt hash, meaningless to a model."""
    text = block.get("text") if isinstance(block, dict) else getattr(block, "text", None)
    return isinstance(text, str) and text.startswith("x-anthropic-billing-header:")


def _text(content: Any, where: str) -> str:
    """The text of a ``system`` or ``tool_result`` content (text blocks joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else block.type
        text = block.get("text") if isinstance(block, dict) else block.text
        _refuse_media(kind, f"{where}.{j}")
        if kind == "text":
            parts.append(text or "")
    return "".join(parts)


def _add_note(messages: list[dict[str, Any]], note: dict[str, Any]) -> None:
    """Append a mid-conversation system note; one that follows a user message goes just
    before it, so the user's words stay the last thing the model reads before it replies
    (a small model continues the last text it read: Claude Code's agent list after its
    question made the default model go on listing agents instead of answering)."""
    at = len(messages)
    if at >= 2 and messages[-1]["role"] == "user":
        at -= 1
    messages.insert(at, note)


def to_engine(body: MessagesRequest | CountRequest) -> dict[str, Any]:
    """The engine request fields of an Anthropic body (``messages``, ``tools``,
    ``tool_choice``); a :class:`UserError` naming the field for what cannot be served."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system
        if isinstance(system, list):  # Claude Code's billing line changes every run and
            system = [b for b in system if not _billing(b)]  # would defeat the snapshot
        messages.append({"role": "system", "content": _text(system, "system")})
    open_ids: set[str] = set()
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if m.role == "system":  # a mid-conversation note
            _add_note(messages, {"role": "system", "content": _text(m.content, where)})
            continue
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            open_ids = set()
            continue
        texts, calls = [], []
        for j, b in enumerate(m.content):
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise UserError(f"{where}.{j}: a tool_use block needs an id and a name")
                arguments = json.dumps(b.input or {}, ensure_ascii=False)
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": arguments}})  # fmt: skip
            elif b.type == "tool_result" and m.role == "user":
                if b.tool_use_id not in open_ids:
                    raise UserError(
                        f"{where}.{j}.tool_use_id: {b.tool_use_id!r} matches no tool_use "
                        "block of the assistant message before it"
                    )
                content = _text(b.content, f"{where}.{j}.content")
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
            elif b.type in ("tool_use", "tool_result"):
                raise UserError(
                    f"{where}.{j}.type: {b.type!r} is not allowed in a {m.role} message"
                )
            else:  # thinking, hosted tools' blocks: not part of the prompt
                _refuse_media(b.type, f"{where}.{j}")
        if m.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            open_ids = {c["id"] for c in calls}
        else:
            if texts:
                messages.append({"role": "user", "content": "".join(texts)})
            open_ids = set()
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                          "parameters": t.input_schema}}
        for t in body.tools or [] if not t.hosted
    ]  # fmt: skip
    choice = getattr(body, "tool_choice", None)
    tool_choice = None
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise UserError("tool_choice.name: required when type is tool")
        tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
        tool_choice = tool_choice or {"type": "function", "function": {"name": choice.name}}
    thinking = (getattr(body, "model_extra", None) or {}).get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    return {"messages": messages, "tools": tools or None, "tool_choice": tool_choice,
            "thinking": {"enabled": True, "disabled": False}.get(kind)}  # fmt: skip


def hosted_tools(body: MessagesRequest | CountRequest) -> list[str]:
    """Names of the hosted tools a request offers (left out: nothing runs them here)."""
    return [t.name for t in body.tools or [] if t.hosted]


def _usage(usage: dict) -> dict[str, int]:
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.get("prompt_tokens", 0) - cached,
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        **events.repair_counts(usage),
    }


def stop_fields(finish: str, request: Any) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of a reply that ended with ``finish``."""
    if finish == "stop" and request.matched_stop is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": request.matched_stop}
    return {"stop_reason": STOP.get(finish, "end_turn"), "stop_sequence": None}


def _tool_use(call: dict) -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": fn["name"],
        "input": json.loads(fn["arguments"]),
    }


def register(app: FastAPI, models: Any) -> None:
    """Add the Messages API routes to ``app`` (served by the engine of the body's
    ``model`` in ``models``, a :class:`~mlx_stream.serve.models.Models`)."""

    @app.post(PREFIX)
    async def messages(
        body: MessagesRequest, http: Request, x_session_id: Annotated[str | None, Header()] = None
    ):
        bad_id = session_header(x_session_id)
        if bad_id is not None:
            return error(400, bad_id)
        engine, refused = await events.engine_for(models, body.model)
        if refused is not None:
            return error(refused.status, refused.message, refused.headers())
        try:
            fields = to_engine(body)
        except UserError as exc:
            return error(400, str(exc))
        hosted = hosted_tools(body)
        if hosted:
            events.note(
                http, f"hosted tools left out (nothing runs them here): {', '.join(hosted)}"
            )
        job, request, first = await events.start(
            engine, http=http, session_id=x_session_id, max_tokens=body.max_tokens,
            top_k=body.top_k, stop=body.stop_sequences or None, owner=owner_of(http),
            **sampling_args(body.temperature, body.top_p), **fields,
        )  # fmt: skip
        if isinstance(first, Failed):
            refused = status_of(first)
            return error(refused.status, refused.message, refused.headers())
        session_id = first.session_id
        headers = {"X-Session-ID": session_id} if session_id else None
        ident = "msg_" + uuid.uuid4().hex[:24]
        if body.stream:
            stream = _stream(job, request, ident, engine.model_id)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        reply = await events.drain(job, request, http)
        if reply.error is not None:
            return error(*reply.error)
        thought = [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}]
        content = (
            (thought if reply.reasoning else [])
            + ([{"type": "text", "text": reply.text}] if reply.text else [])
            + [_tool_use(c) for c in reply.calls]
        )
        whole = {
            "id": ident, "type": "message", "role": "assistant", "model": engine.model_id,
            "content": content, **stop_fields(reply.finish, request), "usage": _usage(reply.usage),
        }  # fmt: skip
        return JSONResponse(whole, headers=headers)

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens(body: CountRequest):
        try:
            fields = to_engine(body)
            engine, refused = await events.engine_for(models, body.model)
            if refused is not None:
                return error(refused.status, refused.message, refused.headers())
            # a few MB of text take seconds: off the event loop, one count at a time
            n = await asyncio.to_thread(count_alone, engine, fields["messages"], fields["tools"])
            return {"input_tokens": n}
        except UserError as exc:
            return error(400, str(exc))


_COUNTING = threading.Lock()


def count_alone(engine: Any, messages: list[dict], tools: list[dict] | None) -> int:
    """:func:`count` on any thread, one at a time (a tokenizer is shared)."""
    with _COUNTING:
        return count(engine, messages, tools)


def count(engine: Any, messages: list[dict], tools: list[dict] | None) -> int:
    """Tokens of ``messages`` (and ``tools``) rendered as the session would feed them."""
    from mlx_stream.serve.tools import ToolSet, canonical_message, function_tools

    messages = [canonical_message(m, i) for i, m in enumerate(messages)]
    toolset = ToolSet.make(function_tools(tools), engine.tokenizer)
    extra: dict[str, Any] = {}
    if toolset is not None:
        messages, extra = toolset.for_template(messages)
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
    else:
        text = "".join(m["content"] + "\n" for m in messages)
    return len(tok.encode(text, add_special_tokens=False))


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _stream(job: events.Job, request: Any, ident: str, model: str):
    """Anthropic's event sequence for one reply; a client that goes away cancels it."""
    try:
        message = {"id": ident, "type": "message", "role": "assistant", "model": model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}  # fmt: skip
        yield _sse("message_start", {"message": message})
        index, kind, pings = 0, None, 0  # kind: the open block's ("text", "thinking")
        while True:
            event = await job.events.get()
            if isinstance(event, (Delta, Reasoning)) and event.text:
                want = "text" if isinstance(event, Delta) else "thinking"
                if kind not in (None, want):
                    yield _sse("content_block_stop", {"index": index})
                    index, kind = index + 1, None
                if kind is None:
                    block = {"type": want, want: ""}
                    if want == "thinking":
                        block["signature"] = ""  # nothing signs a local model's thought
                    yield _sse("content_block_start", {"index": index, "content_block": block})
                    kind = want
                delta = {"type": want + "_delta", want: event.text}
                yield _sse("content_block_delta", {"index": index, "delta": delta})
            elif isinstance(event, ToolCall):
                if kind is not None:
                    yield _sse("content_block_stop", {"index": index})
                    index, kind = index + 1, None
                block = {**_tool_use(event.call), "input": {}}
                yield _sse("content_block_start", {"index": index, "content_block": block})
                delta = {
                    "type": "input_json_delta",
                    "partial_json": event.call["function"]["arguments"],
                }
                yield _sse("content_block_delta", {"index": index, "delta": delta})
                yield _sse("content_block_stop", {"index": index})
                index += 1
            elif isinstance(event, events.Ping):  # a long prompt going in: keep the client waiting
                yield _sse("ping", {})
                pings += 1
                if pings == 1:
                    continue  # a short prompt's reply stays as the whole one would be
                # Claude Code's idle timer skips pings: an empty text delta resets it.
                if kind is None:
                    block = {"type": "text", "text": ""}
                    yield _sse("content_block_start", {"index": index, "content_block": block})
                    kind = "text"
                delta = {"type": kind + "_delta", kind: ""}
                yield _sse("content_block_delta", {"index": index, "delta": delta})
            elif isinstance(event, End):
                if kind is not None:
                    yield _sse("content_block_stop", {"index": index})
                delta = stop_fields(event.finish_reason, request)
                yield _sse("message_delta", {"delta": delta, "usage": _usage(event.usage)})
                yield _sse("message_stop", {})
                break
            elif isinstance(event, Failed):
                status, message, _ = status_of(event)
                body = {"type": KINDS.get(status, "api_error"), "message": message}
                yield _sse("error", {"error": body})
                break
    finally:
        request.cancelled.set()  # a no-op once the engine has finished the request
