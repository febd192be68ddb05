"""benchmarks/soak.py runs end to end on the tiny model: JSON lines written as it goes,
bounded offsets, a summary, and a plot redrawn from the saved lines."""

import json
import math

import pytest

from tests.support.bench import assert_finite, load_script


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


def test_soak_in_legs_equals_one_run(monkeypatch, tmp_path, tiny_model_dir):
    """A soak stopped by SIGTERM and run again with the same command resumes from its
    checkpoint: its lines continue the first leg's and equal one uninterrupted run's."""
    import os
    import signal

    soak = load_script("soak", monkeypatch)
    args = ["--quick", "--model", str(tiny_model_dir), "--tokens", "1500", "--sample", "256"]
    whole = tmp_path / "whole.jsonl"
    soak.main([*args, "--out", str(whole)])
    expected = [json.loads(line) for line in whole.read_text().splitlines()][:-1]

    out, ckpt = tmp_path / "legs.jsonl", tmp_path / "soak.safetensors"
    legs = [*args, "--out", str(out), "--checkpoint", str(ckpt)]
    sample = soak.Sampler.__call__

    def stop_after_600(self, position, perplexity, last=False):
        sample(self, position, perplexity, last)
        if position > 600:
            os.kill(os.getpid(), signal.SIGTERM)  # a polite kill mid-run

    monkeypatch.setattr(soak.Sampler, "__call__", stop_after_600)
    first = soak.main(legs)
    assert [r["tokens"] for r in first] == [257, 513] and ckpt.exists()
    monkeypatch.setattr(soak.Sampler, "__call__", sample)
    soak.main(legs)
    *lines, summary = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["leg"] for r in lines] == [1, 1, 2, 2, 2, 2]
    assert len({r["run"] for r in lines}) == 1
    assert [r["tokens"] for r in lines] == [r["tokens"] for r in expected]
    assert [r["offset"] for r in lines] == [r["offset"] for r in expected]
    for got, want in zip(lines, expected, strict=True):
        assert got["segment_ppl"] == pytest.approx(want["segment_ppl"], rel=1e-4)
        assert got["running_ppl"] == pytest.approx(want["running_ppl"], rel=1e-4)
    assert summary["summary"] and summary["tokens"] == 1500 and summary["samples"] == 6


@pytest.mark.parametrize("later", [10.0, 12.0])
def test_by_book_compares_the_same_text_a_pass_later(monkeypatch, later):
    """Book a (1,000 tokens) then b (500), read twice in 100-token segments: a's second
    pass is scored against its first on the same text, whatever the misalignment."""
    soak = load_script("soak", monkeypatch)
    lengths = [("a", 1000, 1000), ("b", 500, 500)]
    ppl = lambda lo: 20.0 if 1000 <= lo % 1500 < 1500 else (10.0 if lo < 1500 else later)  # noqa: E731
    records = [{"tokens": t + 100, "segment_tokens": 100, "segment_ppl": ppl(t)}
               for t in range(0, 2500, 100)]  # fmt: skip
    out = soak.by_book(records, lengths)
    assert out["a"]["median_by_pass"] == [10.0, later]
    assert out["a"]["same_text_ratio"] == pytest.approx(later / 10.0)
    assert out["a"]["same_text_segments"] == 10
    assert out["b"]["median_by_pass"] == [20.0]  # its second pass (2500-3000) is not read
    assert out["b"]["same_text_ratio"] is None
    # 100-token segments straddling the book boundary (1450-1550) belong to no book
    shifted = [dict(r, tokens=r["tokens"] + 50) for r in records]
    assert soak.by_book(shifted, lengths)["a"]["same_text_segments"] == 9
