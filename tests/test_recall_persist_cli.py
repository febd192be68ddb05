"""Recall across stops on the command line (tiny model): ``stream-run --recall
--checkpoint/--resume`` carries the store, a full recall disk stops the run with its
checkpoint and the figures so far (exit 1), and a checkpoint made with other recall
settings, without recall or with a changed store file is one line (exit 2)."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests import tiny as tiny_mod
from tests.support.cli import assert_one_line_error
from tests.support.recall import full_disk

runner = CliRunner()
BASE = ["--window", "32", "--sinks", "4", "--segment", "100"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(2)
    words = [rng.choice(tiny_mod.VOCAB_WORDS) for _ in range(700)]
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text(" ".join(words) + "\n", encoding="utf-8")
    return path


def run(*args: str):
    return runner.invoke(app, ["stream-run", *args])


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def recall_args(tmp_path, text_file, tiny_model_dir, *extra: str) -> list[str]:
    return [str(text_file), "-m", str(tiny_model_dir), *BASE, "--recall", "--recall-blocks",
            "2", "--recall-ram", "0", "--recall-dir", str(tmp_path / "store"), *extra]  # fmt: skip


def same_figures(a: dict, b: dict) -> None:
    # Equal up to rounding: a resumed run's chunks start elsewhere, and an optimized
    # BLAS (OpenBLAS, Accelerate) rounds a row differently in calls of other sizes
    # (measured: 3e-5 with OpenBLAS; MLX's reference BLAS: under 1e-5).
    assert a["tokens"] == b["tokens"]
    assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-4)
    for x, y in zip(a["segments"], b["segments"], strict=True):
        assert x["perplexity"] == pytest.approx(y["perplexity"], rel=1e-4)


def test_resume_with_recall_equals_an_uninterrupted_run(tiny_model_dir, text_file, tmp_path):
    args = recall_args(tmp_path, text_file, tiny_model_dir)
    whole = run_json(*args, "--limit-tokens", "650")
    plain = run_json(*args[: args.index("--recall")], "--limit-tokens", "650")
    assert plain["perplexity"] != whole["perplexity"]  # recall changes the scores
    ckpt = tmp_path / "run.safetensors"
    half = run_json(*args, "--limit-tokens", "400", "--checkpoint", str(ckpt))
    assert half["tokens"] == 399
    manifest = json.loads((tmp_path / "run.recall" / "manifest.json").read_text())
    assert manifest["tier"]["store"]["count"][0] >= 4  # blocks stored, now in the checkpoint
    rest = run_json(*args, "--limit-tokens", "650", "--resume", str(ckpt))
    same_figures(rest, whole)


@pytest.fixture(scope="module")
def long_file(tmp_path_factory):
    """Long enough that the store needs a second segment (32 blocks of 64 tokens)."""
    rng = random.Random(5)
    words = [rng.choice(tiny_mod.VOCAB_WORDS) for _ in range(2600)]
    path = tmp_path_factory.mktemp("text") / "long.txt"
    path.write_text(" ".join(words) + "\n", encoding="utf-8")
    return path


def test_a_full_recall_disk_stops_with_the_checkpoint(tiny_model_dir, long_file, tmp_path,
                                                      monkeypatch):  # fmt: skip
    """The disk fills when the store needs its second segment, mid-stream: the
    checkpoint holds the first 32 blocks and resumes to the uninterrupted figures."""
    args = recall_args(tmp_path, long_file, tiny_model_dir)
    whole = run_json(*args)
    full_disk(monkeypatch, ".seg1.")
    ckpt = tmp_path / "c.safetensors"
    result = run(*args, "--checkpoint", str(ckpt), "--json")
    folder = tmp_path / "store"
    assert_one_line_error(result, 1, f"cannot write the recall store in {folder} (No space left "
                          "on device)", "stopped at token", f"--resume {ckpt}")  # fmt: skip
    data = json.loads(result.stdout)  # the figures so far
    assert data["interrupted"] is True and 0 < data["tokens"] < whole["tokens"]
    assert "No space left" in data["failure"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing half-written
    manifest = json.loads((tmp_path / "c.recall" / "manifest.json").read_text())
    assert manifest["tier"]["store"]["count"][0] == 32  # a full first segment carried
    monkeypatch.undo()  # room again
    rest = run_json(*args, "--resume", str(ckpt))
    same_figures(rest, whole)


def test_without_a_checkpoint_a_full_disk_says_nothing_was_saved(tiny_model_dir, text_file,
                                                                 tmp_path, monkeypatch):  # fmt: skip
    full_disk(monkeypatch)
    result = run(*recall_args(tmp_path, text_file, tiny_model_dir))
    assert_one_line_error(result, 1, "No space left on device", "nothing saved")
    assert "perplexity" in result.stdout  # the table of the figures so far


def test_resume_with_other_recall_settings_is_one_line(tiny_model_dir, text_file, tmp_path):
    args = recall_args(tmp_path, text_file, tiny_model_dir)
    ckpt = tmp_path / "c.safetensors"
    run_json(*args, "--limit-tokens", "300", "--checkpoint", str(ckpt))
    new = ["--checkpoint", str(tmp_path / "new.safetensors")]
    other = [a if a != "2" else "3" for a in args]  # --recall-blocks 3
    assert_one_line_error(run(*other, "--resume", str(ckpt), *new), 2, "recall-blocks 2",
                          "recall-blocks 3")  # fmt: skip
    plain = args[: args.index("--recall")]
    assert_one_line_error(run(*plain, "--resume", str(ckpt), *new), 2, "no --recall")
    # and a checkpoint without recall resumed with it
    bare = tmp_path / "bare.safetensors"
    run_json(*plain, "--limit-tokens", "300", "--checkpoint", str(bare))
    assert_one_line_error(run(*args, "--resume", str(bare), *new), 2,
                          "made without --recall")  # fmt: skip
    bits = [*args, "--recall-bits", "8"]
    assert_one_line_error(run(*bits, "--resume", str(ckpt), *new), 2, "recall-bits none")
    # where the store lives is the run's own: resuming onto another folder works
    moved = [a if a != str(tmp_path / "store") else str(tmp_path / "other") for a in args]
    assert run_json(*moved, "--limit-tokens", "400", "--resume", str(ckpt), *new)["tokens"] == 399
    victim = next((tmp_path / "c.recall").glob("store.*"))
    victim.write_bytes(victim.read_bytes()[:-1])
    assert_one_line_error(run(*args, "--resume", str(ckpt), *new), 2, victim.name,
                          "checksum mismatch")  # fmt: skip
