"""ollama's model routes on ``serve``: ``GET /api/tags`` (what can be served),
``POST /api/show`` (one model's details, template and capabilities), ``GET /api/ps``
(what is loaded, its bytes), ``GET /api/version``.

Contract: every model that can be served is listed (``/api/ps``: those loaded, with
when their keep-alive ends), a loaded one also under the other names a request may use
for it (its registry name, its Hugging Face id). Sizes are the weights' bytes (0 for
one not loaded; ``/api/ps``: weights and the sessions' memory); the digest is a hash of
the id (there is no blob store); ``capabilities`` are ``completion`` and ``tools``
(every model takes tools here: its template's format, else the Hermes-style fallback).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

import mlx_stream

FOREVER = "2999-01-01T00:00:00Z"  # /api/ps' expiry of a model never unloaded by time


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """ollama's error body: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def now() -> str:
    """ollama's timestamps: UTC, ISO 8601."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def stamp(seconds: float) -> str:
    """ollama's timestamp of ``seconds`` since the epoch."""
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    name: str | None = None  # what older clients send
    verbose: bool = False


def details(engine: Any) -> dict[str, Any]:
    """ollama's ``details`` of the served model."""
    from mlx.utils import tree_flatten

    args = getattr(engine.model, "args", None)
    family = str(getattr(args, "model_type", "") or "unknown")
    params = sum(v.size for _, v in tree_flatten(engine.model.parameters()))
    dtypes = {
        str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(engine.model.parameters())
    }
    quantized = "uint32" in dtypes  # packed quantized weights
    return {
        "parent_model": "",
        "format": "mlx",
        "family": family,
        "families": [family],
        "parameter_size": _size(params),
        "quantization_level": "quantized" if quantized else "/".join(sorted(dtypes)),
    }


def _size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + unit
    return str(n)


def digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def register(app: FastAPI, models: Any) -> None:
    """Add the model routes to ``app`` (``models``: a
    :class:`~mlx_stream.serve.models.Models`)."""
    from mlx_stream.serve import events

    started = now()

    def card(name: str, model_id: str, engine: Any) -> dict[str, Any]:
        info = details(engine) if engine is not None else {"format": "mlx"}
        size = engine.weights if engine is not None else 0
        return {"name": name, "model": name, "modified_at": started, "size": size,
                "digest": digest(model_id), "details": info}  # fmt: skip

    @app.get("/api/tags")
    async def tags():
        cards = []
        for m in models.listing():
            names = [m["id"], *models.names_of(m["id"])]
            cards += [card(n, m["id"], m["engine"]) for n in names]
        return {"models": cards}

    @app.post("/api/show")
    async def show(body: ShowBody):
        name = body.model or body.name
        if not name:
            return error(404, "model: give the name of a model")
        engine, refused = await events.engine_for(models, name)
        if refused is not None:
            return error(refused.status, refused.message)
        args = getattr(engine.model, "args", None)
        info = details(engine)
        arch = info["family"]
        model_info = {"general.architecture": arch, "general.basename": engine.model_id}
        context = getattr(args, "max_position_embeddings", None)
        if context:
            model_info[f"{arch}.context_length"] = int(context)
        window = engine.settings.cache.window
        parameters = f"num_ctx {window + engine.settings.cache.sinks}"
        template = getattr(engine.tokenizer, "chat_template", None) or ""
        return {
            "modelfile": f"# served by mlx-stream {mlx_stream.__version__}\nFROM {engine.model_id}\n",
            "parameters": parameters,
            "template": template if isinstance(template, str) else "",
            "details": info,
            "model_info": model_info,
            "capabilities": ["completion", "tools"],
            "modified_at": started,
        }

    @app.get("/api/ps")
    async def ps():
        out = []
        for m in (m for m in models.listing() if m["loaded"]):
            engine = m["engine"]
            memory = engine.stats.get("memory", {})
            loaded = card(m["id"], m["id"], engine)
            loaded["size"] = int(memory.get("used_bytes") or engine.weights)
            loaded["size_vram"] = 0  # unified memory: nothing apart for a GPU
            until = models.expires(m["id"])  # None: loaded as long as it serves
            loaded["expires_at"] = FOREVER if until is None else stamp(until)
            out.append(loaded)
        return {"models": out}

    @app.get("/api/version")
    async def version():
        return {"version": mlx_stream.__version__}
