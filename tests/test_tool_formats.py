"""Tool calls in the formats of the model families Mac users run: for each family a
chat template written in its documented call format (not copied from a model
repository), the format found from the template, a reply's call read whole when the
reply streams in pieces (text before it kept), and the call the template writes back
into the transcript read again to the same call."""

from __future__ import annotations

import json

import pytest

from mlx_stream.serve.event_types import Delta, End, ToolCall
from tests.support.agents import WEATHER

CALL = {"name": "get_weather", "arguments": {"city": "rome", "days": 2}}
ARGS = "{{ c.function.arguments | tojson }}"
NAME = "{{ c.function.name }}"

# family: (call as its template writes one, a reply's call text, its parser's origin)
FAMILIES = {
    "qwen3 (Hermes JSON)": (
        "{% set tool_call = c.function %}"
        '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": ' + ARGS + "}\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n'
        "</tool_call>",
        "mlx-lm",
    ),
    "qwen3-coder (XML)": (
        "<tool_call>\n<function=" + NAME + ">\n{% for k, v in c.function.arguments.items() %}"
        "<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nrome\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "mlx-lm",
    ),
    "mistral / devstral": (
        "[TOOL_CALLS]" + NAME + "[ARGS]" + ARGS,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "rome", "days": 2}',
        "mlx-lm",
    ),
    "glm 4.x": (
        "<tool_call>" + NAME + "{% for k, v in c.function.arguments.items() %}"
        "<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>rome</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        "mlx-lm",
    ),
    "kimi k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions." + NAME + ":0"
        "<|tool_call_argument_begin|>" + ARGS + "<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "rome", "days": 2}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "mlx-lm",
    ),
    "gemma 4": (
        "<|tool_call>call:" + NAME + '{city:<|"|>{{ c.function.arguments.city }}<|"|>,'
        "days:{{ c.function.arguments.days }}}<tool_call|>",
        '<|tool_call>call:get_weather{city:<|"|>rome<|"|>,days:2}<tool_call|>',
        "mlx-lm",
    ),
    "deepseek v3 / r1": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        + NAME
        + "\n```json\n"
        + ARGS
        + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "rome", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "deepseek",
    ),
    "deepseek v3.1": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
        + NAME
        + "<｜tool▁sep｜>"
        + ARGS
        + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "rome", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "deepseek",
    ),
    "granite 3.x": (
        '<|tool_call|>[{"name": "' + NAME + '", "arguments": ' + ARGS + "}]",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}]',
        "granite",
    ),
    "phi-4-mini": (
        '<|tool_call|>[{"name": "' + NAME + '", "arguments": ' + ARGS + "}]<|/tool_call|>",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}]'
        "<|/tool_call|>",
        "phi4",
    ),
    "llama 3.1-3.3 (JSON)": (
        '{"name": "' + NAME + '", "parameters": ' + ARGS + "}",
        '{"name": "get_weather", "parameters": {"city": "rome", "days": 2}}',
        "llama3",
    ),
    "gpt-oss (harmony)": (
        "<|start|>assistant<|channel|>commentary to=functions."
        + NAME
        + " <|constrain|>json<|message|>"
        + ARGS
        + "<|call|>",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "rome", "days": 2}<|call|>',
        "harmony",
    ),
}
# What a Llama 3 template says of its calls (its JSON mode; <|python_tag|> for built-ins).
LLAMA_NOTE = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument '
    "name and its value}. <|python_tag|> starts a built-in tool's code."
)


def template(call: str) -> str:
    """A chat template whose calls are written as ``call`` (a Jinja fragment over
    ``c``), tools listed in the system turn, results as tool turns."""
    note = LLAMA_NOTE if '"parameters"' in call else "Call them as you are trained to."
    return (
        "{% if tools %}<|im_start|>system\n" + note + "\n{{ tools | tojson }}"
        "<|im_end|>\n{% endif %}{% for m in messages %}"
        "{% if m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
        "{% for c in m.tool_calls %}" + call + "{% endfor %}<|im_end|>\n"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def tokenizer_with(tmp_path, chat_template: str):
    """mlx-lm's tokenizer wrapper of the tiny BPE with ``chat_template``."""
    from mlx_lm.tokenizer_utils import load
    from transformers import PreTrainedTokenizerFast

    from tests.support.bpe import tiny_bpe

    PreTrainedTokenizerFast(
        tokenizer_object=tiny_bpe(), eos_token="<|im_end|>", chat_template=chat_template,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    ).save_pretrained(str(tmp_path))  # fmt: skip
    return load(tmp_path)


def read(plan, reply: str, cut: int = 3) -> list:
    from mlx_stream.serve.tools import CallStream

    out: list = []
    stream = CallStream(plan, out.append)
    for i in range(0, len(reply), cut):
        stream(Delta(reply[i : i + cut]))
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    stream(End(usage, "stop"))
    return out


def calls_of(events: list) -> list[dict]:
    calls = [e.call["function"] for e in events if isinstance(e, ToolCall)]
    return [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_call_is_read_and_written_back(family, tmp_path):
    from mlx_stream.serve import call_formats
    from mlx_stream.serve.tools import ToolPlan

    fragment, reply, origin = FAMILIES[family]
    tok = tokenizer_with(tmp_path, template(fragment))
    fmt = call_formats.native(tok)
    assert (fmt.name if fmt else "mlx-lm") == origin
    plan = ToolPlan.make([WEATHER], "auto", tok)
    assert plan.toolset.native  # the template shows the tools and writes the calls
    events = read(plan, "Let me look. " + reply)
    assert calls_of(events) == [CALL]
    assert "".join(e.text for e in events if isinstance(e, Delta)).strip() == "Let me look."
    assert events[-1] == End(events[-1].usage, "tool_calls")
    # the call as the template writes it into the next turn's prompt reads back the same
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}  # fmt: skip
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]  # fmt: skip
    shown, extra = plan.toolset.for_template(messages)
    prompt = tok.apply_chat_template(shown, tokenize=False, add_generation_prompt=True, **extra)
    written = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert calls_of(read(plan, written)) == [CALL], written


def test_a_template_without_a_call_format_gets_the_hermes_fallback(tmp_path):
    """Gemma 3's template shows no tools: they go into the system prompt and calls are
    written as ``<tool_call>`` JSON (held to the schema by the auto grammar)."""
    from mlx_stream.serve.tools import START, ToolPlan

    plain = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    plan = ToolPlan.make([WEATHER], "auto", tokenizer_with(tmp_path, plain))
    assert not plan.toolset.native and plan.start == START and plan.grammar
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n'
    assert calls_of(read(plan, reply + "</tool_call>")) == [CALL]


@pytest.mark.parametrize("family", ["granite 3.x", "llama 3.1-3.3 (JSON)"])
def test_a_forced_call_in_a_format_without_an_end_marker_is_held_between_markers(family, tmp_path):
    from mlx_stream.serve.tools import END, START, ToolPlan

    tok = tokenizer_with(tmp_path, template(FAMILIES[family][0]))
    plan = ToolPlan.make([WEATHER], "required", tok)
    assert (plan.start, plan.end) == (START, END) and plan.grammar
    reply = START + '{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}' + END
    assert calls_of(read(plan, reply)) == [CALL]


def test_a_reply_that_only_looks_like_a_call_stays_text(tmp_path):
    from mlx_stream.serve.tools import ToolPlan

    tok = tokenizer_with(tmp_path, template(FAMILIES["llama 3.1-3.3 (JSON)"][0]))
    plan = ToolPlan.make([WEATHER], "auto", tok)
    reply = 'Write it as {"name": "Bob"} and stop.'
    events = read(plan, reply)
    assert calls_of(events) == []
    assert "".join(e.text for e in events if isinstance(e, Delta)) == reply
