"""ollama's model routes on ``serve``: ``GET /api/tags`` (what can be served),
``POST /api/show`` (one model's details, template and capabilities), ``GET /api/ps``
(what is loaded, its bytes), ``GET /api/version``.

Contract: one model is served and always loaded; it is listed under its id and the
names a request may use for it (its registry name, its Hugging Face id). Sizes are the
weights' bytes (``/api/ps``: weights and the sessions' memory); the digest is a hash of
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


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """ollama's error body: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def now() -> str:
    """ollama's timestamps: UTC, ISO 8601."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def not_found(name: str | None, engine: Any) -> JSONResponse:
    """The 404 of a model this server does not serve."""
    return error(404, f"model {name!r} not found (this server serves {engine.model_id!r})")


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


def register(app: FastAPI, engine: Any, check_model, names: tuple[str, ...] = ()) -> None:
    """Add the model routes to ``app``."""
    listed = [engine.model_id, *(n for n in names if n not in (engine.model_id, "default"))]
    started = now()

    def card(name: str) -> dict[str, Any]:
        return {"name": name, "model": name, "modified_at": started, "size": engine.weights,
                "digest": digest(engine.model_id), "details": details(engine)}  # fmt: skip

    @app.get("/api/tags")
    async def tags():
        return {"models": [card(n) for n in listed]}

    @app.post("/api/show")
    async def show(body: ShowBody):
        name = body.model or body.name
        if not name or check_model(name) is not None:
            return not_found(name, engine)
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
        memory = engine.stats.get("memory", {})
        loaded = card(engine.model_id)
        loaded["size"] = int(memory.get("used_bytes") or engine.weights)
        loaded["size_vram"] = 0  # unified memory: nothing apart for a GPU
        loaded["expires_at"] = "2999-01-01T00:00:00Z"  # loaded as long as it serves
        return {"models": [loaded]}

    @app.get("/api/version")
    async def version():
        return {"version": mlx_stream.__version__}
