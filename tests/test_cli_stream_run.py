"""``mlx-stream stream-run`` on the tiny model: JSON and CSV figures, checkpoint and
resume, --prompt, stdin, bad input; and a real-model run on Alice in Wonderland."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests import tiny as tiny_mod
from tests.support.cli import BAD_TEXT_FILES, assert_one_line_error
from tests.support.paths import DATA

runner = CliRunner()
BASE = ["--window", "32", "--sinks", "4", "--segment", "100"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """About 700 tokens of the tiny vocabulary, one paragraph every 12 words."""
    rng = random.Random(0)
    words = [rng.choice(tiny_mod.VOCAB_WORDS) for _ in range(700)]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run(*args: str, input: str | None = None):
    return runner.invoke(app, ["stream-run", *args], input=input)


def run_json(*args: str, input: str | None = None) -> dict:
    result = run(*args, "--json", input=input)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_json_has_the_figures(tiny_model_dir, text_file):
    data = run_json(str(text_file), "-m", str(tiny_model_dir), *BASE)
    for key in ("tokens", "perplexity", "segments", "sinks", "window", "tokens_per_second",
                "peak_memory_mb", "positions"):  # fmt: skip
        assert key in data, key
    assert data["tokens"] == 699 and (data["sinks"], data["window"]) == (4, 32)
    assert math.isfinite(data["perplexity"]) and data["perplexity"] > 1
    segments = data["segments"]
    assert [(s["start"], s["end"]) for s in segments] == [(i, i + 100) for i in range(0, 700, 100)]
    assert all(math.isfinite(s["perplexity"]) for s in segments)
    assert data["peak_memory_mb"] > 0 and data["tokens_per_second"] > 0


def test_table_output_and_limit_tokens(tiny_model_dir, text_file):
    result = run(str(text_file), "-m", str(tiny_model_dir), *BASE, "--limit-tokens", "250")
    assert result.exit_code == 0, result.stderr
    assert "200–250" in result.stdout
    assert "over 249 tokens" in result.stdout


def test_csv_has_one_row_per_segment(tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "segments.csv"
    data = run_json(str(text_file), "-m", str(tiny_model_dir), *BASE, "--csv", str(out))
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == len(data["segments"]) == 7
    assert [int(r["start"]) for r in rows] == [s["start"] for s in data["segments"]]
    assert float(rows[3]["perplexity"]) == pytest.approx(data["segments"][3]["perplexity"])


def test_resume_equals_an_uninterrupted_run(tiny_model_dir, text_file, tmp_path):
    args = [str(text_file), "-m", str(tiny_model_dir), *BASE]
    whole = run_json(*args, "--limit-tokens", "600")
    ckpt = tmp_path / "run.safetensors"
    half = run_json(*args, "--limit-tokens", "300", "--checkpoint", str(ckpt))
    assert half["tokens"] == 299 and ckpt.is_file()
    rest = run_json(*args, "--limit-tokens", "600", "--resume", str(ckpt))
    assert rest["tokens"] == whole["tokens"] == 599
    assert rest["perplexity"] == pytest.approx(whole["perplexity"], rel=1e-5)
    for a, b in zip(rest["segments"], whole["segments"], strict=True):
        assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-5)


def test_resume_into_another_checkpoint_keeps_the_first(tiny_model_dir, text_file, tmp_path):
    args = [str(text_file), "-m", str(tiny_model_dir), *BASE]
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    run_json(*args, "--limit-tokens", "200", "--checkpoint", str(first))
    before = first.read_bytes()
    data = run_json(*args, "--limit-tokens", "400", "--resume", str(first), "--checkpoint", str(second))  # fmt: skip
    assert data["tokens"] == 399 and second.is_file()
    assert first.read_bytes() == before


def test_prompt_answers_from_the_window(tiny_model_dir, text_file):
    ask = ["--prompt", "who is the captain", "--max-tokens", "6", "--seed", "5"]
    result = run(str(text_file), "-m", str(tiny_model_dir), *BASE, *ask)
    assert result.exit_code == 0, result.stderr
    answer = result.stdout.strip().splitlines()[-1]
    assert 1 <= len(answer.split()) <= 6
    data = run_json(str(text_file), "-m", str(tiny_model_dir), *BASE, *ask)
    assert data["answer"].strip() == answer  # same seeded answer, inside the JSON
    assert data["finish_reason"] in ("stop", "length")
    other = run_json(str(text_file), "-m", str(tiny_model_dir), *BASE, *ask[:-1], "6")
    greedy = run_json(str(text_file), "-m", str(tiny_model_dir), *BASE, *ask, "--temp", "0")
    assert len({data["answer"], other["answer"], greedy["answer"]}) > 1  # sampled by default


def test_progress_is_over_the_files_bytes(tiny_model_dir, text_file, monkeypatch):
    from cli.stream_run import CountingReader, Tracked, progress_done

    size = text_file.stat().st_size
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws its live bar as on a terminal
    monkeypatch.setenv("COLUMNS", "120")
    result = run(str(text_file), "-m", str(tiny_model_dir), *BASE)
    assert result.exit_code == 0, result.stderr
    assert f"/{size / 1000:.1f} kB" in result.stderr, result.stderr[-2000:]  # of the file
    tokens, reader = Tracked(iter(range(100))), CountingReader(None)
    list(tokens)
    reader.bytes = 400
    assert progress_done(50, tokens, reader, 1000) == 200  # 4 bytes a token so far
    assert progress_done(400, tokens, reader, 1000) == 1000  # never past the size


def test_stdin_and_absolute_positions(tiny_model_dir, text_file):
    text = text_file.read_text()
    from_stdin = run_json("-", "-m", str(tiny_model_dir), *BASE, input=text)
    from_file = run_json(str(text_file), "-m", str(tiny_model_dir), *BASE)
    assert from_stdin["perplexity"] == pytest.approx(from_file["perplexity"], rel=1e-6)
    absolute = run_json(str(text_file), "-m", str(tiny_model_dir), *BASE, "--positions",
                        "absolute", "--chunk", "16", "--dtype", "float32")  # fmt: skip
    assert absolute["positions"] == "absolute" and math.isfinite(absolute["perplexity"])
    assert absolute["perplexity"] != from_file["perplexity"]  # positions do matter


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "make, words",
    [
        *BAD_TEXT_FILES,
        (
            lambda p: (p / "l1.txt", (p / "l1.txt").write_bytes("caf\xe9\n".encode("latin-1")))[0],
            ["not UTF-8"],
        ),  # fmt: skip
    ],
)
def test_bad_input_files(tiny_model_dir, tmp_path, make, words):
    path = make(tmp_path)
    assert_one_line_error(run(str(path), "-m", str(tiny_model_dir)), 2, str(path), *words)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--window", "0"], ["--window"]),
        (["--sinks", "-1"], ["--sinks"]),
        (["--chunk", "0"], ["--chunk"]),
        (["--positions", "relative"], ["--positions"]),
        (["-m", "no-such-model"], ["no-such-model"]),
        (["--csv", "/nonexistent-dir/x.csv"], ["/nonexistent-dir"]),
        (["--checkpoint", "ckpt.bin"], ["--checkpoint", ".safetensors"]),
    ],
)
def test_bad_options(tiny_model_dir, text_file, args, words):
    model = [] if "-m" in args else ["-m", str(tiny_model_dir)]
    assert_one_line_error(run(str(text_file), *model, *args), 2, *words)


def test_resume_from_missing_or_foreign_file(tiny_model_dir, text_file, tmp_path):
    args = [str(text_file), "-m", str(tiny_model_dir), *BASE]
    missing = tmp_path / "none.safetensors"
    assert_one_line_error(run(*args, "--resume", str(missing)), 2, "no such checkpoint")
    foreign = tmp_path / "junk.safetensors"
    foreign.write_bytes(b"junk")
    assert_one_line_error(run(*args, "--resume", str(foreign)), 2, "not a stream-run checkpoint")
    ckpt = tmp_path / "ok.safetensors"
    run_json(*args, "--limit-tokens", "100", "--checkpoint", str(ckpt))
    result = run(*args, "--segment", "50", "--resume", str(ckpt))
    assert_one_line_error(result, 2, "segment 100", "segment 50")


def test_unwritable_output_paths(tiny_model_dir, text_file, tmp_path):
    args = [str(text_file), "-m", str(tiny_model_dir)]
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert_one_line_error(run(*args, "--csv", str(not_a_dir / "x.csv")), 2, "not a directory")
    assert_one_line_error(run(*args, "--csv", str(tmp_path)), 2, "is a directory")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        assert_one_line_error(run(*args, "--csv", str(locked / "x.csv")), 2, "not writable")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] + (
        [] if os.geteuid() == 0 else ["locked"]
    )


# ------------------------------------------------------------------------ real model


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_alice_perplexity_is_finite(real_model_path):
    """200 tokens of Alice in Wonderland, past a 64-token window, through the real
    command (a subprocess, so MLX gets the optimized BLAS preloaded when installed;
    without it MLX's reference BLAS prefills ~10 tokens/s here)."""
    alice = DATA / "alice_in_wonderland.txt"
    if not alice.is_file():
        pytest.skip(f"{alice} is missing")
    proc = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "stream-run", str(alice),
         "-m", str(real_model_path), "--window", "64", "--limit-tokens", "200",
         "--segment", "100", "--json"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["tokens"] == 199
    assert math.isfinite(data["perplexity"]) and 1 < data["perplexity"] < 200
    assert len(data["segments"]) == 2


@pytest.mark.real_model
@pytest.mark.parametrize("end", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"])
def test_real_model_prompt_answer_ends_at_the_end_of_its_turn(real_model, end):
    """``--prompt``'s answer on the default model stops at any token that ends a turn:
    an answer once ran on into a new turn's "system\nYou are a" (issue 37). The model
    is made to write ``end`` as its sixth token."""
    import mlx.core as mx

    from cli.stream_run import answer
    from mlx_stream.cache.spec import CacheSpec

    model, tokenizer, _ = real_model
    token = tokenizer.convert_tokens_to_ids(end)
    caches = CacheSpec(4, 128).build(model)
    steps = []

    def force(history, logits):  # after five tokens, only ``end`` may come
        steps.append(1)
        if len(steps) <= 5:
            return logits
        return mx.where(mx.arange(logits.shape[-1]) == token, 0.0, -mx.inf)[None]

    text, finish = answer(model, tokenizer, caches, None, "Who is Alice?", 40, lambda t: None,
                          [force])  # fmt: skip
    assert finish == "stop", (text, finish)  # else `end` again and again until 40
    assert text.strip() and "system" not in text and end not in text


# ------------------------------------------------- issue 13: nothing lost, no files hurt


def test_outputs_naming_the_input_are_refused(tiny_model_dir, text_file, tmp_path):
    args = ["-m", str(tiny_model_dir), *BASE]
    before = text_file.read_bytes()
    result = run(str(text_file), *args, "--csv", str(text_file))
    assert_one_line_error(result, 2, "--csv", "same file as the input")
    doc = tmp_path / "doc.safetensors"  # a text file that happens to have that name
    doc.write_bytes(before)
    result = run(str(doc), *args, "--checkpoint", str(tmp_path / "." / "doc.safetensors"))
    assert_one_line_error(result, 2, "--checkpoint", "same file as the input")
    ckpt = tmp_path / "c.safetensors"
    run_json(str(text_file), *args, "--limit-tokens", "100", "--checkpoint", str(ckpt))
    kept = ckpt.read_bytes()
    result = run(str(text_file), *args, "--resume", str(ckpt), "--csv", str(ckpt))
    assert_one_line_error(result, 2, "--csv", "same file as --resume")
    assert text_file.read_bytes() == doc.read_bytes() == before and ckpt.read_bytes() == kept


def test_a_failed_side_output_still_prints_the_result(tiny_model_dir, text_file, tmp_path, monkeypatch):  # fmt: skip
    import cli.stream_run

    def disk_full(path, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.stream_run, "atomic_write_csv", disk_full)
    out = tmp_path / "s.csv"
    result = run(str(text_file), "-m", str(tiny_model_dir), *BASE, "--csv", str(out), "--json")
    assert_one_line_error(result, 1, "cannot write --csv", "No space left")
    assert json.loads(result.stdout)["tokens"] == 699  # the hour's result is not lost


def test_new_files_follow_the_umask(tiny_model_dir, text_file, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "s.csv"
        run_json(str(text_file), "-m", str(tiny_model_dir), *BASE, "--csv", str(out))
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644


def test_resume_with_other_settings_or_text_exit_2(tiny_model_dir, text_file, tmp_path):
    args = ["-m", str(tiny_model_dir), *BASE]
    ckpt = tmp_path / "c.safetensors"
    run_json(str(text_file), *args, "--limit-tokens", "200", "--checkpoint", str(ckpt))
    for extra, words in ((["--kv-bits", "4"], ["kv-bits none", "kv-bits 4"]),
                         (["--positions", "absolute"], ["positions cache"])):  # fmt: skip
        result = run(str(text_file), *args, *extra, "--resume", str(ckpt), "--checkpoint",
                     str(tmp_path / "new.safetensors"))  # fmt: skip
        assert_one_line_error(result, 2, str(ckpt), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]  # nothing written
    other = tmp_path / "other.txt"
    other.write_text(" ".join(reversed(text_file.read_text().split())))
    assert_one_line_error(run(str(other), *args, "--resume", str(ckpt)), 2, "another text")


def test_ctrl_c_saves_a_checkpoint_and_prints_the_figures(tiny_model_dir, text_file, tmp_path, monkeypatch):  # fmt: skip
    import mlx_stream.generate.decode

    class CtrlCAfterThreeCalls(mlx_stream.generate.decode.StopOnInterrupt):
        checks = 0

        @property
        def interrupted(self):
            type(self).checks += 1
            return type(self).checks > 3

        @interrupted.setter
        def interrupted(self, value):
            pass

    monkeypatch.setattr(mlx_stream.generate.decode, "StopOnInterrupt", CtrlCAfterThreeCalls)
    ckpt = tmp_path / "c.safetensors"
    args = [str(text_file), "-m", str(tiny_model_dir), *BASE]
    result = run(*args, "--checkpoint", str(ckpt), "--json")
    assert result.exit_code == 130, result.output
    data = json.loads(result.stdout)
    assert data["interrupted"] is True and 0 < data["tokens"] < 699
    assert f"--resume {ckpt}" in result.stderr and ckpt.is_file()
    monkeypatch.undo()
    rest = run_json(*args, "--resume", str(ckpt))
    assert rest["tokens"] == 699


def test_an_impossible_window_is_refused_before_allocating(tiny_model_dir, text_file):
    result = run(str(text_file), "-m", str(tiny_model_dir), "--window", "1000000000")
    assert_one_line_error(result, 2, "--window", "needs", "available")


def test_bad_bytes_are_replaced_not_fatal(tiny_model_dir, text_file, tmp_path):
    words = text_file.read_text()
    data = run_json("-", "-m", str(tiny_model_dir), *BASE, input=words[:200].encode() + b"\xff\xfe " + words[200:].encode())  # fmt: skip
    assert data["tokens"] > 600
    deep = tmp_path / "deep.txt"  # past the 64 KiB that are checked up front
    deep.write_bytes((words * 40).encode()[:70000] + b" \xff " + words.encode())
    data = run_json(str(deep), "-m", str(tiny_model_dir), *BASE, "--limit-tokens", "300")
    assert data["tokens"] == 299


def test_json_never_holds_nan():
    from cli.common import json_line

    line = json_line({"perplexity": float("nan"), "segments": [{"p": float("inf")}], "n": 3})
    assert json.loads(line) == {"perplexity": None, "segments": [{"p": None}], "n": 3}


def test_a_closed_pipe_exits_quietly(tiny_model_dir):
    read, write = os.pipe()
    os.close(read)  # like `| head` that has already exited
    proc = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "models", "list", "--json"],
        stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
    )  # fmt: skip
    os.close(write)
    assert proc.stderr == "" and proc.returncode == 141
