"""Sharded runs with MLX distributed (issue 16), on loopback with the ring backend.

The fast tests check the refusals in-process. The ``slow`` ones start real ranks with
``mlx.launch --backend ring --hosts 127.0.0.1`` (or by hand) and compare what rank 0
prints with one process: perplexity within float tolerance and greedy answers token
for token, past many wraps of a small window. Ranks that refuse, die or are stopped,
and sharded serve: ``test_distributed_ranks.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cli.main import app
from mlx_stream import distributed
from mlx_stream.errors import UserError
from tests import tiny
from tests.support.cli import assert_one_line_error
from tests.support.paths import DATA
from tests.support.ranks import (
    GREEDY,
    REAL_MODEL_TIMEOUT,
    SMALL,
    errors,
    last_json,
    launch,
    runner,
    single,
    start_ranks,
    stop_ranks,
)

# ------------------------------------------------------------------- refusals


def test_refuses_heads_that_do_not_divide_and_names_them():
    model = tiny.make_model("llama")  # 4 heads, 2 KV heads; no pipeline in mlx-lm
    with pytest.raises(UserError, match="4 attention heads do not divide over 3 ranks"):
        distributed.choose(model, 3)
    assert distributed.choose(model, 2) == "tensor"
    with pytest.raises(UserError, match="pipeline: mlx-lm has none"):
        distributed.choose(model, 2, "pipeline")


def test_pipeline_takes_over_where_tensor_parallel_does_not_fit():
    model = tiny.make_model("qwen2", num_hidden_layers=3)
    assert distributed.strategies(model) == ["tensor", "pipeline"]
    assert distributed.choose(model, 2) == "tensor"
    assert distributed.choose(model, 3) == "pipeline"  # 4 heads do not divide over 3
    assert distributed.choose(model, 2, "pipeline") == "pipeline"
    with pytest.raises(UserError, match="3 layers are fewer than 4 ranks"):
        distributed.choose(model, 4, "pipeline")


def test_refuses_a_model_with_neither_strategy():
    model = tiny.make_model("gemma3_text")
    with pytest.raises(UserError, match="neither tensor parallel .* nor pipeline"):
        distributed.choose(model, 2)


def test_no_launch_is_one_process_unless_a_strategy_is_forced(monkeypatch, tiny_model_dir):
    for name in distributed.LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    assert distributed.start("auto") is None
    assert distributed.start("off") is None
    with pytest.raises(UserError, match="unknown --distributed mode"):
        distributed.start("rings")
    result = runner.invoke(app, ["chat", "-m", str(tiny_model_dir), "--distributed", "tensor"])
    assert_one_line_error(result, 2, "runs under mlx.launch")


# ------------------------------------------------------------- real ranks (slow)


def compare_stream_run(n: int, folder: Path, text: Path, *extra: str) -> None:
    args = ["stream-run", str(text), "-m", str(folder), *SMALL, "--json"]
    args += ["--prompt", "the sea", "--max-tokens", "24", *GREEDY]
    one = single(*args)
    result = launch(n, *args, *extra)
    assert not errors(result), result.stderr
    sharded = last_json(result)
    assert sharded["tokens"] == one["tokens"] > 16 * 10  # many wraps of the window
    assert sharded["perplexity"] == pytest.approx(one["perplexity"], rel=1e-4)
    assert sharded["answer"] == one["answer"] and sharded["answer"]
    assert len([line for line in result.stdout.splitlines() if line.startswith("{")]) == 1


@pytest.mark.slow
def test_tensor_parallel_stream_run_equals_one_process(shard_models, shard_text):
    compare_stream_run(2, shard_models["llama"], shard_text)


@pytest.mark.slow
def test_pipeline_stream_run_equals_one_process(shard_models, shard_text):
    """Each rank runs 2 of the 4 layers; the sink cache's build-time model check runs
    its probe passes through the pipeline in step on both ranks."""
    compare_stream_run(2, shard_models["qwen2"], shard_text, "--distributed", "pipeline")


@pytest.mark.slow
def test_chat_replies_equal_one_process_and_refuses_save(shard_models):
    # mlx.launch never passes on the end of its input: /quit ends the ranks
    lines = "hello the sea\n/save here\nwhale ship captain\n/quit\n"
    args = ["chat", "-m", str(shard_models["llama"]), *SMALL, "--max-tokens", "30", *GREEDY]
    one = runner.invoke(app, args, input="hello the sea\nwhale ship captain\n")
    assert one.exit_code == 0, one.stderr
    result = launch(2, *args, "--distributed", "tensor", input=lines)
    assert result.stdout == one.stdout
    assert errors(result) == ["Error: /save is not available with --distributed (each rank holds part of the cache)"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("model", "mode"), [("llama", "tensor"), ("qwen2", "pipeline")])
def test_profile_each_rank_holds_half_the_cache(shard_models, model, mode):
    args = ["profile", "-m", str(shard_models[model]), *SMALL, "--tokens", "40", "--json"]
    one = single(*args)
    result = launch(2, *args, "--distributed", mode)
    assert not errors(result), result.stderr
    report = last_json(result)["distributed"]
    assert report["strategy"] == mode
    whole = one["kv_cache_mb"]["end"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:  # half the KV heads (tensor) or half the layers (pipeline)
        assert r["kv_cache_mb"] == pytest.approx(whole / 2, abs=1e-3)
        assert 0 < r["weights_mb"]
    assert 0 < report["collective_share"]


@pytest.mark.real_model
@pytest.mark.slow
def test_default_model_tensor_parallel_over_three_ranks(real_model_path, tmp_path):
    """9 heads and 3 KV heads over 3 ranks: the same greedy answer and perplexity,
    64 tokens through a 16-token window (3 wraps). Each token costs 60 collectives
    over loopback, slow on a loaded machine: few tokens, ranks started by hand."""
    text = DATA / "alice_in_wonderland.txt"
    args = ["stream-run", str(text), "-m", str(real_model_path), "--window", "16"]
    args += ["--sinks", "4", "--limit-tokens", "64", "--json", "--prompt", "Who is Alice?"]
    args += ["--max-tokens", "12", *GREEDY]
    one = single(*args)
    procs = start_ranks(3, args, tmp_path)
    try:
        out, err = procs[0].communicate(timeout=REAL_MODEL_TIMEOUT)
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        stop_ranks(procs)
    assert procs[0].returncode == 0, err.decode()
    sharded = json.loads(out.decode().strip().splitlines()[-1])
    assert sharded["tokens"] == one["tokens"] == 63
    assert sharded["perplexity"] == pytest.approx(one["perplexity"], rel=1e-4)
    assert sharded["answer"] == one["answer"] and sharded["answer"]


def test_benchmark_quick_one_rank_and_skips_what_does_not_divide(
    shard_models, tmp_path, capsys, monkeypatch
):
    from tests.support.bench import load_script

    bench = load_script("distributed", monkeypatch)
    out = tmp_path / "d.jsonl"
    records = bench.main(["--quick", "--model", str(shard_models["llama"]), "--ranks", "1,3",
                          "--out", str(out)])  # fmt: skip
    assert "skipping 3 ranks: cannot shard llama over 3 ranks" in capsys.readouterr().err
    *rows, summary = records
    assert {r["cache"] for r in rows} == {"sink", "rotating"}
    for r in rows:
        assert r["ranks"] == 1 and r["tok_s"] > 0 and r["per_rank"][0]["weights_mb"] > 0
    assert summary["ranks"] == [1] and summary["sink_over_rotating_tok_s_1"] > 0
    assert len(out.read_text().splitlines()) == 3
    sys.modules.pop("tables", None)
    import tables  # benchmarks/tables.py, on the path load_script set

    assert "| 1 | - | sink |" in tables.distributed_tables(tables.read(out))
