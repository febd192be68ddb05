"""``mlx-stream chat`` on the tiny model: scripted turns, slash commands, checkpoints,
options, bad input, Ctrl-C, and a few turns on the real default model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.support.cli import assert_one_line_error

runner = CliRunner()


@pytest.fixture
def tiny(tiny_model_dir, tmp_path):
    """Register the tiny model as the default in the user registry; returns its name."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / "models.yaml").write_text(
        "default: tiny\n"
        "models:\n"
        "  tiny:\n"
        "    description: tiny random llama\n"
        "    sinks: 2\n"
        "    window: 24\n"
        f"    sources:\n      - path: {tiny_model_dir}\n"
    )
    return "tiny"


def chat(*args: str, input: str = ""):
    """The chat with piped input; greedy unless ``args`` sample (these tests compare
    replies across runs, and the model's default is to sample)."""
    greedy = [] if "--temp" in args else ["--temp", "0"]
    return runner.invoke(app, ["chat", *greedy, *args], input=input)


def replies(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.strip()]


# ------------------------------------------------------------------ scripted turns


def test_three_scripted_turns_print_only_the_replies(tiny):
    result = chat("--max-tokens", "6", input="hello\nthe sea is\nwho are you\n")
    assert result.exit_code == 0, result.stderr
    lines = replies(result)
    assert len(lines) == 3, result.stdout
    assert ">>>" not in result.stdout  # no prompt when stdin is not a terminal
    assert all(len(line.split()) >= 1 for line in lines)


def test_default_model_from_environment(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MLX_STREAM_MODEL", str(tiny_model_dir))
    result = chat("--max-tokens", "3", input="hello\n")
    assert result.exit_code == 0, result.stderr
    assert len(replies(result)) == 1


def test_greedy_replies_are_deterministic_and_seeded_sampling_repeats(tiny):
    args = ["--max-tokens", "8", "--temp", "0.9", "--top-p", "0.9", "--seed", "7"]
    a = chat(*args, input="hello\nthe sea\n")
    b = chat(*args, input="hello\nthe sea\n")
    assert a.exit_code == b.exit_code == 0
    assert a.stdout == b.stdout
    c = chat(*args[:-1], "8", input="hello\nthe sea\n")
    assert c.exit_code == 0
    assert c.stdout != a.stdout  # another seed, other samples (random 70-word vocab)


def test_draft_model_gives_the_greedy_replies_of_the_target(tiny, tmp_path):
    from tests import tiny as tiny_mod

    draft = tiny_mod.save_model_folder(tmp_path / "draft", seed=1)
    plain = chat("--max-tokens", "12", input="hello\nthe sea\n")
    spec = chat(
        "--max-tokens", "12", "--draft-model", str(draft), "--num-draft-tokens", "2",
        input="hello\nthe sea\n",
    )  # fmt: skip
    assert plain.exit_code == spec.exit_code == 0, spec.stderr
    assert spec.stdout == plain.stdout


def test_dtype_option(tiny):
    result = chat("--dtype", "float16", "--max-tokens", "3", input="hello\n")
    assert result.exit_code == 0, result.stderr
    assert len(replies(result)) == 1


# ----------------------------------------------------------------- slash commands


def test_help_stats_and_reset(tiny):
    result = chat(
        "--max-tokens", "4",
        input="/help\nhello\n/stats\n/reset\n/stats\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "/save PATH" in out
    turns = [line.split()[1] for line in out.splitlines() if line.startswith("turns ")]
    assert turns == ["1", "0"]  # two /stats reports, before and after /reset
    assert "Conversation reset." in out


def test_quit_ends_the_chat(tiny):
    result = chat("--max-tokens", "4", input="hello\n/quit\nnever answered\n")
    assert result.exit_code == 0
    assert len(replies(result)) == 1


def test_stats_show_the_window_full_but_bounded(tiny):
    text = "".join(f"the sea {i}\n" for i in range(6)) + "/stats\n"
    result = chat("--max-tokens", "8", "--sinks", "2", "--window", "16", input=text)
    assert result.exit_code == 0, result.stderr
    cache_line = next(line for line in result.stdout.splitlines() if line.startswith("cache "))
    assert "2/2 sinks + 16/16 window" in cache_line


def test_unknown_slash_command_is_one_line_and_the_chat_goes_on(tiny):
    result = chat("--max-tokens", "3", input="/frobnicate\nhello\n")
    assert result.exit_code == 0
    assert "unknown command /frobnicate" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert len(replies(result)) == 1


def test_system_command_sets_prompt_and_resets(tiny):
    result = chat("--max-tokens", "3", input="hello\n/system you are a captain\n/stats\n")
    assert result.exit_code == 0
    assert "System prompt set; conversation reset." in result.stdout
    assert "turns          0" in result.stdout


def test_keep_system_makes_the_system_prompt_the_sinks(tiny):
    # "<|im_start|> system you are a captain <|im_end|>" is 7 tokens of the tiny vocab.
    result = chat(
        "--system", "you are a captain", "--keep-system", "--window", "8", "--max-tokens", "6",
        input="hello\nthe sea\nwhat ship\n/stats\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "7/7 sinks + 8/8 window" in result.stdout


def test_keep_system_without_a_system_prompt_is_bad_usage(tiny):
    assert_one_line_error(chat("--keep-system", input="hello\n"), 2, "--system")


def test_save_then_load_restores_the_conversation(tiny, tmp_path):
    ckpt = tmp_path / "talk"
    whole = chat("--max-tokens", "6", input="hello\nthe sea\nwhat ship\n")
    first = chat("--max-tokens", "6", input=f"hello\n/save {ckpt}\n")
    assert first.exit_code == 0, first.stderr
    assert (tmp_path / "talk.safetensors").is_file()
    transcript = json.loads((tmp_path / "talk.json").read_text())
    assert [m["role"] for m in transcript["messages"]] == ["user", "assistant"]
    assert transcript["messages"][0]["content"] == "hello"
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # atomic, no leftovers
    second = chat("--max-tokens", "6", input=f"/load {ckpt}.json\nthe sea\nwhat ship\n/stats\n")
    assert second.exit_code == 0, second.stderr
    assert "Loaded" in second.stdout and "(1 turns)" in second.stdout
    # The restored chat continues exactly like the uninterrupted one.
    assert replies(second)[1:3] == replies(whole)[1:3]
    assert "turns          3" in second.stdout


def test_save_and_load_with_a_draft_model(tiny, tmp_path):
    from tests import tiny as tiny_mod

    draft = tiny_mod.save_model_folder(tmp_path / "draft", seed=1)
    args = ["--max-tokens", "6", "--draft-model", str(draft)]
    whole = chat(*args, input="hello\nthe sea\n")
    first = chat(*args, input=f"hello\n/save {tmp_path / 'talk'}\n")
    assert first.exit_code == 0, first.stderr
    assert (tmp_path / "talk.draft.safetensors").is_file()
    second = chat(*args, input=f"/load {tmp_path / 'talk'}\nthe sea\n")
    assert second.exit_code == 0, second.stderr
    assert replies(second)[1] == replies(whole)[1]


def test_load_of_a_missing_or_foreign_file_is_one_line(tiny, tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
    result = chat(input=f"/load {tmp_path / 'nope'}\n/load {tmp_path / 'junk'}\n/save\n")
    assert result.exit_code == 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert "no such file" in lines[0] and "junk" in lines[1] and "needs a path" in lines[2]
    assert "Traceback" not in result.stderr


def test_save_to_an_unwritable_place_is_one_line(tiny, tmp_path):
    result = chat("--max-tokens", "2", input=f"hello\n/save {tmp_path / 'no' / 'such' / 'x'}\n")
    assert result.exit_code == 0
    assert "does not exist" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# ------------------------------------------- faults end one operation, not the chat


def turns_reported(result) -> list[str]:
    return [line.split()[1] for line in result.stdout.splitlines() if line.startswith("turns ")]


def test_invalid_utf8_in_a_line_is_replaced_and_the_chat_goes_on(tiny):
    result = runner.invoke(
        app, ["chat", "--max-tokens", "4"], input=b"hello \xff\xfe there\nthe sea\n/stats\n"
    )
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr and not result.stderr.strip()
    assert turns_reported(result) == ["2"]


def test_clean_text_makes_undecodable_input_replacement_characters():
    from mlx_stream.generate.session import clean_text

    assert clean_text("caf\udcc3\udca9") == "caf\u00e9"  # escaped UTF-8 bytes decode back
    assert clean_text("a\udcffb") == "a\ufffdb"  # a byte that is not UTF-8
    assert clean_text("a\ud800b") == "a?b"  # a lone surrogate from JSON
    assert clean_text("plain") == "plain"


@pytest.mark.parametrize(
    "error, words",
    [
        ((OSError, 28, "No space left on device"), ["No space left"]),
        ((PermissionError, 13, "Permission denied"), ["Permission denied"]),
    ],
)
def test_save_that_fails_midway_is_one_line_and_the_chat_goes_on(
    tiny, tmp_path, monkeypatch, error, words
):
    import mlx_stream.cache.sink

    def failing(*args, **kwargs):
        # A new exception each time: a shared one would keep its traceback, and with it
        # the session's caches, alive for the rest of the test run.
        kind, code, text = error
        raise kind(code, text)

    monkeypatch.setattr(mlx_stream.cache.sink, "save_cache", failing)
    ckpt = tmp_path / "talk"
    result = chat("--max-tokens", "4", input=f"hello\n/save {ckpt}\nthe sea\n/stats\n")
    assert result.exit_code == 0, result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "cannot save" in err[0], err
    assert all(w in err[0] for w in words)
    assert turns_reported(result) == ["2"]
    assert not list(tmp_path.glob("talk*"))  # nothing half-written


def rewrite_state(cache_file, change) -> None:
    """Rewrite the chat state stored in a /save cache file's header with ``change``."""
    import mlx.core as mx

    from mlx_stream.generate.session import STATE_KEY

    arrays, meta = mx.load(str(cache_file), return_metadata=True)
    state = json.loads(meta[STATE_KEY])
    change(state)
    meta[STATE_KEY] = json.dumps(state)
    mx.save_safetensors(str(cache_file), arrays, meta)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda s: s.pop("system"), ["no 'system' field"]),
        (lambda s: s.update(messages="hello"), ["'messages' must be"]),
        (lambda s: s.update(pending=["x"]), ["'pending' must be"]),
        (lambda s: s.update(window=None), ["'window' must be"]),
    ],
)
def test_load_of_a_save_with_a_bad_field_is_one_line_and_the_chat_goes_on(
    tiny, tmp_path, change, words
):
    ckpt = tmp_path / "talk"
    assert chat("--max-tokens", "4", input=f"hello\n/save {ckpt}\n").exit_code == 0
    rewrite_state(tmp_path / "talk.safetensors", change)
    result = chat("--max-tokens", "4", input=f"the sea\n/load {ckpt}\nwhat ship\n/stats\n")
    assert result.exit_code == 0, result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "talk.safetensors" in err[0], err
    assert all(w in err[0] for w in words), err
    assert turns_reported(result) == ["2"]  # the conversation before /load is intact


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "args, words",
    [
        (["-m", "no-such-model"], ["no-such-model"]),
        (["--window", "0"], ["--window"]),
        (["--sinks", "-1"], ["--sinks"]),
        (["--max-tokens", "0"], ["--max-tokens"]),
        (["--top-p", "1.5"], ["--top-p"]),
        (["--temp", "-1"], ["--temp"]),
        (["--dtype", "int3"], ["int3"]),
    ],
)
def test_bad_options_are_one_line_exit_2(tiny, args, words):
    assert_one_line_error(chat(*args, input="hello\n"), 2, *words)


def test_missing_model_folder_is_one_line(tmp_path):
    assert_one_line_error(chat("-m", str(tmp_path), input="hello\n"), 2, str(tmp_path))


# ------------------------------------------------------------ the session, directly


def make_session(loaded, **kw):
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.session import ChatSession, Settings

    model, tokenizer = loaded
    settings = Settings(CacheSpec(kw.pop("sinks", 2), kw.pop("window", 64)), max_tokens=8)
    return ChatSession(model, tokenizer, settings, **kw)


def test_each_turn_feeds_only_what_is_new(loaded):
    """The cache holds the rendered conversation exactly once: nothing re-fed, the
    end-of-turn token after each reply included (fed at the start of the next turn)."""
    from mlx_stream.generate.session import cache_count

    session = make_session(loaded, system="you are a captain")
    for text in ("hello", "the sea", "what ship"):
        session.reply(text, lambda s: None)
    fed = cache_count(session.caches) + len(session.pending)
    assert fed == len(session.encode(session.fed_text))
    assert session.fed_text.count("<|im_end|>") == 1 + 2 * 3 - 1  # system + 5 closed turns
    messages = session.conversation()
    assert session.fed_text == session.render(messages[:-1]) + messages[-1]["content"]


def test_a_reply_that_ends_with_eos_leaves_the_cache_exact(loaded):
    """The engine feeds the eos it sampled; the chat trims it so the template's own
    end-of-turn text is what the next turn feeds (no doubled end-of-turn token)."""
    from mlx_stream.generate.session import cache_count

    session = make_session(loaded, sinks=4, window=64)
    session.settings.max_tokens = 2000
    first = session.reply("hello there", lambda s: None)
    assert first.finish_reason == "stop" and first.tokens < 2000
    session.settings.max_tokens = 4
    session.reply("the sea", lambda s: None)
    assert cache_count(session.caches) + len(session.pending) == len(
        session.encode(session.fed_text)
    )


def test_ctrl_c_mid_reply_keeps_the_partial_reply(loaded):
    from mlx_stream.generate.session import cache_count

    session = make_session(loaded)
    session.settings.max_tokens = 1000
    seen = []

    def write(text):
        seen.append(text)
        if len(seen) == 5:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends

    reply = session.reply("hello", write)
    assert reply.interrupted and 5 <= reply.tokens < 1000
    assert session.messages[-1] == {"role": "assistant", "content": reply.text}
    assert cache_count(session.caches) + len(session.pending) == len(
        session.encode(session.fed_text)
    )
    session.settings.max_tokens = 8
    again = session.reply("the sea", lambda s: None)
    assert not again.interrupted and again.tokens > 0


# ------------------------------------------------------------------------ real model


@pytest.mark.real_model
def test_real_model_three_turns(real_model_path):
    """Three scripted turns through the real command (a subprocess, so MLX gets the
    optimized BLAS preloaded)."""
    proc = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "chat", "-m",
         str(real_model_path), "--max-tokens", "24", "--temp", "0"],  # greedy: a fixed reply
        input="What is the capital of France?\nAnd of Italy?\nThank you!\n",
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) >= 3, proc.stdout
    assert "Paris" in lines[0]
    assert "Rome" in proc.stdout  # the second turn saw the first: "And of Italy?"


def test_edit_replaces_a_turn_and_answers_the_last_message_again(tiny):
    script = "hello\nthe sea is\n/edit 1 goodbye\n/edit 9 x\n/edit one x\n"
    result = chat("--max-tokens", "4", "--window", "200", input=script)
    assert result.exit_code == 0, result.stderr
    lines = replies(result)
    assert len(lines) == 4, result.stdout  # two replies, the edit's line, the new reply
    assert lines[2].startswith("Turn 1 edited: ") and "computed again" in lines[2]
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 2 and "no turn 9 (the chat has 2)" in errors[0]
    assert "/edit N TEXT" in errors[1]
