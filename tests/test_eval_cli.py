"""``mlx-stream eval divergence|recall`` on the tiny model: the JSON fields, one run
comparing several policies, the tables, and bad input as for ``stream-run``."""

from __future__ import annotations

import json
import math
import random

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests import tiny as tiny_mod
from tests.support.cli import BAD_TEXT_FILES, assert_one_line_error

runner = CliRunner()
FIELDS = ("window", "sinks", "positions", "kv_bits", "tokens", "kl", "top1_agreement",
          "perplexity", "reference_perplexity", "first_divergence_median",
          "mismatch_after_divergence")  # fmt: skip


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(1)
    words = [rng.choice(tiny_mod.VOCAB_WORDS) for _ in range(300)]
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text(" ".join(words) + "\n", encoding="utf-8")
    return path


def divergence(*args: str):
    return runner.invoke(app, ["eval", "divergence", *args])


def test_divergence_json_compares_policies_in_one_run(tiny_model_dir, text_file):
    result = divergence(
        str(text_file), "-m", str(tiny_model_dir), "--window", "32,1000", "--sinks", "0,4",
        "--positions", "cache,rotating", "--limit-tokens", "120", "--points", "2",
        "--generate", "4", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    policies = data["policies"]
    assert [(p["window"], p["sinks"], p["positions"]) for p in policies] == [
        (w, s, p) for w in (32, 1000) for s in (0, 4) for p in ("cache", "rotating")
    ]
    for p in policies:
        assert set(FIELDS) <= set(p)
        assert p["tokens"] == 119 and p["kv_bits"] is None and p["points"] == 2
        assert math.isfinite(p["perplexity"]) and math.isfinite(p["reference_perplexity"])
    ref = {p["reference_perplexity"] for p in policies}
    assert len(ref) == 1  # one full-cache reference for all
    for p in policies[4:]:  # window 1000 > 120 tokens: nothing evicted
        assert p["kl"] == pytest.approx(0, abs=1e-6) and p["top1_agreement"] == 1.0
        assert p["first_divergence_median"] is None and p["diverged"] == 0
    assert all(p["kl"] > 1e-3 for p in policies[:4])


def test_divergence_table(tiny_model_dir, text_file):
    result = divergence(str(text_file), "-m", str(tiny_model_dir), "--window", "32",
                        "--limit-tokens", "80", "--points", "1", "--generate", "3")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "top-1" in result.stdout and "79 tokens against the full cache" in result.stdout


def test_recall_json_one_object_per_window_and_placement(tiny_model_dir):
    result = runner.invoke(app, ["eval", "recall", "-m", str(tiny_model_dir), "--window",
                                 "32,48", "--trials", "1", "--answer-tokens", "2", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["window"], r["placement"]) for r in rows] == [
        (w, p) for w in (32, 48) for p in ("inside", "just_outside", "far_outside", "system")
    ]
    for r in rows:
        assert {"placement", "window", "accuracy", "reference_accuracy"} <= set(r)
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["reference_accuracy"] <= 1


@pytest.mark.parametrize(
    "make, words",
    [
        *BAD_TEXT_FILES,
        (lambda p: (p / "one.txt", (p / "one.txt").write_text("the"))[0], ["too short"]),
    ],
)
def test_divergence_bad_input_files(tiny_model_dir, tmp_path, make, words):
    path = make(tmp_path)
    assert_one_line_error(divergence(str(path), "-m", str(tiny_model_dir)), 2, str(path), *words)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--window", "0"], ["--window"]),
        (["--window", "32,abc"], ["--window", "comma-separated"]),
        (["--sinks", "-1"], ["--sinks"]),
        (["--positions", "relative"], ["--positions"]),
        (["--kv-bits", "3"], ["--kv-bits"]),
        (["--positions", "rotating", "--kv-bits", "8"], ["RotatingKVCache"]),
        (["--limit-tokens", "5000"], ["context (4096)"]),
        (["--points", "-1"], ["--points"]),
        (["--generate", "0"], ["--generate"]),
        (["-m", "no-such-model"], ["no-such-model"]),
    ],
)
def test_divergence_bad_options(tiny_model_dir, text_file, args, words):
    model = [] if "-m" in args else ["-m", str(tiny_model_dir)]
    assert_one_line_error(divergence(str(text_file), *model, *args), 2, *words)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--window", "0"], ["--window"]),
        (["--placements", "nowhere"], ["--placements"]),
        (["--trials", "0"], ["--trials"]),
        (["--window", "4096"], ["--window 4096", "context is 4096"]),
    ],
)
def test_recall_bad_options(tiny_model_dir, args, words):
    result = runner.invoke(app, ["eval", "recall", "-m", str(tiny_model_dir), *args])
    assert_one_line_error(result, 2, *words)
