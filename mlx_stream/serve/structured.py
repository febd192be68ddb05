"""Structured output for ``serve``: replies constrained by llguidance grammars.

Contract: :func:`json_schema_grammar` / :func:`response_format_grammar` turn
``response_format`` (and tool calls, :mod:`mlx_stream.serve.tools`) into a grammar,
refusing a schema llguidance cannot compile with a
:class:`~mlx_stream.errors.UserError` naming the field; a tool's arguments are held to
:func:`tool_arguments_schema`, which loosens what llguidance cannot enforce. The
engine makes one :class:`Constraint` per reply from :class:`Grammars`: an mlx-lm
style logits processor that sets every token the grammar does not allow next to
``-inf`` (per row inside batched decoding too); once complete, only end of sequence.
JSON is written as ``json.dumps`` writes it, so a call renders back to the same text.
In full: ``docs/serve.md``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from mlx_stream.errors import UserError
from mlx_stream.mlxlm import hf_tokenizer

# JSON written like json.dumps(): no free whitespace, ", " and ": " separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _problem(grammar: str) -> str | None:
    """What llguidance finds wrong with ``grammar`` (``None``: it compiles)."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0].strip() if messages else "invalid") if is_error else None


def _check(grammar: str, field: str) -> str:
    why = _problem(grammar)
    if why is not None:
        raise UserError(f"{field}: not a schema llguidance can enforce ({why})")
    return grammar


def json_schema_grammar(schema: Any, field: str, lenient: bool = False) -> str:
    """The grammar of JSON matching ``schema`` (a JSON Schema object), or a
    :class:`UserError` naming ``field``. ``lenient``: keywords llguidance does not
    implement are ignored instead of refused (tool schemas written for other servers)."""
    import llguidance

    if not isinstance(schema, dict):
        raise UserError(f"{field}: must be a JSON Schema object")
    options = {**JSON_OPTIONS, "lenient": lenient}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{field}: not a JSON Schema ({exc})") from exc
    return _check(grammar, field)


def schema_file_grammar(path: str | Path) -> str:
    """The grammar of a JSON Schema file (``chat`` / ``stream-run --json-schema``)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {'is a directory' if path.is_dir() else 'no such file'}")
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a JSON file ({exc})") from exc
    return json_schema_grammar(schema, str(path))


def lark_grammar(lark: str, field: str) -> str:
    """The grammar of a Lark text (llguidance's dialect, ``%json {...}`` inline)."""
    import llguidance

    return _check(llguidance.LLMatcher.grammar_from_lark(lark), field)


def response_format_grammar(response_format: dict | None, field: str = "response_format"):
    """The grammar an OpenAI ``response_format`` asks for (``None`` for plain text).

    ``{"type": "json_object"}``: any JSON object; ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``: JSON matching the schema (what
    ``chat.completions.parse`` sends for a Pydantic model). The constraint is enforced
    whether ``strict`` is set or not.
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, field)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise UserError(f"{field}.json_schema: required for type json_schema")
        schema = spec.get("schema", {"type": "object"})
        return json_schema_grammar(schema, f"{field}.json_schema.schema")
    raise UserError(f"{field}.type: must be text, json_object or json_schema, not {kind!r}")


# Tool-call arguments. JSON Schema lets an object hold keys it does not list unless
# it says ``additionalProperties: false``, so a call could invent arguments; like
# OpenAI's strict mode, the grammar closes every object that lists its properties
# and says nothing of others. Objects whose properties combine with another
# schema's (``allOf``, a ``$ref`` or ``anyOf`` beside ``properties``) stay open:
# closing one part would forbid the other part's keys.
_SAYS = ("additionalProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")
_OBJECT = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "unevaluatedItems")
# llguidance's words for a schema that is not one (a UserError); anything else it
# refuses is a feature it cannot enforce, which loosens that tool's arguments.
_MALFORMED = ("must be", "Expected", "Expecting", "Invalid", "does not exist")


def _children(node: dict, merged: bool):
    """``(key, name or index or None, subschema, merged)`` for each subschema that
    ``node`` holds values to (``not``, ``if``, ``propertyNames``... are left alone);
    ``merged``: the subschema is intersected with keywords beside it."""
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield key, name, sub, False
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield key, None, node[key], False
    for key in ("items", "prefixItems", "allOf", "anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            joined = key == "allOf" or (
                key in ("anyOf", "oneOf")
                and (merged or any(k in node for k in (*_OBJECT, "allOf", "$ref")))
            )
            for i, sub in enumerate(node[key]):
                yield key, i, sub, joined


def _pointer(at: str, key: str, name: Any) -> str:
    if name is None:
        return f"{at}/{key}"
    return f"{at}/{key}/" + str(name).replace("~", "~0").replace("/", "~1")


def _merged_refs(node: Any, merged: bool, out: set[str]) -> set[str]:
    """The ``$ref`` targets used where they are intersected with other keywords."""
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str) and (
            merged or any(k in node for k in (*_OBJECT, "allOf", "anyOf", "oneOf"))
        ):
            out.add(node["$ref"])
        for _, _, sub, joined in _children(node, merged):
            _merged_refs(sub, joined, out)
    return out


def closed_schema(schema: Any) -> Any:
    """A copy of ``schema`` with ``additionalProperties: false`` on every object that
    lists ``properties`` and says nothing of other keys (see above)."""
    keep = _merged_refs(schema, False, set())

    def close(node: Any, merged: bool, at: str) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key, name, sub, joined in _children(node, merged):
            new = close(sub, joined, _pointer(at, key, name))
            if name is None:
                out[key] = new
            else:
                if out[key] is node[key]:  # copy the container once
                    out[key] = list(node[key]) if isinstance(node[key], list) else dict(node[key])
                out[key][name] = new
        if (
            isinstance(node.get("properties"), dict)
            and not merged
            and at not in keep
            and not any(k in node for k in _SAYS)
        ):
            out["additionalProperties"] = False
        return out

    return close(schema, False, "#")


def _keys_only(schema: dict) -> dict:
    """The loosest useful schema: the object's own keys (if it lists them), any values."""
    props = schema.get("properties")
    if not isinstance(props, dict):
        return {"type": "object"}
    required = schema.get("required")
    required = [k for k in required if k in props] if isinstance(required, list) else []
    extra = schema.get("additionalProperties", False) is not False
    return {"type": "object", "properties": {k: {} for k in props}, "required": required,
            "additionalProperties": extra}  # fmt: skip


def tool_arguments_schema(schema: Any, field: str) -> dict:
    """The schema a call's arguments are held to: ``schema`` closed (see above),
    else as sent, else only its keys, else any object: a feature llguidance cannot
    enforce loosens that tool only, never fails the request. A schema that is not
    one is a :class:`UserError` naming ``field``. Unknown keywords are ignored
    (``lenient``: tool schemas are written for other servers)."""
    import llguidance

    if not isinstance(schema, dict):
        raise UserError(f"{field}: must be a JSON Schema object")

    def problem(s: dict) -> str | None:
        try:
            options = {**JSON_OPTIONS, "lenient": True}
            return _problem(llguidance.LLMatcher.grammar_from_json_schema(s, overrides=options))
        except (ValueError, TypeError) as exc:
            return str(exc) or "invalid"

    closed = closed_schema(schema)
    if problem(closed) is None:
        return closed
    why = problem(schema)
    if why is None:
        return schema
    if any(word in why for word in _MALFORMED):
        raise UserError(f"{field}: not a schema llguidance can enforce ({why})")
    loose = _keys_only(schema)
    return loose if problem(loose) is None else {"type": "object"}


class Grammars:
    """llguidance for one tokenizer: its ``LLTokenizer`` (built on first use) and a
    :class:`Constraint` per reply."""

    KEEP = 16  # compiled grammars kept: agents send the same tools every turn

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._ll = None
        # A fresh matcher per grammar, copied per reply: compiling a coding agent's
        # tool list takes ~25 ms, a copy ~10 us.
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        if self._ll is None:
            import llguidance

            hf = hf_tokenizer(self.tokenizer)
            backend = getattr(hf, "backend_tokenizer", None)
            if backend is None:
                raise UserError("structured output needs a fast (tokenizer.json) tokenizer")
            eos = sorted(getattr(self.tokenizer, "eos_token_ids", ()) or ()) or None
            try:
                self._ll = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
            except Exception as exc:  # noqa: BLE001 - llguidance says why in its message
                raise UserError(
                    f"response_format: structured output is not possible with this tokenizer ({exc})"
                ) from exc
        return self._ll

    def constraint(self, grammar: str) -> Constraint:
        """A fresh constraint (one reply) for ``grammar``."""
        import llguidance

        with self._lock:
            base = self._compiled.pop(grammar, None)
        if base is None:
            base = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
            if base.is_error():
                raise UserError(f"the grammar cannot be used: {base.get_error()}")
        with self._lock:
            self._compiled[grammar] = base  # the most recent last
            while len(self._compiled) > self.KEEP:
                self._compiled.popitem(last=False)
        return Constraint(base.deep_copy(), self._ll.vocab_size)


class Constraint:
    """An mlx-lm style logits processor for one reply: ``-inf`` wherever the grammar
    forbids the next token. Each call after the first feeds the grammar the token
    sampled by the call before (``tokens[-1]``; reading it waits for that step). It
    must come first among a reply's processors (a later one may not unmask)."""

    def __init__(self, matcher: Any, vocab: int):
        from llguidance.numpy import allocate_token_bitmask

        self.matcher, self.vocab = matcher, vocab
        self.mask = allocate_token_bitmask(1, vocab)
        self.calls = 0
        self.failed = False

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx
        from llguidance.numpy import fill_next_token_bitmask

        if self.calls and not self.failed:
            token = int(tokens.reshape(-1)[-1].item())
            # Sampling only draws allowed tokens, so this cannot fail; if it does, the
            # reply goes on unconstrained: raising here would stop every row's step.
            self.failed = not self.matcher.consume_token(token)
        if self.failed:
            return logits
        self.calls += 1
        fill_next_token_bitmask(self.matcher, self.mask)
        allowed = np.unpackbits(self.mask.view(np.uint8), bitorder="little")[: self.vocab]
        width = logits.shape[-1]
        if width > allowed.size:  # the model's vocabulary is padded past the tokenizer's
            allowed = np.concatenate([allowed, np.zeros(width - allowed.size, np.uint8)])
        allowed = mx.array(allowed[:width].astype(np.bool_))
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
