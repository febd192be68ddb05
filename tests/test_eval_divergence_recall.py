"""``eval divergence --recall``: the window with the recall tier against the full cache,
on a tiny model. Recall changes nothing until a stored block is selected, then the
rows differ; free-generation runs on copies leave the measured stream untouched."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app
from mlx_stream.eval.divergence import Policy, divergence
from mlx_stream.recall import RecallSpec
from tests import tiny
from tests.support.cli import assert_one_line_error

TOKENS = tiny.random_tokens(420, seed=5)
RECALL = RecallSpec(blocks=2)
runner = CliRunner()


@pytest.fixture(scope="module")
def model():
    return tiny.make_model("llama", scale=1.0)


def test_recall_equals_the_window_until_a_block_is_selected_then_differs(model):
    plain, recalled = divergence(model, TOKENS, [Policy(4, 32), Policy(4, 32, recall=RECALL)],
                                 chunk=16)  # fmt: skip
    # Block 0 (tokens 0-63) leaves the window by token 96, is stored at the boundary
    # 128 and is a candidate from the next one, 192: the first row that can see it.
    # (to float rounding: recall's larger slack changes the buffer attention runs over)
    assert np.allclose(plain.kl[:192], recalled.kl[:192], atol=1e-5)
    assert np.allclose(plain.nll[:192], recalled.nll[:192], atol=1e-5)
    assert np.abs(plain.kl[192:] - recalled.kl[192:]).max() > 1e-2
    assert np.abs(plain.kl[192:196] - recalled.kl[192:196]).min() > 1e-4  # from row 192 on
    assert np.array_equal(plain.reference_nll, recalled.reference_nll)
    s = recalled.summary()
    assert s["recall"] == {"blocks": 2, "bits": None} and plain.summary()["recall"] is None


def test_free_runs_on_copies_leave_the_recall_stream_as_it_was(model):
    """Greedy runs from copies (which share the recall store) at three points: the
    teacher-forced figures are those of a run without them."""
    alone = divergence(model, TOKENS, [Policy(4, 32, recall=RECALL)], chunk=16)[0]
    points = [200, 260, 330]
    with_runs = divergence(model, TOKENS, [Policy(4, 32, recall=RECALL)], chunk=16,
                           points=points, generate=6)[0]  # fmt: skip
    # to float rounding (the points split the calls differently); a copy's run left in
    # the tier moves the figures by ~0.1
    assert np.allclose(alone.kl, with_runs.kl, atol=1e-5)
    assert np.allclose(alone.nll, with_runs.nll, atol=1e-5)
    assert [p["position"] for p in with_runs.points] == points


def test_recall_needs_cache_positions():
    with pytest.raises(ValueError, match="cache positions"):
        Policy(4, 32, "absolute", recall=RECALL)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(2)
    words = [rng.choice(tiny.VOCAB_WORDS) for _ in range(400)]
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text(" ".join(words) + "\n", encoding="utf-8")
    return path


def test_cli_divergence_recall_adds_a_recall_twin(tiny_model_dir, text_file):
    args = ["eval", "divergence", str(text_file), "-m", str(tiny_model_dir), "--window", "32",
            "--sinks", "4", "--positions", "cache,absolute", "--points", "1", "--generate",
            "4", "--recall", "--recall-blocks", "2"]  # fmt: skip
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["policies"]
    assert [(r["positions"], r["recall"]) for r in rows] == [
        ("cache", None), ("cache", {"blocks": 2, "bits": None}), ("absolute", None)
    ]  # fmt: skip
    plain, recalled = rows[0], rows[1]
    assert plain["reference_perplexity"] == recalled["reference_perplexity"]
    assert plain["kl_evicted"] != recalled["kl_evicted"]  # recall changed the evicted rows
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "2 blocks" in table.stdout and "recall" in table.stdout
    refused = runner.invoke(app, [*args[:9], "--positions", "absolute", "--recall"])
    assert_one_line_error(refused, 2, "--recall")
