"""Tool-call arguments are held to the tool's schema (llguidance) whenever the model
opens a call, ``auto`` included: objects are closed to the keys they list (OpenAI's
strict mode) unless the schema says otherwise, a template with its own JSON call
format is constrained too, and real agents' tool lists compile (a feature llguidance
cannot enforce loosens that tool, never fails the request)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlx_stream.errors import UserError
from mlx_stream.mlxlm import hf_tokenizer

llguidance = pytest.importorskip("llguidance")

FIXTURES = Path(__file__).parent / "fixtures" / "agents"


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


CITY = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]})  # fmt: skip
NESTED = tool("book", {"type": "object", "properties": {
    "trip": {"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]},
    "seats": {"type": "array", "items": {"type": "object", "properties": {"row": {"type": "integer"}}}},
}, "required": ["trip"]})  # fmt: skip
OPEN = tool("tag", {"type": "object", "properties": {"name": {"type": "string"}},
                    "required": ["name"], "additionalProperties": True})  # fmt: skip


def call(name: str, arguments: dict, start: str = "<tool_call>", end: str = "</tool_call>"):
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{start}\n{body}\n{end}"


@pytest.fixture(scope="module")
def bpe_tok(tiny_bpe_model_dir):
    from mlx_stream.models.loader import load

    return load(str(tiny_bpe_model_dir))[1]


@pytest.fixture(scope="module")
def native_tok(tiny_tools_model_dir):
    from mlx_stream.models.loader import load

    tok = load(str(tiny_tools_model_dir))[1]
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    return tok


def accepts(tok, grammar: str, text: str, ids: list[int] | None = None) -> bool:
    from mlx_stream.serve.structured import Grammars

    ll = Grammars(tok).ll_tokenizer()
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    tokens = ll.tokenize_str(text) if ids is None else ids
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


def auto(tools: list[dict], tok) -> str:
    from mlx_stream.serve.tools import ToolPlan

    plan = ToolPlan.make(tools, "auto", tok)
    assert plan.grammar is not None
    return plan.grammar


# ------------------------------------------------------------------ closing objects


def test_closing_adds_additional_properties_false_on_a_copy_only_where_unsaid():
    from mlx_stream.serve.structured import closed_schema

    schema = json.loads(json.dumps(NESTED["function"]["parameters"]))
    before = json.dumps(schema)
    out = closed_schema(schema)
    assert json.dumps(schema) == before  # the client's definition is untouched
    assert out["additionalProperties"] is False
    assert out["properties"]["trip"]["additionalProperties"] is False
    assert out["properties"]["seats"]["items"]["additionalProperties"] is False
    kept = closed_schema(OPEN["function"]["parameters"])
    assert kept["additionalProperties"] is True
    mapping = {"type": "object", "additionalProperties": {"type": "string"}}
    assert closed_schema(mapping) == mapping  # no properties listed: a map stays a map
    assert closed_schema({"type": "string"}) == {"type": "string"}


def test_parts_that_combine_stay_open_and_union_branches_close():
    """An object whose keys are spread over allOf / a $ref beside properties stays
    open (closing one part would forbid the other's keys); anyOf branches alone close."""
    from mlx_stream.serve.structured import closed_schema

    part = {"type": "object", "properties": {"a": {"type": "string"}}}
    union = closed_schema({"anyOf": [part, {"type": "object", "properties": {"b": {}}}]})
    assert all(b["additionalProperties"] is False for b in union["anyOf"])
    joined = closed_schema({"allOf": [part, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in b for b in joined["allOf"])
    beside = closed_schema({"properties": {"x": {}}, "anyOf": [part]})
    assert "additionalProperties" not in beside and "additionalProperties" not in beside["anyOf"][0]
    refs = closed_schema({"$defs": {"A": part, "B": part}, "type": "object",
                          "properties": {"p": {"$ref": "#/$defs/B"}},
                          "allOf": [{"$ref": "#/$defs/A"}]})  # fmt: skip
    assert "additionalProperties" not in refs["$defs"]["A"]  # merged through allOf
    assert refs["$defs"]["B"]["additionalProperties"] is False  # a value of its own


# ------------------------------------------------------------------ the auto grammar


def test_an_auto_call_cannot_invent_an_argument(bpe_tok):
    """The reported bug: get_weather(city) came back with a temperature."""
    grammar = auto([CITY], bpe_tok)
    assert accepts(bpe_tok, grammar, "Sure. " + call("get_weather", {"city": "Paris"}))
    assert not accepts(bpe_tok, grammar, call("get_weather", {"city": "Paris", "temperature": 25}))
    assert not accepts(bpe_tok, grammar, call("get_weather", {}))  # city is required
    assert accepts(bpe_tok, grammar, "just text")


def test_nested_objects_are_closed_and_explicitly_open_ones_stay_open(bpe_tok):
    grammar = auto([NESTED, OPEN], bpe_tok)
    ok = {"trip": {"to": "rome"}, "seats": [{"row": 3}]}
    assert accepts(bpe_tok, grammar, call("book", ok))
    assert not accepts(bpe_tok, grammar, call("book", {"trip": {"to": "rome", "by": "train"}}))
    assert not accepts(bpe_tok, grammar, call("book", {**ok, "seats": [{"row": 3, "aisle": 1}]}))
    assert accepts(bpe_tok, grammar, call("tag", {"name": "x", "color": "red"}))


def test_a_forced_call_is_closed_too(bpe_tok):
    from mlx_stream.serve.tools import ToolPlan

    plan = ToolPlan.make([CITY], "required", bpe_tok)
    assert accepts(bpe_tok, plan.grammar, call("get_weather", {"city": "Oslo"}))
    assert not accepts(bpe_tok, plan.grammar, call("get_weather", {"city": "Oslo", "unit": "C"}))


def test_a_native_json_template_is_constrained_under_auto(native_tok):
    """A template with its own JSON call format (Qwen2.5 / Hermes, mlx-lm's
    json_tools) gets the auto grammar with its own markers."""
    from mlx_stream.serve.tools import ToolPlan

    plan = ToolPlan.make([CITY], "auto", native_tok)
    assert plan.toolset.native and plan.grammar is not None
    assert accepts(native_tok, plan.grammar, "hello " + call("get_weather", {"city": "Rome"}))
    assert not accepts(native_tok, plan.grammar, call("get_weather", {"city": "Rome", "t": 1}))
    assert not accepts(native_tok, plan.grammar, call("get_wether", {"city": "Rome"}))
    assert accepts(native_tok, plan.grammar, "no call at all")


def native(tok, start: str, end: str, parser) -> SimpleNamespace:
    """``tok`` as a template with tool support in another call format."""
    return SimpleNamespace(has_tool_calling=True, tool_call_start=start, tool_call_end=end,
                           tool_parser=parser, _tokenizer=hf_tokenizer(tok))  # fmt: skip


def test_a_template_whose_calls_are_not_json_is_left_unconstrained(bpe_tok):
    from mlx_lm.tool_parsers import pythonic, qwen3_coder

    from mlx_stream.serve.tools import ToolPlan

    for module in (qwen3_coder, pythonic):
        fake = native(bpe_tok, module.tool_call_start, module.tool_call_end, module.parse_tool_call)
        plan = ToolPlan.make([CITY], "auto", fake)
        assert plan.grammar is None and plan.parser is module.parse_tool_call


def test_a_start_marker_that_is_a_special_token_is_written_as_that_token(bpe_tok):
    """A marker the tokenizer holds as one special token is named by id in the
    grammar: its text alone would spell other tokens, never the one the model writes."""
    from mlx_lm.tool_parsers import json_tools

    from mlx_stream.serve.tools import ToolPlan

    fake = native(bpe_tok, "<|im_start|>", "</tool_call>", json_tools.parse_tool_call)
    plan = ToolPlan.make([CITY], "auto", fake)
    special = bpe_tok.convert_tokens_to_ids("<|im_start|>")
    body = call("get_weather", {"city": "Rome"}, start="")
    ll_ids = [special, *bpe_tok.encode(body, add_special_tokens=False)]
    prefix = bpe_tok.encode("I'll check.", add_special_tokens=False)
    assert accepts(bpe_tok, plan.grammar, "", ids=prefix + ll_ids)
    extra = call("get_weather", {"city": "Rome", "t": 1}, start="")
    extra_ids = [special, *bpe_tok.encode(extra, add_special_tokens=False)]
    assert not accepts(bpe_tok, plan.grammar, "", extra_ids)
    assert accepts(bpe_tok, plan.grammar, "plain text")


# ------------------------------------------------------------------ what cannot be enforced


def test_a_feature_llguidance_cannot_enforce_loosens_that_tool_only(bpe_tok):
    from mlx_stream.serve.structured import tool_arguments_schema

    lookahead = tool("grep", {"type": "object", "properties": {
        "pattern": {"type": "string", "pattern": "^(?!-).*"}}, "required": ["pattern"]})  # fmt: skip
    schema = tool_arguments_schema(lookahead["function"]["parameters"], "x")
    assert schema == {"type": "object", "properties": {"pattern": {}}, "required": ["pattern"],
                      "additionalProperties": False}  # fmt: skip
    grammar = auto([lookahead, CITY], bpe_tok)
    assert accepts(bpe_tok, grammar, call("grep", {"pattern": "-x"}))
    assert not accepts(bpe_tok, grammar, call("grep", {"pattern": "a", "path": "."}))
    assert not accepts(bpe_tok, grammar, call("get_weather", {"city": "a", "t": 1}))
    unknown = {"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["a"]},
               "propertyNames": {"pattern": "^[a-z]+$"}}  # fmt: skip
    assert tool_arguments_schema(unknown, "x")["additionalProperties"] is False  # ignored, closed


def test_a_schema_that_is_not_one_is_still_400_naming_the_field(bpe_tok):
    from mlx_stream.serve.tools import ToolPlan

    for bad in ({"type": "strang"}, {"type": "object", "properties": 5}, "object"):
        with pytest.raises(UserError, match=r"tools\.1\.function\.parameters"):
            ToolPlan.make([CITY, tool("bad", bad)], "auto", bpe_tok)


def test_references_inside_a_tool_resolve_against_its_own_schema(bpe_tok):
    """Pydantic writes "#/$defs/..." references, relative to the tool's schema, not
    to the call object the grammar wraps it in."""
    point = tool("move", {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                          "type": "object", "properties": {"to": {"$ref": "#/$defs/P"}},
                          "required": ["to"]})  # fmt: skip
    grammar = auto([point, CITY], bpe_tok)
    assert accepts(bpe_tok, grammar, call("move", {"to": {"x": 1}}))
    assert not accepts(bpe_tok, grammar, call("move", {"to": {"x": 1, "y": 2}}))


# ------------------------------------------------------------------ real agents' tool lists


def agent_tools(path: Path) -> list[dict]:
    """The function tools of a captured agent request (Anthropic Messages or OpenAI
    Responses, namespaces flattened, hosted tools skipped)."""
    body = json.loads(path.read_text())["body"]
    out = []

    def add(tools):
        for t in tools:
            if "input_schema" in t:
                out.append(tool(t["name"], t["input_schema"]))
            elif t.get("type") == "function":
                out.append(tool(t["name"], t.get("parameters") or {}))
            elif t.get("type") == "namespace":
                add(t.get("tools") or [])

    add(body.get("tools") or [])
    return out


AGENTS = sorted(p for p in FIXTURES.glob("*.json") if agent_tools(p)) if FIXTURES.is_dir() else []


@pytest.mark.skipif(not AGENTS, reason="no captured agent requests in tests/fixtures/agents")
@pytest.mark.parametrize("path", AGENTS, ids=lambda p: p.stem)
def test_captured_agent_tool_lists_compile_for_auto_and_forced_calls(path, bpe_tok):
    from mlx_stream.serve.tools import ToolPlan, call_grammar

    tools = agent_tools(path)
    assert len(tools) >= 5
    plan = ToolPlan.make(tools, "auto", bpe_tok)
    assert plan.grammar and ToolPlan.make(tools, "required", bpe_tok).grammar
    defs = plan.toolset.definitions
    assert call_grammar(defs, "<tool_call>", "</tool_call>", True) is plan.grammar  # cached
    plain = [t["function"] for t in defs if _plain_strings(t["function"]["parameters"])]
    assert plain, "no tool with only plain string arguments to try"
    fn = plain[0]
    args = {k: "x" for k in fn["parameters"].get("required", [])}
    assert accepts(bpe_tok, plan.grammar, call(fn["name"], args))
    assert not accepts(bpe_tok, plan.grammar, call(fn["name"], {**args, "zz_extra": "1"}))


def _plain_strings(schema: dict) -> bool:
    """Every required argument is a string without further constraints."""
    props = schema.get("properties") or {}
    return all(
        set(props.get(k, {})) <= {"type", "description"} and props[k].get("type") == "string"
        for k in schema.get("required", [])
    )


# ------------------------------------------------------------------ served


def ask_weather(model_dir, *args: str) -> list[dict]:
    """The arguments of the calls a server's model makes under ``auto`` when asked
    for the weather with ``get_weather(city)``; text never holds a broken call."""
    pytest.importorskip("openai")
    from tests.support.server import Server

    s = Server(model_dir, "--window", "1024", "--max-tokens", "40", *args)
    try:
        reply = s.client.chat.completions.create(
            model="default", tools=[CITY], tool_choice="auto",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        )  # fmt: skip
    finally:
        s.stop()
    choice = reply.choices[0]
    calls = choice.message.tool_calls or []
    assert all(c.function.name == "get_weather" for c in calls)
    if not calls:
        assert "<tool_call>" not in (choice.message.content or "")
    return [json.loads(c.function.arguments) for c in calls]


def test_a_served_native_template_holds_auto_calls_to_the_schema(tiny_tools_model_dir):
    for args in ask_weather(tiny_tools_model_dir, "--sinks", "2"):
        assert set(args) == {"city"} and isinstance(args["city"], str)


@pytest.mark.real_model
@pytest.mark.slow
def test_the_default_model_calls_get_weather_with_only_a_city(real_model_path):
    """SmolLM2-135M mostly answers in text under ``auto``; a call it makes has only
    ``city``, and its tokenizer's grammar refuses the reported ``temperature``."""
    from mlx_lm.tokenizer_utils import load

    for args in ask_weather(real_model_path):
        assert set(args) == {"city"} and isinstance(args["city"], str)
    tok = load(Path(real_model_path))
    grammar = auto([CITY], tok)
    assert accepts(tok, grammar, "Let me check. " + call("get_weather", {"city": "Paris"}))
    assert not accepts(tok, grammar, call("get_weather", {"city": "Paris", "temperature": 25}))


def test_replies_of_one_grammar_get_their_own_copy_of_one_compiled_matcher(bpe_tok, monkeypatch):
    from mlx_stream.serve.structured import Grammars

    grammars, grammar = Grammars(bpe_tok), auto([CITY], bpe_tok)
    ll = grammars.ll_tokenizer()
    compiled, matcher = [], llguidance.LLMatcher
    with monkeypatch.context() as m:  # count the compilations
        m.setattr(llguidance, "LLMatcher", lambda *a, **k: compiled.append(a) or matcher(*a, **k))
        one, two = grammars.constraint(grammar), grammars.constraint(grammar)
    assert one.matcher is not two.matcher and len(compiled) == 1
    assert all(one.matcher.consume_token(t) for t in ll.tokenize_str("<tool_call>\n"))
    assert all(two.matcher.consume_token(t) for t in ll.tokenize_str("plain text"))
    assert two.matcher.is_accepting() and not one.matcher.is_accepting()
