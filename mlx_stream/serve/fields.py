"""The agent fields of an OpenAI request body, as :class:`mlx_stream.serve.engine.Request`
arguments (shared by chat completions, completions and the Responses API).

Contract: :func:`openai_fields` reads ``logit_bias``, the penalties,
``response_format`` (compiled to an llguidance grammar here, so a bad schema is a 400
before the engine sees the request), ``tools`` and ``tool_choice``; a field it cannot
honor raises a :class:`~mlx_stream.errors.UserError` whose message starts with the
field's name (:func:`field_of` reads it back for the error's ``param``).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from mlx_stream.serve.structured import response_format_grammar

_FIELD = re.compile(r"^([A-Za-z_][\w.]*):")
# Below these, temperature and top-p overflow float32 into garbage (1 / 1e-300 is inf)
# while asking for what greedy decoding gives: they are served greedily.
MIN_TEMPERATURE = 1e-6
MIN_TOP_P = 1e-6
# What an X-Session-ID may be: visible ASCII, no spaces, at most 128 characters.
SESSION_ID = re.compile(r"[\x21-\x7e]{1,128}")


def field_of(message: str) -> str | None:
    """The field a one-line error names first (``"tools.0.function.name: ..."``)."""
    match = _FIELD.match(message)
    return match.group(1) if match else None


def openai_fields(body: Any) -> dict[str, Any]:
    """Engine request arguments from an OpenAI body's agent fields."""
    bias = getattr(body, "logit_bias", None)
    return {
        "logit_bias": {str(k): v for k, v in bias.items()} if bias else None,
        "presence_penalty": getattr(body, "presence_penalty", None),
        "frequency_penalty": getattr(body, "frequency_penalty", None),
        "grammar": response_format_grammar(getattr(body, "response_format", None)),
        "tools": getattr(body, "tools", None) or None,
        "tool_choice": getattr(body, "tool_choice", None),
        "thinking": thinking_of(getattr(body, "model_extra", None) or {}),
    }


def thinking_of(extra: dict[str, Any]) -> bool | None:
    """Whether an OpenAI body asks the model to think: ``chat_template_kwargs``'
    ``enable_thinking`` (vllm's and mlx-lm's servers take it), else ``reasoning_effort``
    (``"none"``: off, another level: on); ``None``: the template's default."""
    kwargs = extra.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("enable_thinking"), bool):
        return kwargs["enable_thinking"]
    effort = extra.get("reasoning_effort")
    return None if effort is None else effort != "none"


def sampling_args(temp: float | None, top_p: float | None) -> dict[str, float | None]:
    """``temp`` and ``top_p`` for the engine: greedy where they ask for it (what chat
    completions' bodies do, for the other APIs)."""
    if (temp is not None and temp < MIN_TEMPERATURE) or (top_p is not None and top_p < MIN_TOP_P):
        return {"temp": 0.0, "top_p": None}
    return {"temp": temp, "top_p": top_p}


def owner_of_key(key: str) -> str:
    """The namespace of sessions an API key owns: a hash, never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def owner_of(request: Any) -> str:
    """The owner of the sessions a request may see (``""`` on a server without keys):
    what :class:`~mlx_stream.serve.app.ApiKeys` put in its ASGI scope."""
    return request.scope.get("state", {}).get("owner", "")


def session_header(value: str | None) -> str | None:
    """The error of a malformed ``X-Session-ID`` header, else ``None``."""
    if value is not None and not SESSION_ID.fullmatch(value):
        return "X-Session-ID: must be 1 to 128 visible ASCII characters (no spaces)"
    return None
