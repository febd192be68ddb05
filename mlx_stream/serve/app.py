"""The OpenAI-compatible HTTP side of ``mlx-stream serve`` (FastAPI).

Contract: request bodies are validated by pydantic models (bad JSON or a bad field is
a 400 naming the field, in OpenAI's error shape); every model call happens on the
:class:`~mlx_stream.serve.engine.Engine`'s worker thread, this side only turns requests into
:class:`~mlx_stream.serve.engine.Request` objects and the worker's events into JSON or
server-sent events. A streaming client that disconnects cancels its request.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_stream.errors import UserError
from mlx_stream.serve import events
from mlx_stream.serve.accesslog import AccessLog
from mlx_stream.serve.engine import Engine
from mlx_stream.serve.event_types import Delta, End, Failed, Reasoning, ToolCall
from mlx_stream.serve.fields import (
    field_of,
    openai_fields,
    owner_of,
    owner_of_key,
    sampling_args,
    session_header,
)
from mlx_stream.serve.guard import BrowserGuard, Browsers, JsonOnly
from mlx_stream.serve.logprobs import MAX_TOP
from mlx_stream.serve.models import Models
from mlx_stream.serve.statuses import status_of

DEFAULT_MAX_BODY = 4 << 20  # bytes of a request body
MAX_SEED = (1 << 63) - 1  # OpenAI's seed is an int64; mlx's random state takes 0..2^64-1


# ----------------------------------------------------------------------- bodies


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return "".join(part.text for part in self.content)

    def engine(self) -> dict[str, Any]:
        """The message as the engine takes it (tool calls and results kept)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI fields this server cannot honor, with the values that ask for nothing. A
# request that sets one otherwise is refused (400 naming it), never answered as if it
# had not been set; fields that change no output (user, metadata, ...) are ignored.
UNSUPPORTED: dict[str, tuple] = {
    "functions": (None, []),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "audio": (None,),
}


class Sampling(BaseModel):
    """The fields chat and plain completions share (OpenAI's names and ranges)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def sampling(self) -> dict[str, float | None]:
        """``temp`` and ``top_p`` for the engine: greedy where they ask for it."""
        return sampling_args(self.temperature, self.top_p)

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or ``None``."""
        for name, neutral in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value not in neutral:
                return name
        return None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)

    def alternatives(self) -> int | None:
        """``Request.logprobs``: None (not asked) or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=5)

    def alternatives(self) -> int | None:
        return self.logprobs


# ----------------------------------------------------------------------- errors


def error(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        421: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_at(path: str, status: int, message: str, param=None, headers=None) -> JSONResponse:
    """:func:`error` in the shape of the API that ``path`` belongs to."""
    from mlx_stream.serve import anthropic, ollama

    if path.startswith(anthropic.PREFIX):
        return anthropic.error(status, message, headers)
    if path.startswith(ollama.PREFIX):
        return ollama.error(status, message, headers)
    return error(status, message, param, headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('msg', '')})", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413: by their Content-Length
    before reading them, else (a chunked body) as soon as more than ``limit`` bytes
    arrived. The body is read whole here and handed on, so the app never sees a cut one."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._refuse(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope, receive, send):
        message = f"the request body is larger than {self.limit:,} bytes"
        response = error_at(scope.get("path", ""), 413, message)
        await response(scope, receive, send)


def _replay(messages: list[dict], receive):
    """An ASGI ``receive`` that gives ``messages`` first, then reads on."""

    async def replayed():
        return messages.pop(0) if messages else await receive()

    return replayed


def read_api_keys(path) -> list[str]:
    """The keys in a keys file: one per line, blank lines and ``#`` comments skipped."""

    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"--api-keys {path}: cannot read ({getattr(exc, 'strerror', exc)})"
        ) from exc
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise UserError(f"--api-keys {path}: holds no key")
    return keys


class ApiKeys:
    """401 for a request without ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``,
    what Anthropic's clients send) naming one of ``keys`` (compared in constant time);
    ``/health`` stays open for probes (saying more with a key). The key's owner
    (:func:`owner_of_key`) goes with the request: each key has its own sessions."""

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = [(k.encode(), owner_of_key(k)) for k in keys]

    def owner(self, headers: dict) -> str | None:
        """The owner of the key ``headers`` carry, or ``None``."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token, keyed = token.strip(), headers.get(b"x-api-key", b"").strip()
        owner = None
        for key, name in self.keys:  # every key compared: the time says nothing
            if hmac.compare_digest(token, key) and scheme.lower() == b"bearer":
                owner = name
            if hmac.compare_digest(keyed, key):  # Anthropic's clients send x-api-key
                owner = name
        return owner

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            owner = self.owner(dict(scope.get("headers") or []))
            if owner is None and scope.get("path", "") != "/health":
                message = (
                    "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
                )
                response = error_at(scope["path"], 401, message)
                return await response(scope, receive, send)
            if owner is not None:
                scope = {**scope, "state": {**scope.get("state", {}), "owner": owner}}
        return await self.app(scope, receive, send)


CEILING_HEADER = "X-Max-Tokens-Ceiling"  # the operator's cap on max_tokens, when set


class AddHeader:
    """Add one header to every response (the operator's max_tokens ceiling)."""

    def __init__(self, app, name: str, value: str):
        self.app, self.header = app, (name.lower().encode(), value.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        return await self.app(scope, receive, with_header)


# -------------------------------------------------------------------------- app


def create_app(
    engine: Engine | Models,
    max_body: int = DEFAULT_MAX_BODY,
    api_keys: list[str] | None = None,
    aliases: tuple[str, ...] = (),
    quiet: bool = False,
    ui: bool = True,
    browsers: Browsers | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (or several models: a
    :class:`~mlx_stream.serve.models.Models`, the request's ``model`` picks one) under
    OpenAI's routes; with ``api_keys``, every route but ``/health`` answers only
    requests that carry ``Authorization: Bearer KEY`` for one of them, and each key sees
    only its own sessions. A request's ``model`` may be the served id, ``default`` or
    one of ``aliases`` (the model's registry name and Hugging Face id). Unless
    ``quiet``, each request writes a line to stderr (:mod:`mlx_stream.serve.accesslog`). With ``ui``, ``GET /`` is the chat page
    (:mod:`mlx_stream.serve.page`, open without a key: it asks for one). With
    ``browsers``, a request from another site or to another ``Host`` is refused
    (:mod:`mlx_stream.serve.guard`; the CLI always gives one)."""
    models = engine if isinstance(engine, Models) else Models(engine, aliases)
    engine = models.first
    app = FastAPI(title="mlx-stream", docs_url=None, redoc_url=None)
    app.add_middleware(JsonOnly, refuse=error_at)
    app.add_middleware(BodyLimit, limit=max_body)
    if api_keys:
        app.add_middleware(ApiKeys, keys=list(api_keys))
    ceiling = getattr(engine, "max_tokens_ceiling", None)
    if ceiling is not None:
        app.add_middleware(AddHeader, name=CEILING_HEADER, value=str(ceiling))
    if ui:  # outside ApiKeys: the page itself holds no secret
        from mlx_stream.serve.page import Page

        app.add_middleware(Page)
    if browsers is not None:  # outside the key check: a preflight carries no key
        app.add_middleware(BrowserGuard, browsers=browsers, refuse=error_at)
    from mlx_stream.serve.metrics import CONTENT_TYPE, Metrics

    metrics = Metrics(models)
    # last: outermost, so the refusals above are logged (and counted) too
    app.add_middleware(AccessLog, quiet=quiet, observe=metrics.observe)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_at(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_at(request.url.path, exc.status_code, str(exc.detail))

    @app.head("/")  # Claude Code's connectivity check before its first request
    async def root():
        return JSONResponse(None)

    @app.get("/health")
    async def health(http: Request):
        if api_keys and "owner" not in (http.scope.get("state") or {}):
            return {"status": "ok"}  # the model and the memory only to a key's holder
        first = models.first
        memory = first.stats.get("memory", {}) if first is not None else {}
        return {"status": "ok", "model": models.default, **memory}

    @app.get("/v1/models")
    async def listed():
        return {"object": "list", "data": [
            {"id": m["id"], "object": "model", "created": 0, "owned_by": "mlx-stream",
             "loaded": m["loaded"]} for m in models.listing()
        ]}  # fmt: skip

    @app.get("/v1/sessions")
    async def sessions(http: Request, model: str | None = None):
        picked = models.ready(model)  # a model's own sessions (default: the first's)
        if picked is None:
            return error(404, f"model {model!r} is not loaded here", "model")
        stats, owner = picked.stats, owner_of(http)
        mine = [
            {k: v for k, v in s.items() if k != "owner"}
            for s in stats.get("sessions", [])
            if s.get("owner", "") == owner
        ]
        from mlx_stream.serve.recall import TOTALS

        return {
            "object": "list",
            "data": mine,
            # over the caller's sessions: device bytes (flat) and recall store (growing)
            "totals": {k: sum(int(s.get(k, 0)) for s in mine) for k in TOTALS},
            **stats.get("counters", {}),
            "batch": stats.get("batch", {}),
        }

    async def run(body: Sampling, make: dict[str, Any], kind: str, http: Request):
        engine, refused = await events.engine_for(models, body.model)
        if refused is not None:
            param = "model" if refused.status == 404 else None
            return error(refused.status, refused.message, param, refused.headers())
        field = body.unsupported()
        if field is not None:
            return error(400, f"{field}: not supported by this server (leave it out)", field)
        try:
            agents = openai_fields(body)
        except UserError as exc:
            return error(400, str(exc), field_of(str(exc)))
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        job, request, first = await events.start(
            engine, http=http, stop=stop or None, seed=body.seed, logprobs=body.alternatives(),
            **body.sampling(), **agents, **make,
        )  # fmt: skip
        if isinstance(first, Failed):
            refused = status_of(first)
            param = field_of(refused.message) if refused.status == 400 else None
            return error(refused.status, refused.message, param, headers=refused.headers())
        session_id = first.session_id
        headers = {"X-Session-ID": session_id} if session_id else None
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        shape = _Shape(kind, ident, created, engine.model_id, request.logprobs is not None)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(job, request.cancelled, shape, usage),
                media_type="text/event-stream",
                headers=headers,
            )
        reply = await events.drain(job, request, http)
        if reply.error is not None:
            return error(*reply.error)
        whole = shape.whole(reply.text, reply.finish, reply.usage, reply.logprobs, reply.calls)
        if reply.reasoning:  # the thought apart (serve.reasoning), as DeepSeek's API names it
            whole["choices"][0]["message"]["reasoning_content"] = reply.reasoning
        return JSONResponse(whole, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatRequest,
        http: Request,
        x_session_id: Annotated[str | None, Header()] = None,
    ):
        if body.top_logprobs and not body.logprobs:
            return error(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        bad_id = session_header(x_session_id)
        if bad_id is not None:
            return error(400, bad_id, "X-Session-ID")
        messages = [m.engine() for m in body.messages]
        make = {
            "messages": messages,
            "session_id": x_session_id,
            "max_tokens": body.max_completion_tokens or body.max_tokens,
        }
        return await run(body, make, "chat", http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await run(body, {"prompt": body.prompt, "max_tokens": body.max_tokens}, "text", http)

    from mlx_stream.serve import anthropic, ollama, responses

    anthropic.register(app, models)  # POST /v1/messages (Claude Code)
    responses.register(app, models)  # POST /v1/responses (Codex)
    ollama.register(app, models)  # /api/... (ollama's clients)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    metrics.routes = {getattr(r, "path", "") for r in app.routes}

    return app


def openai_finish(finish: str | None) -> str | None:
    """OpenAI's ``finish_reason`` for the engine's: a reply stopped as a loop
    (``serve --stop-loops``) ended as a finished one."""
    return "stop" if finish == "loop" else finish


class _Shape:
    """OpenAI's response and chunk shapes for chat (``kind="chat"``) or text; with
    ``logprobs``, each choice carries its tokens' entries (chat: ``{"content": [...]}``,
    text: the legacy ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``)."""

    def __init__(self, kind: str, ident: str, created: int, model: str, logprobs: bool = False):
        self.kind, self.ident, self.created, self.model = kind, ident, created, model
        self.logprobs, self.offset = logprobs, 0

    def _logprobs(self, pairs: list[tuple[str, dict]]) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice from (text emitted with the token, its entry)."""
        if not self.logprobs:
            return None
        entries = [e for _, e in pairs]
        if self.kind == "chat":
            return {"content": entries}
        offsets = []  # where each token's text begins in the completion's text
        for text, _ in pairs:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries
            ],
            "text_offset": offsets,
        }

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        if chunk and self.kind == "chat":
            obj += ".chunk"
        return {"id": self.ident, "object": obj, "created": self.created, "model": self.model}

    def whole(
        self, text: str, finish: str, usage: dict, logprobs: list[tuple[str, dict]],
        calls: list[dict] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            if calls:
                message = {"role": "assistant", "content": text or None, "tool_calls": calls}
                choice["message"] = message
            if self.logprobs:
                choice["logprobs"] = self._logprobs(logprobs)
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs)}
        choice["finish_reason"] = openai_finish(finish)
        return {**self._head(False), "choices": [choice], "usage": usage}

    def chunk(
        self, text: str | None, finish: str | None, first: bool = False, logprob: Any = None
    ) -> dict[str, Any]:
        entries = [(text or "", logprob)] if logprob is not None else []
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
            if self.logprobs and entries:
                choice["logprobs"] = self._logprobs(entries)
        else:
            logprobs = self._logprobs(entries) if entries else None
            choice = {"index": 0, "text": text or "", "logprobs": logprobs}
        choice["finish_reason"] = openai_finish(finish)
        return {**self._head(True), "choices": [choice]}

    def call_chunk(self, index: int, call: dict) -> dict[str, Any]:
        """A streamed tool call: one delta holding the whole call (its ``index``)."""
        delta = {"tool_calls": [{"index": index, **call}]}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(job: events.Job, cancelled: threading.Event, shape: _Shape, include_usage: bool):
    """Server-sent events of one request (a ``: ping`` comment line while its prompt
    goes in); a client that goes away cancels it."""
    try:
        yield _event(shape.chunk("", None, first=True))
        while True:
            event = await job.events.get()
            match event:
                case Delta(text, logprob):
                    yield _event(shape.chunk(text, None, logprob=logprob))
                case ToolCall(index, call):
                    yield _event(shape.call_chunk(index, call))
                case Reasoning(text):
                    chunk = shape.chunk(None, None)
                    chunk["choices"][0]["delta"]["reasoning_content"] = text
                    yield _event(chunk)
                case End(usage, finish):
                    yield _event(shape.chunk(None, finish))
                    if include_usage:
                        yield _event(shape.usage_chunk(usage))
                    break
                case events.Ping():  # a long prompt goes in: a comment keeps the line up
                    yield ": ping\n\n"
                case Failed() as failed:
                    status, message, _ = status_of(failed)
                    yield _event(
                        {"error": {"message": message, "type": "server_error", "code": status}}
                    )
                    break
        yield "data: [DONE]\n\n"
    finally:
        cancelled.set()  # a no-op once the engine has finished the request
