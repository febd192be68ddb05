"""ollama's API on ``serve``, on the same port: ``POST /api/chat``, ``POST /api/generate``,
``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``: what chat
front ends, editors and scripts written for ollama speak.

Contract: a request is translated into the engine's one request type (the same
sessions, batching, admission by bytes and cancellation as chat completions) and its
events back into ollama's shapes: ``messages`` / ``prompt`` (``raw``: a plain
completion), ``tools``, ``format``, the ``options`` ollama defines that apply here
(the rest ignored, as ollama ignores unknown ones; fields that cannot be served are
refused in one line naming them). Replies stream as newline-delimited JSON, a line
per piece, then a ``done`` line with ollama's counts and durations (``stream: false``:
one object). Errors: ``{"error": "..."}`` with the HTTP side's status; mid-stream, a
last line holding ``error``. In full: ``docs/serve.md``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from mlx_stream.errors import UserError
from mlx_stream.serve import events, ollama_models, reasoning
from mlx_stream.serve.event_types import Delta, End, Failed, Reasoning, ToolCall
from mlx_stream.serve.fields import owner_of, sampling_args
from mlx_stream.serve.models import parse_keep_alive
from mlx_stream.serve.ollama_models import error, now
from mlx_stream.serve.statuses import status_of
from mlx_stream.serve.structured import response_format_grammar

PREFIX = "/api/"
MAX_SEED = 2**63 - 1
NDJSON = "application/x-ndjson"


class Options(BaseModel):
    """The ``options`` this server reads (others are ignored, as ollama ignores them)."""

    model_config = ConfigDict(extra="allow")

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    num_predict: int | None = Field(None, ge=-2)
    stop: list[str] | str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    repeat_penalty: float | None = Field(None, gt=0)
    num_ctx: int | None = Field(None, ge=1)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class Body(BaseModel):
    """What ``/api/chat`` and ``/api/generate`` share."""

    model_config = ConfigDict(extra="allow")

    model: str
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class ChatBody(Body):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(Body):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


def think_of(think: bool | str | None) -> bool | None:
    """ollama's ``think`` as the template's ``enable_thinking`` (``None``: left out)."""
    return None if think is None else think not in (False, "false", "none")


def _refuse(body: Body, fields: tuple[str, ...], engine: Any) -> None:
    """One line naming the first field this server cannot honor."""
    thinks = reasoning.markers(getattr(engine, "tokenizer", None)) is not None
    if think_of(body.think) and not thinks:
        raise UserError("think: this model does not think (leave it out or set false)")
    for name in fields:
        if getattr(body, name, None) not in (None, "", []):
            why = {"images": "this server reads text only",
                   "suffix": "fill-in-the-middle is not served here",
                   "template": "the model's own chat template is used",
                   "context": "send the conversation to /api/chat instead"}[name]  # fmt: skip
            raise UserError(f"{name}: {why}")


def grammar(fmt: str | dict | None) -> str | None:
    """The constraint ``format`` asks for (``response_format``'s)."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return response_format_grammar({"type": "json_object"}, "format")
    if isinstance(fmt, dict):
        spec = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
        return response_format_grammar(spec, "format")
    raise UserError(f'format: must be "json" or a JSON schema, not {fmt!r}')


def sampling(options: Options | None, http: Request, window: int) -> dict[str, Any]:
    """Engine request fields from ``options``."""
    o = options or Options()
    out: dict[str, Any] = sampling_args(o.temperature, o.top_p)
    if o.top_k:
        out["top_k"] = o.top_k
    if o.num_predict is not None and o.num_predict > 0:
        out["max_tokens"] = o.num_predict
    if o.stop:
        out["stop"] = [o.stop] if isinstance(o.stop, str) else list(o.stop)
    if o.seed is not None:
        out["seed"] = o.seed
    if o.repeat_penalty is not None and o.repeat_penalty != 1.0:
        out["repetition_penalty"] = o.repeat_penalty
    if o.num_ctx is not None and o.num_ctx < window:
        events.note(http, f"num_ctx {o.num_ctx}: sessions here keep {window:,} tokens")
    return out


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The engine's messages: tool calls given ids (deterministic, so a resent
    transcript renders the same), each tool result the id of the call it answers."""
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name) of calls not answered yet
    for i, m in enumerate(messages):
        if m.images:
            raise UserError(f"messages.{i}.images: this server reads text only")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                function = call.get("function") or {}
                args = function.get("arguments", {})
                ident = call.get("id") or f"call_{i}_{j}"
                text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append({"id": ident, "type": "function",
                              "function": {"name": str(function.get("name", "")),
                                           "arguments": text}})  # fmt: skip
            message["tool_calls"] = calls
            pending = [(c["id"], c["function"]["name"]) for c in calls]
        elif m.role == "tool" and pending:
            named = [p for p in pending if p[1] == m.tool_name] or pending
            message["tool_call_id"] = named[0][0]
            pending.remove(named[0])
        out.append(message)
    return out


def _line(piece: dict[str, Any]) -> str:
    """A streamed piece as its JSON line (an error's status is the HTTP side's)."""
    return json.dumps({k: v for k, v in piece.items() if k != "status"}, ensure_ascii=False) + "\n"


def _call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call in ollama's shape (arguments an object)."""
    function = call["function"]
    try:
        args = json.loads(function["arguments"] or "{}")
    except json.JSONDecodeError:
        args = function["arguments"]
    return {"function": {"name": function["name"], "arguments": args}}


def _stats(usage: dict, finish: str | None, clock: dict[str, float]) -> dict[str, Any]:
    end = time.perf_counter()
    first = clock.get("first", end)
    return {
        "done": True,
        "done_reason": "length" if finish == "length" else "stop",
        "total_duration": int((end - clock["start"]) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": int(usage.get("prompt_tokens", 0)),
        "prompt_eval_duration": int((first - clock["start"]) * 1e9),
        "eval_count": int(usage.get("completion_tokens", 0)),
        "eval_duration": int((end - first) * 1e9),
    }


def register(app: FastAPI, models: Any) -> None:
    """Add ollama's routes to ``app`` (served by the engine of the body's ``model`` in
    ``models``, a :class:`~mlx_stream.serve.models.Models`; its ``keep_alive`` keeps
    that model loaded so long after its requests)."""

    async def pick(body: Body) -> Any:
        """The body's model's engine (its keep_alive applied), or the error response."""
        try:
            keep = None if body.keep_alive is None else parse_keep_alive(body.keep_alive)
        except UserError as exc:
            return error(400, str(exc))
        engine, refused = await events.engine_for(models, body.model)
        if refused is not None:
            return error(refused.status, refused.message, refused.headers())
        if body.keep_alive is not None:
            models.keep(engine, keep)
        return engine

    async def answer(body: Body, http: Request, chat: bool, fields: dict[str, Any], engine):
        try:
            fields |= sampling(body.options, http, engine.settings.cache.window)
            fields["thinking"] = think_of(body.think)
            fields["grammar"] = grammar(body.format)
        except UserError as exc:
            return error(400, str(exc))
        clock = {"start": time.perf_counter()}
        job, request, first = await events.start(engine, http=http, owner=owner_of(http), **fields)
        if isinstance(first, Failed):
            return error(*status_of(first)[:2])
        pieces = _pieces(job, request, {"model": body.model}, chat, clock, http)
        if body.stream:
            lines = (_line(p) async for p in pieces)
            return StreamingResponse(lines, media_type=NDJSON)
        whole: dict[str, Any] = {}
        async for p in pieces:  # one object: the pieces joined
            if "error" in p:
                return error(p.get("status", 500), p["error"])
            if whole:
                joined = whole.get("message", whole)
                part = p.get("message", p)
                for key in ("content" if chat else "response", "thinking"):
                    if key in part:
                        joined[key] = joined.get(key, "") + part[key]
                if part.get("tool_calls"):
                    joined["tool_calls"] = joined.get("tool_calls", []) + part["tool_calls"]
                whole.update(
                    {k: v for k, v in p.items() if k not in ("message", "response", "thinking")}
                )
            else:
                whole = p
        return JSONResponse(whole)

    def loaded(body: Body, chat: bool, engine: Any) -> JSONResponse:
        """An empty request: ollama's way to load a model (``keep_alive`` 0: to unload
        it), answered once it is done."""
        reason = "load"
        if body.keep_alive is not None and parse_keep_alive(body.keep_alive) == 0:
            reason = "unload" if models.unload(engine.model_id) else reason
        out = {"model": body.model, "created_at": now(), "done": True, "done_reason": reason}
        if chat:
            out["message"] = {"role": "assistant", "content": ""}
        else:
            out["response"] = ""
        return JSONResponse(out)

    @app.post(PREFIX + "chat")
    async def chat(body: ChatBody, http: Request):
        engine = await pick(body)
        if isinstance(engine, JSONResponse):
            return engine
        try:
            _refuse(body, (), engine)
            if not body.messages:
                return await asyncio.to_thread(loaded, body, True, engine)
            fields = {"messages": chat_messages(body.messages), "tools": body.tools or None}
        except UserError as exc:
            return error(400, str(exc))
        return await answer(body, http, True, fields, engine)

    @app.post(PREFIX + "generate")
    async def generate(body: GenerateBody, http: Request):
        engine = await pick(body)
        if isinstance(engine, JSONResponse):
            return engine
        try:
            _refuse(body, ("images", "suffix", "template", "context"), engine)
        except UserError as exc:
            return error(400, str(exc))
        if not body.prompt:
            return await asyncio.to_thread(loaded, body, False, engine)
        if body.raw:
            fields: dict[str, Any] = {"prompt": body.prompt}
        else:  # a fresh one-turn conversation each time, as ollama renders it
            system = [{"role": "system", "content": body.system}] if body.system else []
            fields = {"messages": [*system, {"role": "user", "content": body.prompt}]}
        return await answer(body, http, False, fields, engine)

    ollama_models.register(app, models)


async def _pieces(job: events.Job, request: Any, head: dict, chat: bool, clock: dict, http: Any):
    """ollama's reply as it goes: a dict per piece of text or tool call, then the
    ``done`` one (or one holding ``error``); a client that goes away cancels it."""

    def piece(text: str, calls: list | None = None) -> dict[str, Any]:
        if not chat:
            return {**head, "created_at": now(), "response": text, "done": False}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {**head, "created_at": now(), "message": message, "done": False}

    try:
        while True:
            event = await events.next_event(job, http)
            if event is None:  # the client left
                break
            if isinstance(event, (Delta, Reasoning, ToolCall)):
                clock.setdefault("first", time.perf_counter())
            match event:
                case Delta(text) if text:
                    yield piece(text)
                case Reasoning(text):  # the thought apart, as ollama's ``thinking``
                    out = piece("")
                    (out["message"] if chat else out)["thinking"] = text
                    yield out
                case ToolCall(_, call):
                    yield piece("", [_call(call)])
                case End(usage, finish):
                    yield {**piece(""), **_stats(usage, finish, clock)}
                    break
                case Failed() as failed:
                    status, message, _ = status_of(failed)
                    yield {"error": message, "status": status}
                    break
    finally:
        request.cancelled.set()  # a no-op once the engine has finished the request
