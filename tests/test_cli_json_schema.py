"""``--json-schema FILE`` on ``chat`` and ``stream-run --prompt``: every reply is JSON
matching the schema (llguidance), on a tiny model with a byte-level tokenizer; a file
that is not a schema is one line and exit 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.support.cli import assert_one_line_error

pytest.importorskip("llguidance")
runner = CliRunner()
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture
def schema(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def test_chat_replies_are_json_matching_the_schema(tiny_bpe_model_dir, schema):
    result = runner.invoke(
        app, ["chat", "-m", str(tiny_bpe_model_dir), "--sinks", "2", "--window", "256",
              "--max-tokens", "60", "--json-schema", str(schema)],
        input="hello the sea\nand the ship\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 2
    for line in lines:
        value = json.loads(line)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)


def test_stream_run_answers_in_json(tiny_bpe_model_dir, schema, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("the sea was long and the ship was old. " * 20)
    result = runner.invoke(
        app, ["stream-run", str(text), "-m", str(tiny_bpe_model_dir), "--sinks", "2",
              "--window", "128", "--prompt", "what was old?", "--json-schema", str(schema),
              "--max-tokens", "60", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    answer = json.loads(json.loads(result.stdout)["answer"])
    assert set(answer) == {"ok", "n"}


@pytest.mark.parametrize(
    "content, words",
    [(None, "no such file"), ("{not json", "not a JSON file"), ('{"type": "strang"}', "strang")],
)
def test_a_file_that_is_not_a_schema_is_one_line(tiny_bpe_model_dir, tmp_path, content, words):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(
        app, ["chat", "-m", str(tiny_bpe_model_dir), "--json-schema", str(path)], input="hi\n"
    )
    assert_one_line_error(result, 2, words)


def test_stream_run_json_schema_needs_a_prompt(tiny_bpe_model_dir, schema, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("the sea " * 10)
    result = runner.invoke(app, ["stream-run", str(text), "-m", str(tiny_bpe_model_dir),
                                 "--json-schema", str(schema)])  # fmt: skip
    assert_one_line_error(result, 2, "--prompt")
