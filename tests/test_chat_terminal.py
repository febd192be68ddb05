"""``mlx-stream chat`` on a terminal (a pseudo-terminal driven by pexpect): a paste is one
turn, Ctrl-C prints nothing after ``^C`` and keeps the conversation, keys typed during a
reply are neither echoed into it nor run; ``/set`` and ``/show``; sampling defaults
from the model's ``generation_config.json``."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

import pytest
from typer.testing import CliRunner

from cli.main import app

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>>"  # the line editor draws the space after it as a cursor move
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, cursor moves
STATS = re.compile(r"prompt \d+ tokens at \d+ tok/s · reply (\d+) tokens at [\d.]+ tok/s")


@pytest.fixture(scope="module")
def endless_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with the embeddings of every token that ends a turn zeroed (tied
    weights: their logits are 0 while the best of ~70 random logits is positive), so a
    greedy reply ends only at its token limit or when it is stopped."""
    import mlx.core as mx

    from mlx_stream.generate.model_config import end_of_turn_tokens
    from tests import tiny

    folder = tmp_path_factory.mktemp("endless-turns") / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    key = "model.embed_tokens.weight"
    keep = mx.ones((weights[key].shape[0], 1))
    for token in end_of_turn_tokens(tiny.make_tokenizer()):
        keep[token] = 0
    weights[key] = weights[key] * keep
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def spawn(model, *args: str):
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1"}  # pexpect answers no cursor query
    child = pexpect.spawn(
        sys.executable,
        ["-c", "from cli.main import main; main()", "chat", "-m", str(model), *args],
        encoding="utf-8", timeout=60, dimensions=(40, 200), env=env,
    )  # fmt: skip
    child.expect("/help for commands")
    child.expect_exact(PROMPT)
    return child


def finish(child) -> None:
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)


def saved_messages(child, path) -> list[dict]:
    child.send(f"/save {path}\r")
    child.expect("Saved")
    child.expect_exact(PROMPT)
    return json.loads(path.with_suffix(".json").read_text())["messages"]


def test_a_bracketed_paste_of_four_lines_is_one_turn(tiny_model_dir, tmp_path):
    child = spawn(tiny_model_dir, "--max-tokens", "4")
    try:
        child.send("\x1b[200~l1\nl2\nl3\nl4\x1b[201~\r")
        child.expect(STATS)
        child.expect_exact(PROMPT)
        child.send("/stats\r")
        child.expect(r"turns\s+(\d+)")
        assert child.match.group(1) == "1"
        child.expect_exact(PROMPT)
        messages = saved_messages(child, tmp_path / "talk")
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[0]["content"] == "l1\nl2\nl3\nl4"
        finish(child)
    finally:
        child.close(force=True)


def test_a_triple_quote_block_is_one_turn(tiny_model_dir, tmp_path):
    child = spawn(tiny_model_dir, "--max-tokens", "4")
    try:
        for line in ('"""', "first line", 'second line"""'):
            child.send(line + "\r")
            time.sleep(0.3)  # typed, not pasted: each Enter on its own
        child.expect(STATS)
        child.expect_exact(PROMPT)
        messages = saved_messages(child, tmp_path / "talk")
        assert [m["content"] for m in messages if m["role"] == "user"] == [
            "first line\nsecond line"
        ]
        finish(child)
    finally:
        child.close(force=True)


def test_ctrl_c_prints_nothing_after_it_and_keeps_the_conversation(endless_dir, tmp_path):
    child = spawn(endless_dir, "--max-tokens", "100000", "--window", "64", "--temp", "0")
    try:
        child.send("hello there\r")
        child.expect_exact("hello there")
        child.expect(r"\w+ \w+ \w+ \w+")  # streaming
        shown = ANSI.sub("", child.before + child.after)
        time.sleep(0.3)
        child.sendintr()
        child.expect_exact("^C")
        shown += ANSI.sub("", child.before)
        child.expect(STATS)
        assert ANSI.sub("", child.before).strip() == "", repr(child.before)  # nothing after ^C
        child.expect("stopped")
        child.expect_exact(PROMPT)
        messages = saved_messages(child, tmp_path / "talk")
        assert messages[0] == {"role": "user", "content": "hello there"}
        reply = messages[1]["content"]
        assert len(reply.split()) >= 4
        # What was shown is what the conversation keeps: no token after ^C, none hidden.
        assert " ".join(shown.split()).endswith(" ".join(reply.split())), (shown, reply)
        child.send("the sea\r")  # the conversation goes on
        child.expect(r"\w+ \w+ \w+")
        child.sendintr()
        child.expect("stopped")
        child.expect_exact(PROMPT)
        child.send("/stats\r")
        child.expect(r"turns\s+2")
        child.expect_exact(PROMPT)
        finish(child)
    finally:
        child.close(force=True)


def test_keys_typed_during_a_reply_are_not_echoed_nor_run(endless_dir, tmp_path):
    child = spawn(endless_dir, "--max-tokens", "100000", "--window", "64", "--temp", "0")
    try:
        child.send("hello\r")
        child.expect(r"\w+ \w+ \w+ \w+")
        child.send("zebra typed meanwhile\r")
        time.sleep(0.5)
        child.sendintr()
        child.expect("stopped")
        child.expect_exact(PROMPT)
        assert "zebra" not in child.before
        child.send("/stats\r")  # the prompt is empty: the typed line is gone
        child.expect(r"turns\s+(\d+)")
        assert child.match.group(1) == "1"
        child.expect_exact(PROMPT)
        messages = saved_messages(child, tmp_path / "talk")
        assert "zebra" not in json.dumps(messages)
        finish(child)
    finally:
        child.close(force=True)


# --------------------------------------------------------------- /set, /show, defaults

runner = CliRunner()


def chat_lines(model, *args: str, input: str) -> list[str]:
    result = runner.invoke(app, ["chat", "-m", str(model), *args], input=input)
    assert result.exit_code == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line.strip()]


def test_set_temperature_changes_the_next_replies_sampling(tiny_model_dir):
    turn = "/reset\nthe sea is\n"
    lines = chat_lines(
        tiny_model_dir, "--temp", "0", "--max-tokens", "12", "--seed", "3",
        input=turn + turn + "/set temperature 5\n/set top_k 0\n" + turn + "/show\n",
    )  # fmt: skip
    replies = [line for line in lines if not line.startswith(("Conversation", "Set "))][:3]
    assert replies[0] == replies[1]  # greedy: the same reply twice
    assert replies[2] != replies[0]  # sampled at temperature 5 from the random vocabulary
    assert "Set temperature to 5." in lines
    assert any(re.fullmatch(r"temperature\s+5", line) for line in lines)


def test_bad_set_is_one_line_and_the_chat_goes_on(tiny_model_dir):
    result = runner.invoke(
        app, ["chat", "-m", str(tiny_model_dir), "--max-tokens", "3"],
        input="/set temperature -1\n/set top_p x\n/set colour red\nhello\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("Error: /set ") for e in errors), errors
    assert "at least 0" in errors[0] and "'x'" in errors[1] and "temperature" in errors[2]
    assert len([line for line in result.stdout.splitlines() if line.strip()]) == 1


def test_sampling_defaults_come_from_the_generation_config(tiny_model_dir, tmp_path):
    show = "/show\n"
    plain = chat_lines(tiny_model_dir, input=show)
    assert "temperature         0.7" in plain and "top_k               40" in plain
    assert "defaults from       mlx-stream default" in plain
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    config = {"do_sample": True, "temperature": 0.3, "top_p": 0.8, "repetition_penalty": 1.05}
    (folder / "generation_config.json").write_text(json.dumps(config))
    own = chat_lines(folder, input=show)
    assert "temperature         0.3" in own and "top_p               0.8" in own
    assert "top_k               50" in own  # transformers' default for a field left out
    assert "repetition_penalty  1.05" in own
    given = chat_lines(folder, "--temp", "0", input=show)
    assert "temperature         0 (greedy)" in given and "top_p               0.8" in given


def test_generation_config_rules():
    from mlx_stream.generate.model_config import DEFAULT_SAMPLING, from_generation_config

    assert from_generation_config({"bos_token_id": 1, "eos_token_id": 2}) is None
    greedy = from_generation_config({"do_sample": False, "temperature": 0.6})
    assert greedy.temp == 0 and greedy.repetition_penalty is None
    qwen = from_generation_config(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
         "repetition_penalty": 1.05}
    )  # fmt: skip
    assert (qwen.temp, qwen.top_p, qwen.top_k, qwen.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert DEFAULT_SAMPLING.temp > 0 and DEFAULT_SAMPLING.repetition_penalty > 1


def test_end_of_turn_tokens_of_chatml_and_of_the_tiny_template(tiny_bpe_model_dir):
    from mlx_stream.generate.model_config import end_of_turn_tokens
    from mlx_stream.models.loader import load
    from tests import tiny

    tok = tiny.make_tokenizer()  # eos <|endoftext|>; its template closes turns with <|im_end|>
    names = {tok.convert_ids_to_tokens(i) for i in end_of_turn_tokens(tok)}
    assert names == {"<|endoftext|>", "<|im_end|>", "<|im_start|>"}
    _, bpe = load(str(tiny_bpe_model_dir))
    names = {bpe.convert_ids_to_tokens(i) for i in end_of_turn_tokens(bpe)}
    assert {"<|im_end|>", "<|im_start|>"} <= names


@pytest.mark.real_model
def test_real_model_reply_ends_at_im_end(real_model):
    """The default model's reply ends at ``<|im_end|>`` (its eos), not at the limit."""
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.model_config import end_of_turn_tokens
    from mlx_stream.generate.session import ChatSession, Settings

    model, tokenizer, _ = real_model
    stops = end_of_turn_tokens(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in stops and tokenizer.convert_tokens_to_ids("<|im_start|>") in stops
    settings = Settings(cache=CacheSpec(4, 256), max_tokens=120, stop_tokens=stops)
    session = ChatSession(model, tokenizer, settings)
    tokens = []
    turn = session.stream("What is the capital of France? Answer in one sentence.")
    for response in turn:
        tokens.append(response.token)
    reply = session.last
    assert reply.finish_reason == "stop" and tokens[-1] == im_end, (reply, tokens[-3:])
    assert "Paris" in reply.text and "<|im_end|>" not in reply.text
    assert reply.tokens == len(tokens) - 1  # the end token closes the turn, not the text


def test_ctrl_c_during_a_long_prompt_drops_the_turn(loaded):
    """Ctrl-C while a long prompt goes in stops after the model call under way: no reply,
    and the conversation (transcript and caches) is as it was before the message."""
    import signal

    from cli.chat import PrefillStatus, stream_reply
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.session import ChatSession, Settings, cache_count

    model, tokenizer = loaded
    session = ChatSession(model, tokenizer, Settings(CacheSpec(2, 64), max_tokens=6, temp=0.0))
    stream_reply(session, "hello there", lambda _: None)
    before = (list(session.messages), session.fed_text, cache_count(session.caches))
    reference = session.checkpoint()

    class CtrlC(PrefillStatus):  # the user presses Ctrl-C once the first chunk is in
        def __call__(self, done, total):
            if 0 < done < total:
                os.kill(os.getpid(), signal.SIGINT)
            super().__call__(done, total)

    shown: list[str] = []
    paste = "the cat sat on the mat " * 80  # hundreds of tokens: several chunks
    stopped = stream_reply(session, paste, shown.append, CtrlC(open(os.devnull, "w")),
                           prefill_step_size=64)  # fmt: skip
    assert stopped and shown == []
    assert (session.messages, session.fed_text, cache_count(session.caches)) == before

    def reply() -> str:
        text: list[str] = []
        stream_reply(session, "and then?", text.append)
        return "".join(text)

    after = reply()
    session.restore(reference)  # the state before the dropped turn
    assert after == reply()
