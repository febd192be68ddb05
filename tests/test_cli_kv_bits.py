"""--kv-bits / --kv-group-size on chat, stream-run and profile (tiny model, head_dim 32)."""

import json
import math

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests import tiny
from tests.support.cli import assert_one_line_error

runner = CliRunner()
SIZES = ["--sinks", "4", "--window", "32"]
KV = ["--kv-bits", "4", "--kv-group-size", "32"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv") / "tiny-hd32"
    return str(tiny.save_model_folder(folder, num_attention_heads=2, num_key_value_heads=1))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    words = (tiny.VOCAB_WORDS * 8)[:300]
    path = tmp_path_factory.mktemp("kvtext") / "t.txt"
    path.write_text(" ".join(words) + "\n")
    return str(path)


def test_stream_run_quantized_cache(model_dir, text_file):
    floats = runner.invoke(app, ["stream-run", text_file, "-m", model_dir, *SIZES, "--json"])
    quant = runner.invoke(app, ["stream-run", text_file, "-m", model_dir, *SIZES, *KV, "--json"])
    assert floats.exit_code == 0 and quant.exit_code == 0, quant.stderr
    a, b = json.loads(floats.stdout), json.loads(quant.stdout)
    assert a["tokens"] == b["tokens"] and math.isfinite(b["perplexity"])
    assert b["perplexity"] != a["perplexity"]  # the cache really was quantized


def test_profile_quantized_cache_is_smaller(model_dir):
    # Window 448: 4-bit keys keep a float residual of 64 tokens, a large share of a
    # 32-token window's cache but not of this one's (448 + slack 32 fills their groups).
    args = ["profile", "-m", model_dir, "--sinks", "4", "--window", "448", "--tokens", "60",
            "--json"]  # fmt: skip
    floats = json.loads(runner.invoke(app, args).stdout)
    quant = runner.invoke(app, [*args, *KV])
    assert quant.exit_code == 0, quant.stderr
    assert json.loads(quant.stdout)["kv_cache_mb"]["end"] < floats["kv_cache_mb"]["end"] / 3


@pytest.mark.parametrize("extra", [[], ["--kv-key-bits", "8"]])
def test_chat_quantized_cache_replies(model_dir, extra):
    args = ["chat", "-m", model_dir, *SIZES, *KV, *extra, "--max-tokens", "8", "--temp", "0"]
    result = runner.invoke(app, args, input="hi there\nthe sea\n")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip()


@pytest.mark.parametrize(
    "args, words",
    [(["--kv-bits", "3"], "--kv-bits must be 4 or 8"),
     (["--kv-bits", "8", "--kv-group-size", "48"], "--kv-group-size must be"),
     (["--kv-key-bits", "8"], "--kv-key-bits must be 4 or 8, with --kv-bits")],
)  # fmt: skip
def test_bad_kv_bits_is_one_line(model_dir, args, words):
    assert_one_line_error(runner.invoke(app, ["profile", "-m", model_dir, *args]), 2, words)


def test_group_size_not_dividing_head_dim_is_one_line(tiny_model_dir, text_file):
    result = runner.invoke(
        app, ["stream-run", text_file, "-m", str(tiny_model_dir), *SIZES, *KV]
    )  # head_dim 16: bad input, found before the cache is built (exit 2, not 1)
    assert_one_line_error(
        result, 2, "--kv-group-size", "does not divide the model's head dimension"
    )
