"""Tool-call formats of model families whose calls mlx-lm's parsers do not read.

Contract: :func:`native` gives the format a tokenizer's chat template writes calls in,
found from the template's text as mlx-lm finds its own (mlx-lm's parser wins where it
has one: Qwen3's JSON, Qwen3-Coder's XML, Mistral, GLM 4.x, Kimi K2, Gemma 4, ...):
DeepSeek V3/R1 (and V3.1's shorter call), Granite 3.x, Phi-4-mini, Llama 3.1-3.3's
JSON mode and gpt-oss's harmony (a call as :mod:`~mlx_stream.serve.harmony` passes it
on, whatever header the model wrote:
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``).
Each is its start marker, its end marker (``""``: the call runs to the end of the
reply) and a parser from the text between them to mlx-lm's shape: a list of
``{"name", "arguments"}``. A body that is not a call raises ``ValueError`` (the reply
then keeps it as text). Gemma 3 (no call format in its template: the Hermes-style
fallback serves it) is not here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Format:
    """A family's calls: how its template is recognized, its markers, its parser."""

    name: str
    signs: tuple[str, ...]  # strings its chat template holds, all of them
    start: str
    end: str  # "" when the call runs to the end of the reply
    parse: Callable[[str, Any], list[dict]]
    absent: tuple[str, ...] = ()  # strings its template never holds
    forced: bool = True  # a forced call's grammar may write it between start and end


def _calls(value: Any, arguments: str = "arguments") -> list[dict]:
    """``[{"name", "arguments"}]`` from a parsed call or list of calls."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"not a tool call: {item!r}")
        args = item.get(arguments, item.get("arguments", {}))
        if isinstance(args, str):  # some families write the arguments as a JSON string
            args = json.loads(args)
        out.append({"name": item["name"], "arguments": args})
    return out


def _json_list(text: str, tools: Any = None) -> list[dict]:
    """Granite's and Phi-4-mini's body: a JSON list (or one object) of calls."""
    return _calls(json.loads(text.strip()))


def _llama3(text: str, tools: Any = None) -> list[dict]:
    """Llama 3.x's JSON mode: ``{"name": ..., "parameters": {...}}``, several separated
    by ``;`` or new lines (the start marker, ``{"name"``, is part of the first)."""
    text, decoder, out = '{"name"' + text, json.JSONDecoder(), []
    at = 0
    while at < len(text):
        while at < len(text) and text[at] in " \n\t;":
            at += 1
        if at == len(text):
            break
        value, at = decoder.raw_decode(text, at)
        out += _calls(value, "parameters")
    return out


DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL
)
FENCED = re.compile(r"^\s*(\S+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _deepseek(text: str, tools: Any = None) -> list[dict]:
    """DeepSeek V3/R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the
    arguments in a json fence; V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS``."""
    out = []
    for kind, rest in DEEPSEEK_CALL.findall(text):
        fenced = FENCED.match(rest) if kind.strip() == "function" else None
        name, args = (fenced.group(1), fenced.group(2)) if fenced else (kind.strip(), rest)
        out += _calls({"name": name, "arguments": json.loads(args)})
    if not out:
        raise ValueError(f"not a DeepSeek tool call: {text!r}")
    return out


HARMONY_NAME = re.compile(
    r"\s*([^\s<]+)[^<]*(?:<\|constrain\|>\s*\w*\s*)?<\|message\|>(.*)", re.DOTALL
)


def _harmony(text: str, tools: Any = None) -> list[dict]:
    """gpt-oss's call past ``to=functions.``: ``NAME <|constrain|>json<|message|>ARGS``."""
    match = HARMONY_NAME.fullmatch(text)
    if match is None:
        raise ValueError(f"not a harmony tool call: {text!r}")
    return _calls({"name": match.group(1), "arguments": json.loads(match.group(2))})


FORMATS = (
    Format("deepseek", ("<｜tool▁calls▁begin｜>",), "<｜tool▁calls▁begin｜>",
           "<｜tool▁calls▁end｜>", _deepseek),
    Format("phi4", ("<|tool_call|>", "<|/tool_call|>"), "<|tool_call|>", "<|/tool_call|>",
           _json_list),
    Format("granite", ("<|tool_call|>",), "<|tool_call|>", "", _json_list,
           absent=("<|/tool_call|>",)),
    Format("llama3", ("<|python_tag|>", '"parameters"'), '{"name"', "", _llama3),
    Format("harmony", ("<|channel|>", "<|message|>"), "<|channel|>commentary to=functions.",
           "<|call|>", _harmony, forced=False),  # its reader reads the model's header
)  # fmt: skip


def native(tokenizer: Any) -> Format | None:
    """The call format of ``tokenizer``'s chat template among :data:`FORMATS`, unless
    mlx-lm has a parser for it (``has_tool_calling``); ``None`` when neither knows it."""
    if getattr(tokenizer, "has_tool_calling", False):
        return None
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    for fmt in FORMATS:
        if all(s in template for s in fmt.signs) and not any(s in template for s in fmt.absent):
            return fmt
    return None
