"""OpenAI's Responses API on ``serve``: ``POST /v1/responses`` (whole or streamed) and
``GET /v1/responses/{id}``, what Codex speaks.

Contract: a request is translated into the engine's one request type and its events
back into Responses shapes; nothing here runs the model. ``input`` (text or items:
messages, ``function_call`` and ``function_call_output``) and ``instructions``
become the transcript; ``previous_response_id`` continues a response kept here (in
memory, the newest :data:`MAX_STORED`, unless made with ``store: false``) on the same
session. Output: a ``reasoning`` item for a model that thinks, a ``message`` item and
a ``function_call`` item per call, streamed as the Responses event sequence with
``sequence_number``. In full: ``docs/serve.md``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from mlx_stream.errors import UserError
from mlx_stream.serve import events
from mlx_stream.serve.event_types import Delta, End, Failed, Reasoning, ToolCall
from mlx_stream.serve.fields import field_of, owner_of, sampling_args, session_header, thinking_of
from mlx_stream.serve.statuses import status_of
from mlx_stream.serve.structured import json_schema_grammar, response_format_grammar
from mlx_stream.serve.tools import canonical_messages

MAX_STORED = 1024  # responses kept for previous_response_id and GET


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    reasoning: dict[str, Any] | None = None  # its effort: "none" asks for no thought
    metadata: dict[str, Any] | None = None
    store: bool = True


TEXT_PARTS = ("input_text", "output_text", "text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def _parts_text(content: Any, where: str) -> str:
    """The text of a message's parts; a refusal part is left out, media are refused."""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content or []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise UserError(f"{where}.{j}.type: {kind} is not supported: this model reads text")
        if kind in TEXT_PARTS:
            out.append(part.get("text") or "")
    return "".join(out)


def input_messages(items: str | list[dict], open_ids: set[str]) -> list[dict[str, Any]]:
    """Engine messages of a Responses ``input`` (``open_ids``: calls not yet answered,
    from the previous response, updated)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise UserError(f"{where}.role: must be user, assistant, system or developer")
            out.append(
                {"role": role, "content": _parts_text(item.get("content"), f"{where}.content")}
            )
            if role == "user":
                open_ids.clear()
        elif kind == "function_call":
            if not item.get("call_id") or not item.get("name"):
                raise UserError(f"{where}: a function_call needs a call_id and a name")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}  # fmt: skip
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
            open_ids.add(item["call_id"])
        elif kind == "function_call_output":
            if item.get("call_id") not in open_ids:
                raise UserError(
                    f"{where}.call_id: {item.get('call_id')!r} answers no function_call"
                )
            output = item.get("output")
            if isinstance(output, list):
                output = _parts_text(output, f"{where}.output")
            elif not isinstance(output, str):
                output = json.dumps(output, ensure_ascii=False)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        # Other items (reasoning, hosted tools' calls) are not part of the prompt.
    return out


def function_tools(tools: list[dict] | None) -> tuple[list[dict] | None, dict, list[str]]:
    """Responses' function tools as chat completions' nested ones: ``namespace``
    groups flattened (each function keeps its name, the one the client knows), the
    namespace of each such name, and the hosted tools left out (nothing runs them)."""
    out, namespaces, hosted = [], {}, []

    def add(tool: dict, where: str) -> None:
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise UserError(f"{where}.name: required")
        spec = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": spec})

    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind == "function":
            add(tool, f"tools.{i}")
        elif kind == "namespace":
            for j, inner in enumerate(tool.get("tools") or []):
                if inner.get("type", "function") == "function":
                    add(inner, f"tools.{i}.tools.{j}")
                    namespaces[inner["name"]] = tool.get("name")
                else:
                    hosted.append(str(inner.get("name") or inner.get("type")))
        else:
            hosted.append(str(tool.get("name") or kind))
    return out or None, namespaces, hosted


def _choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


class Store:
    """Responses kept for ``previous_response_id`` and ``GET``: the response object,
    the conversation after it and its session (newest :data:`MAX_STORED`), each seen
    only by its owner (the API key that made it, as sessions are)."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit, self.items = limit, OrderedDict()

    def put(self, ident: str, response: dict, messages: list[dict], session, owner: str):
        self.items[(owner, ident)] = (response, messages, session)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def get(self, ident: str, owner: str):
        return self.items.get((owner, ident))


def _usage(usage: dict) -> dict[str, Any]:
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0
            )
        },
        "total_tokens": usage.get("total_tokens", 0),
        **events.repair_counts(usage),
    }


class _Shape:
    """The response object of one request, built up as its events arrive."""

    def __init__(self, body: ResponsesRequest, model: str, namespaces: dict | None = None):
        self.namespaces = namespaces or {}  # function name -> its namespace group
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.message_id = "msg_" + uuid.uuid4().hex[:24]
        self.body, self.model, self.created = body, model, int(time.time())
        self.text, self.calls, self.usage, self.finish = "", [], None, None
        self.reasoning, self.reasoning_id = "", "rs_" + uuid.uuid4().hex[:24]

    def reasoning_item(self, status: str = "completed") -> dict[str, Any]:
        part = {"type": "reasoning_text", "text": self.reasoning}
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
                "content": [part]}  # fmt: skip

    def message_item(self, status: str = "completed") -> dict[str, Any]:
        part = {"type": "output_text", "text": self.text, "annotations": []}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [part]}  # fmt: skip

    def call_item(self, call: dict, status: str = "completed") -> dict[str, Any]:
        fn = call["function"]
        item = {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"),
                "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"],
                "status": status}  # fmt: skip
        if fn["name"] in self.namespaces:
            item["namespace"] = self.namespaces[fn["name"]]
        return item

    def output(self) -> list[dict[str, Any]]:
        items = [self.reasoning_item()] if self.reasoning else []
        items += [self.message_item()] if self.text or not self.calls else []
        return items + [self.call_item(c) for c in self.calls]

    def response(self, status: str) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if self.finish == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.output() if status != "in_progress" else [],
            "instructions": b.instructions, "previous_response_id": b.previous_response_id,
            "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": True, "temperature": b.temperature, "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "text": b.text or {"format": {"type": "text"}}, "error": None,
            "incomplete_details": incomplete,
            "usage": _usage(self.usage) if self.usage is not None else None,
        }  # fmt: skip

    def reply_message(self) -> dict[str, Any]:
        """The reply in the engine's message shape (for the stored conversation)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def error(status: int, message: str, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error" if status == 400
                      else "server_error", "param": field_of(message), "code": None}}  # fmt: skip
    return JSONResponse(body, status_code=status, headers=headers)


def register(app: FastAPI, models: Any) -> None:
    """Add the Responses API routes to ``app`` (served by the engine of the body's
    ``model`` in ``models``, a :class:`~mlx_stream.serve.models.Models`)."""

    store = Store()

    @app.post("/v1/responses")
    async def create(
        body: ResponsesRequest, http: Request, x_session_id: Annotated[str | None, Header()] = None
    ):
        bad_id = session_header(x_session_id)
        if bad_id is not None:
            return error(400, bad_id)
        owner = owner_of(http)
        engine, refused = await events.engine_for(models, body.model)
        if refused is not None:  # OpenAI's shape for a model, as the chat route's
            said = {"error": {"message": refused.message, "param": "model", "code": None,
                              "type": "not_found_error" if refused.status == 404
                              else "server_error"}}  # fmt: skip
            return JSONResponse(said, status_code=refused.status, headers=refused.headers())
        session_id, history, open_ids = x_session_id, [], set()
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id, owner)
            if previous is None:
                return error(
                    404, f"previous_response_id: no response {body.previous_response_id!r} here"
                )
            _, history, session_id = previous
            history = [m for m in history if m["role"] not in ("system", "developer")]
            if history and history[-1].get("tool_calls"):
                open_ids = {c["id"] for c in history[-1]["tool_calls"]}
        try:
            new = input_messages(body.input, open_ids)
            fmt = (body.text or {}).get("format")
            grammar = _grammar(fmt)
            tools, namespaces, hosted = function_tools(body.tools)
        except UserError as exc:
            return error(400, str(exc))
        if hosted:
            events.note(
                http, f"hosted tools left out (nothing runs them here): {', '.join(hosted)}"
            )
        head = [{"role": "system", "content": body.instructions}] if body.instructions else []
        messages = head + history + new
        job, request, first = await events.start(
            engine, http=http, messages=messages, session_id=session_id,
            max_tokens=body.max_output_tokens,
            grammar=grammar, tools=tools, tool_choice=_choice(body.tool_choice), owner=owner,
            thinking=thinking_of({"reasoning_effort": (body.reasoning or {}).get("effort")}),
            **sampling_args(body.temperature, body.top_p),
        )  # fmt: skip
        if isinstance(first, Failed):
            refused = status_of(first)
            return error(refused.status, refused.message, refused.headers())
        session_id = first.session_id
        headers = {"X-Session-ID": session_id} if session_id else None
        shape = _Shape(body, engine.model_id, namespaces)

        def keep() -> dict[str, Any]:
            status = "incomplete" if shape.finish == "length" else "completed"
            response = shape.response(status)
            if body.store:  # store: false (Codex sends it) keeps nothing, as OpenAI does
                conversation = [*canonical_messages(request.messages), shape.reply_message()]
                store.put(shape.id, response, conversation, session_id, owner)
            return response

        if body.stream:
            stream = _stream(job, request, shape, keep)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        reply = await events.drain(job, request, http)
        if reply.error is not None:
            return error(*reply.error)
        shape.text, shape.reasoning, shape.calls, shape.usage, shape.finish = (
            reply.text,
            reply.reasoning,
            reply.calls,
            reply.usage,
            reply.finish,
        )
        return JSONResponse(keep(), headers=headers)

    @app.get("/v1/responses/{ident}")
    async def retrieve(ident: str, http: Request):
        stored = store.get(ident, owner_of(http))
        if stored is None:
            return error(404, f"no response {ident!r} here")
        return stored[0]


def _grammar(fmt: dict | None) -> str | None:
    """The grammar of ``text.format`` (flat: ``{"type": "json_schema", "schema"}``)."""
    if fmt and fmt.get("type") == "json_schema":
        return json_schema_grammar(fmt.get("schema", {"type": "object"}), "text.format.schema")
    return response_format_grammar(fmt, "text.format")


async def _stream(job: events.Job, request: Any, shape: _Shape, keep):
    """The Responses event sequence of one reply; a client that goes away cancels it."""
    sequence = 0

    def sse(kind: str, **data: Any) -> str:
        nonlocal sequence
        sequence += 1
        payload = {"type": kind, "sequence_number": sequence - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    try:
        yield sse("response.created", response=shape.response("in_progress"))
        yield sse("response.in_progress", response=shape.response("in_progress"))
        index, text_open = 0, False
        while True:
            event = await job.events.get()
            if isinstance(event, events.Ping):  # a long prompt: an event keeps it alive
                yield sse("response.in_progress", response=shape.response("in_progress"))
            if isinstance(event, Reasoning):
                if not shape.reasoning:
                    item = {**shape.reasoning_item("in_progress"), "content": []}
                    yield sse("response.output_item.added", output_index=index, item=item)
                shape.reasoning += event.text
                yield sse("response.reasoning_text.delta", item_id=shape.reasoning_id,
                          output_index=index, content_index=0, delta=event.text)  # fmt: skip
                continue
            if shape.reasoning and index == 0 and isinstance(event, (Delta, ToolCall, End)):
                yield sse("response.reasoning_text.done", item_id=shape.reasoning_id,
                          output_index=index, content_index=0, text=shape.reasoning)  # fmt: skip
                yield sse("response.output_item.done", output_index=index,
                          item=shape.reasoning_item())  # fmt: skip
                index += 1
            if isinstance(event, Delta) and event.text:
                if not text_open:
                    item = {**shape.message_item("in_progress"), "content": []}
                    yield sse("response.output_item.added", output_index=index, item=item)
                    part = {"type": "output_text", "text": "", "annotations": []}
                    yield sse("response.content_part.added", item_id=shape.message_id,
                              output_index=index, content_index=0, part=part)  # fmt: skip
                    text_open = True
                shape.text += event.text
                yield sse("response.output_text.delta", item_id=shape.message_id,
                          output_index=index, content_index=0, delta=event.text)  # fmt: skip
            elif isinstance(event, (ToolCall, End)) and text_open:
                yield sse("response.output_text.done", item_id=shape.message_id,
                          output_index=index, content_index=0, text=shape.text)  # fmt: skip
                part = {"type": "output_text", "text": shape.text, "annotations": []}
                yield sse("response.content_part.done", item_id=shape.message_id,
                          output_index=index, content_index=0, part=part)  # fmt: skip
                yield sse(
                    "response.output_item.done", output_index=index, item=shape.message_item()
                )
                index, text_open = index + 1, False
            if isinstance(event, ToolCall):
                call = event.call
                shape.calls.append(call)
                item = shape.call_item(call, "in_progress")
                yield sse(
                    "response.output_item.added", output_index=index, item={**item, "arguments": ""}
                )
                args = call["function"]["arguments"]
                yield sse("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=index, delta=args)  # fmt: skip
                yield sse("response.function_call_arguments.done", item_id=item["id"],
                          output_index=index, arguments=args)  # fmt: skip
                yield sse(
                    "response.output_item.done", output_index=index, item=shape.call_item(call)
                )
                index += 1
            elif isinstance(event, End):
                shape.usage, shape.finish = event.usage, event.finish_reason
                response = keep()
                kind = (
                    "response.incomplete"
                    if response["status"] == "incomplete"
                    else "response.completed"
                )
                yield sse(kind, response=response)
                break
            elif isinstance(event, Failed):
                status, message, _ = status_of(event)
                yield sse("error", code=str(status), message=message, param=None)
                break
    finally:
        request.cancelled.set()  # a no-op once the engine has finished the request
