"""``mlx-stream profile`` on the tiny model: JSON summary, --compare of caches and of
reclaim schedules, CSV rows, PNG plot, bad input; flat memory on the real model."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests import tiny as tiny_mod
from tests.support.cli import assert_one_line_error

runner = CliRunner()
BASE = ["--window", "24", "--sinks", "4"]
SUMMARY_KEYS = ("tokens", "reclaims", "active_memory_mb", "cache_memory_mb", "peak_memory_mb",
                "tokens_per_second")  # fmt: skip


def profile(*args: str):
    return runner.invoke(app, ["profile", *args])


def profile_json(*args: str):
    result = profile(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return tiny_mod.save_model_folder(tmp_path_factory.mktemp("draft") / "draft", seed=1)


def test_json_summary_and_flat_memory_with_the_sink_cache(tiny_model_dir):
    data = profile_json("-m", str(tiny_model_dir), *BASE, "--tokens", "300", "--every", "64")
    for key in SUMMARY_KEYS:
        assert key in data, key
    assert data["tokens"] == 300  # end-of-sequence does not cut a profile short
    assert set(data["active_memory_mb"]) >= {"start", "end", "max"}
    assert set(data["cache_memory_mb"]) >= {"max", "end"}
    assert data["reclaims"] == 300 // 64
    active = data["active_memory_mb"]
    assert active["end"] <= active["max"] <= active["start"] * 1.05


def test_compare_runs_sink_full_and_rotating(tiny_model_dir):
    runs = profile_json("-m", str(tiny_model_dir), *BASE, "--tokens", "300", "--compare")
    assert [r["cache"] for r in runs] == ["sink", "full", "rotating"]
    kv = {r["cache"]: r["kv_cache_mb"] for r in runs}
    # mlx-lm's KVCache grows in 256-token steps; the sink cache never grows.
    assert kv["full"]["end"] > kv["full"]["start"]
    assert kv["sink"]["end"] == kv["sink"]["start"]
    assert kv["full"]["end"] > 3 * kv["sink"]["end"]  # 512 slots vs 4 + 24
    assert kv["rotating"]["end"] < kv["full"]["end"]


def test_draft_model_compare_runs_the_schedules(tiny_model_dir, draft_dir):
    runs = profile_json(
        "-m", str(tiny_model_dir), *BASE, "--draft-model", str(draft_dir),
        "--num-draft-tokens", "3", "--tokens", "120", "--every", "8", "--compare",
    )  # fmt: skip
    assert [r["schedule"] for r in runs] == ["crossing", "exact", "none"]
    reclaims = {r["schedule"]: r["reclaims"] for r in runs}
    # Speculative rounds jump several tokens: n % 8 == 0 misses multiples, crossing doesn't.
    assert reclaims["none"] == 0
    assert reclaims["crossing"] >= 120 // 8
    assert reclaims["exact"] < reclaims["crossing"]


def test_table_and_terminal_chart(tiny_model_dir):
    result = profile("-m", str(tiny_model_dir), *BASE, "--tokens", "60", "--cache", "full",
                     "--schedule", "exact")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "full/exact" in result.stdout
    assert "active memory against tokens" in result.stdout
    assert any(ch in result.stdout for ch in "▁▂▃▄▅▆▇█")


def test_csv_has_a_row_per_step_and_setting(tiny_model_dir, tmp_path):
    out = tmp_path / "steps.csv"
    profile_json("-m", str(tiny_model_dir), *BASE, "--tokens", "50", "--compare", "--csv", str(out))
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 150
    assert {r["setting"] for r in rows} == {"sink/crossing", "full/crossing", "rotating/crossing"}
    assert {"step", "tokens", "latency_ms", "active_memory_mb", "cache_memory_mb",
            "peak_memory_mb", "reclaims"} <= set(rows[0])  # fmt: skip
    assert [int(r["tokens"]) for r in rows[:50]] == list(range(1, 51))


def test_plot_writes_a_png(tiny_model_dir, tmp_path):
    out = tmp_path / "memory.png"
    result = profile("-m", str(tiny_model_dir), *BASE, "--tokens", "40", "--compare", "--plot", str(out))  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["memory.png"]


def test_plot_without_matplotlib_is_one_line(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = profile("-m", str(tiny_model_dir), "--plot", str(tmp_path / "x.png"))
    assert_one_line_error(result, 2, "matplotlib")


def test_prompt_from_a_file(tiny_model_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the old man and the sea\n")
    data = profile_json(
        "-m", str(tiny_model_dir), "--file", str(prompt), "--tokens", "20", "--dtype", "float32"
    )
    other = profile_json("-m", str(tiny_model_dir), "--prompt", "the old man and the sea\n",
                         "--tokens", "20")  # fmt: skip
    assert data["tokens"] == other["tokens"] == 20


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tokens", "0"], ["--tokens"]),
        (["--every", "0"], ["--every"]),
        (["--window", "0"], ["--window"]),
        (["--sinks", "-2"], ["--sinks"]),
        (["--cache", "paged"], ["--cache", "sink"]),
        (["--schedule", "sometimes"], ["--schedule", "crossing"]),
        (["--file", "/no/such/prompt.txt"], ["no such file"]),
        (["--prompt", "x", "--file", "y"], ["not both"]),
        (["--csv", "/no/such/dir/x.csv"], ["does not exist"]),
        (["--plot", "/no/such/dir/x.png"], ["does not exist"]),
        (["-m", "nope-model"], ["nope-model"]),
    ],
)
def test_bad_options(tiny_model_dir, args, words):
    model = [] if "-m" in args else ["-m", str(tiny_model_dir)]
    assert_one_line_error(profile(*model, *args), 2, *words)


def test_prompt_file_that_is_a_directory_or_binary(tiny_model_dir, tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\x01\x02")
    for path, word in ((tmp_path, "is a directory"), (binary, "binary")):
        result = profile("-m", str(tiny_model_dir), "--file", str(path))
        assert_one_line_error(result, 2, word)


# ------------------------------------------------------------------------ real model


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_active_memory_stays_flat(real_model_path, tmp_path):
    """Past the window, the sink cache keeps memory flat. Run as the real command (a
    subprocess), so MLX gets the optimized BLAS preloaded; 120 tokens keep it short on
    a 2-core machine without one while the 24-token window wraps four times."""
    out = tmp_path / "steps.csv"
    proc = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "profile", "-m",
         str(real_model_path), "--tokens", "120", "--window", "24", "--json", "--csv", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    active = data["active_memory_mb"]
    assert data["tokens"] == 120
    assert active["end"] == pytest.approx(active["max"], rel=0.02)
    kv = {float(r["kv_cache_mb"]) for r in csv.DictReader(out.open())}
    assert len(kv) == 1  # the KV buffers never grow


# ----- issue 13 -------------------------------------------------------------------


def test_outputs_naming_the_prompt_file_are_refused(tiny_model_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the sea and the ship")
    for flag in ("--csv", "--plot"):
        result = profile("-m", str(tiny_model_dir), "--file", str(prompt), flag, str(prompt))
        assert_one_line_error(result, 2, flag, "same file as --file")
    assert prompt.read_text() == "the sea and the ship"


def test_estimate_in_the_summary_and_impossible_window(tiny_model_dir):
    data = profile_json("-m", str(tiny_model_dir), *BASE, "--tokens", "20")
    estimate = data["estimate"]
    # tiny llama: 2 layers x 2 kv heads x 16 dims x 4 bytes, keys + values, 4+24 slots
    # (no slack without a draft, spare sinks are columns of a call, not slots), plus the
    # float copy of the 4 sink keys.
    slots = 4 + 24
    assert estimate["kv_cache_bytes"] == 2 * (2 * 2 * 16 * 4 * slots + 2 * 4 * 16 * 4)
    assert estimate["total_bytes"] == estimate["weights_bytes"] + estimate["kv_cache_bytes"]
    result = profile("-m", str(tiny_model_dir), "--window", "1000000000", "--tokens", "5")
    assert_one_line_error(result, 2, "needs", "available", "--window")


def test_matplotlib_hint_is_the_documented_command():
    from cli.profile import PLOT_INSTALL
    from tests.support.paths import REPO

    assert PLOT_INSTALL in (REPO / "docs" / "cli.md").read_text()
