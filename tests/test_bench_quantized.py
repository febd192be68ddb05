"""Smoke test of benchmarks/quantized.py on a tiny model (head_dim 32 for group 32)."""

import math
import sys

from tests import tiny
from tests.support.paths import REPO


def test_quantized_benchmark_quick(tmp_path, monkeypatch):
    folder = tiny.save_model_folder(tmp_path / "tiny", num_attention_heads=2, num_key_value_heads=1)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("quantized", None)
    import quantized

    records = quantized.main(
        ["--model", str(folder), "--quick", "--out", str(tmp_path / "q.jsonl")]
    )
    assert [r["config"] for r in records] == [c[0] for c in quantized.configurations(32)]
    float_row, eight, four, mixed = records[:4]
    assert all(
        math.isfinite(r["perplexity"]) and r["decode_tokens_per_second"] > 0 for r in records
    )
    # Window 32 (quick): per-channel keys' float residual (64 tokens) and slack (32
    # slots) outweigh the window itself (8-bit: more bytes than the float cache); at the
    # README's windows they are smaller.
    assert four["cache_bytes_per_token"] < eight["cache_bytes_per_token"]
    assert four["cache_bytes_per_token"] < float_row["cache_bytes_per_token"]
    assert len((tmp_path / "q.jsonl").read_text().splitlines()) == len(records) + 1
    # tables.py renders the saved file (records and the summary line) as a table
    sys.modules.pop("tables", None)
    import tables

    saved = tables.read(tmp_path / "q.jsonl")
    rendered = tables.quantized_tables(saved)
    assert "| 8-bit | 32 |" in rendered and "tokens scored" in rendered


def test_quantized_benchmark_decode_only(tmp_path, monkeypatch):
    folder = tiny.save_model_folder(tmp_path / "tiny", num_attention_heads=2, num_key_value_heads=1)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("quantized", None)
    import quantized

    records = quantized.main(["--model", str(folder), "--quick", "--decode-only"])
    assert all(r["perplexity"] is None and r["decode_tokens_per_second"] > 0 for r in records)
    assert records[0]["decode_ratio_vs_float"] == 1.0
