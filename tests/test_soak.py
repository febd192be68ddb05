"""benchmarks/soak.py runs end to end on the tiny model: JSON lines written as it goes,
bounded offsets, a summary, and a plot redrawn from the saved lines."""

import json
import math

import pytest

from tests.test_benchmarks_smoke import assert_finite, load_script


def test_soak_quick(monkeypatch, tmp_path, tiny_model_dir):
    soak = load_script("soak", monkeypatch)
    out, png = tmp_path / "soak.jsonl", tmp_path / "soak.png"
    args = ["--quick", "--model", str(tiny_model_dir), "--out", str(out), "--plot", str(png)]
    returned = soak.main([*args, "--tokens", "1500", "--sample", "256", "--plot-every", "2"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == json.loads(json.dumps(returned))
    *samples, summary = lines
    assert [r["tokens"] for r in samples] == [257, 513, 769, 1025, 1281, 1500]
    assert summary["summary"] and summary["tokens"] == 1500
    for r in samples:
        assert_finite(r)
        assert 0 <= r["offset"] < r["max_offset"] and r["segment_ppl"] > 1
        assert r["pool_max_mb"] >= r["pool_mb"]
    # The segments' perplexities recombine into the running one.
    scored = sum(r["segment_tokens"] for r in samples)
    mean_nll = sum(r["segment_tokens"] * math.log(r["segment_ppl"]) for r in samples) / scored
    assert mean_nll == pytest.approx(math.log(samples[-1]["running_ppl"]), rel=1e-3)
    assert summary["offset_max"] < summary["max_offset"]
    assert png.stat().st_size > 0
    png.unlink()
    again = soak.main(["--replot", str(out), "--plot", str(png)])
    assert again == samples and png.stat().st_size > 0
