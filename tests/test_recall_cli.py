"""``--recall`` on the command line (tiny model): stream-run answers through the recall
tier, and its settings' bad values are one line with exit code 2."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests import tiny as tiny_mod
from tests.support.cli import assert_one_line_error

runner = CliRunner()
BASE = ["--window", "32", "--sinks", "4", "--segment", "100"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(1)
    words = [rng.choice(tiny_mod.VOCAB_WORDS) for _ in range(500)]
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text(" ".join(words) + "\n", encoding="utf-8")
    return path


def run(*args: str):
    return runner.invoke(app, ["stream-run", *args])


def test_stream_run_answers_with_recall(tiny_model_dir, text_file, tmp_path):
    args = [str(text_file), "-m", str(tiny_model_dir), *BASE, "--prompt", "what was said",
            "--max-tokens", "5", "--json"]  # fmt: skip
    plain = run(*args)
    spilled = tmp_path / "store"
    result = run(*args, "--recall", "--recall-blocks", "2", "--recall-ram", "0",
                 "--recall-dir", str(spilled))  # fmt: skip
    assert plain.exit_code == 0 and result.exit_code == 0, result.stderr
    a, b = json.loads(plain.stdout), json.loads(result.stdout)
    assert a["tokens"] == b["tokens"] == 499
    # the window alone and the window with recall score the text differently
    assert a["perplexity"] != b["perplexity"]
    assert isinstance(b["answer"], str)
    assert list(spilled.glob("*.npy"))  # the store spilled to the folder asked for


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--recall-blocks", "0"], ("--recall-blocks",)),
        (["--recall-bits", "3"], ("--recall-bits",)),
        (["--recall-ram", "-1"], ("--recall-ram",)),
    ],
)
def test_bad_recall_settings_are_one_line(tiny_model_dir, text_file, extra, words):
    result = run(str(text_file), "-m", str(tiny_model_dir), *BASE, "--recall", *extra)
    assert_one_line_error(result, 2, *words)


def test_unwritable_recall_folder_is_one_line(tiny_model_dir, text_file, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run(str(text_file), "-m", str(tiny_model_dir), *BASE, "--recall",
                 "--recall-dir", str(blocker / "store"))  # fmt: skip
    assert_one_line_error(result, 2, "cannot write the recall store")


def test_eval_recall_long_contexts_has_a_recall_column(tiny_model_dir):
    args = ["eval", "recall", "-m", str(tiny_model_dir), "--length", "300", "--window", "32",
            "--depths", "0.2,0.8", "--answer-tokens", "3", "--trials", "1", "--recall",
            "--recall-blocks", "2"]  # fmt: skip
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    caches = sorted({r["cache"] for r in rows})
    assert caches == ["full", "recall", "window"]  # 300 tokens fit the tiny model's context
    assert len(rows) == 2 * 2 * 3  # kinds x depths x caches
    assert all(r["length_asked"] == 300 and 300 - 40 <= r["length"] <= 300 for r in rows)
    recalled = [r for r in rows if r["cache"] == "recall"]
    assert all(r["store_bytes"] > 0 and r["region_bytes"] > 0 for r in recalled)
    assert all(1 <= len(r["needle_blocks"]) <= 2 for r in recalled)
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.stderr
    assert "window + recall" in table.stdout and "passkey" in table.stdout


def test_eval_recall_long_context_bad_depth_is_one_line(tiny_model_dir):
    result = runner.invoke(app, ["eval", "recall", "-m", str(tiny_model_dir), "--length", "300",
                                 "--depths", "1.5"])  # fmt: skip
    assert_one_line_error(result, 2, "--depths")


def test_profile_shows_device_and_store_bytes_apart(tiny_model_dir):
    args = ["profile", "-m", str(tiny_model_dir), "--prompt", "the sea and the ship",
            "--tokens", "200", "--window", "32", "--sinks", "4", "--recall",
            "--recall-blocks", "2"]  # fmt: skip
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    device, store = data["recall_device_mb"], data["recall_store_mb"]
    assert device["end"] > 0 and store["end"] > 0
    assert data["kv_cache_mb"]["start"] == data["kv_cache_mb"]["end"]  # the window: flat
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "recall store" in table.stdout
    refused = runner.invoke(app, [*args, "--cache", "full"])
    assert_one_line_error(refused, 2, "--recall")


def test_chat_with_recall_runs_past_the_window_and_saves(tiny_model_dir, tmp_path):
    rng = random.Random(3)
    turns = [" ".join(rng.choice(tiny_mod.VOCAB_WORDS) for _ in range(120)) for _ in range(3)]
    args = ["chat", "-m", str(tiny_model_dir), "--window", "24", "--sinks", "2",
            "--max-tokens", "8"]  # fmt: skip
    plain = runner.invoke(app, args, input="\n".join(turns) + "\n")
    result = runner.invoke(app, [*args, "--recall", "--recall-blocks", "2"],
                           input="\n".join(turns) + f"\n/save {tmp_path / 'x'}\n")  # fmt: skip
    assert plain.exit_code == 0 and result.exit_code == 0, result.stderr
    got = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(got) == 4 and got[3].startswith("Saved")
    assert (tmp_path / "x.recall" / "manifest.json").is_file()  # /save carries the store


def test_chat_leaves_no_recall_files_in_its_recall_dir(tiny_model_dir, tmp_path):
    """The store spills to --recall-dir while the chat runs; its files go when it ends
    (a /save copies what should outlive it)."""
    rng = random.Random(4)
    turns = [" ".join(rng.choice(tiny_mod.VOCAB_WORDS) for _ in range(150)) for _ in range(2)]
    spill = tmp_path / "spill"
    args = ["chat", "-m", str(tiny_model_dir), "--window", "24", "--sinks", "2",
            "--max-tokens", "4", "--recall", "--recall-ram", "0", "--recall-dir", str(spill)]  # fmt: skip
    result = runner.invoke(app, args, input="\n".join(turns) + "\n/stats\n")
    assert result.exit_code == 0, result.stderr
    assert "(disk)" in result.stdout  # the store spilled there
    assert spill.is_dir() and not any(spill.iterdir())
