"""Structured output for ``serve``: replies constrained by llguidance grammars.

Contract: the HTTP side turns ``response_format`` (and forced tool calls, see
:mod:`mlx_stream.serve.tools`) into an llguidance grammar string with
:func:`json_schema_grammar` / :func:`response_format_grammar`, which refuse a schema
llguidance cannot compile with a :class:`~mlx_stream.errors.UserError` naming the field
(HTTP 400). The engine makes one :class:`Constraint` per reply from
:class:`Grammars` (one per tokenizer; its ``LLTokenizer`` is built once, lazily): an
mlx-lm style logits processor that sets every token the grammar does not allow next
to ``-inf``, so the row's own sampler (greedy, temperature, top-p) only ever draws
allowed tokens. It runs per row inside batched decoding like any other processor.
Once the grammar is complete only an end-of-sequence token is allowed.

JSON is written without free whitespace, with ``", "`` and ``": "`` separators: what
Python's ``json.dumps`` writes, so a tool call's JSON renders back to the same text.
The bitmask is computed with llguidance's numpy path (its MLX kernel needs Metal).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mlx_stream.errors import UserError

# JSON written like json.dumps(): no free whitespace, ", " and ": " separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _check(grammar: str, field: str) -> str:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        why = messages[0].strip() if messages else "invalid"
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


class Grammars:
    """llguidance for one tokenizer: its ``LLTokenizer`` (built on first use) and a
    :class:`Constraint` per reply."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._ll = None

    def ll_tokenizer(self):
        if self._ll is None:
            import llguidance

            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
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

        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise UserError(f"the grammar cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self._ll.vocab_size)


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
