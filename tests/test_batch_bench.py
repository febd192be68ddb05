"""benchmarks/batch.py runs end to end on the tiny model (``--quick``) and renders its
README table."""

from tests.support.bench import load_script, run


def test_batch_benchmark(monkeypatch, tmp_path, tiny_model_dir):
    *rows, summary = run("batch", monkeypatch, tmp_path, tiny_model_dir)
    assert {(r["engine"], r["sessions"]) for r in rows} == {
        (e, b) for e in ("mlx-stream", "mlx-lm") for b in (1, 2)
    }
    for r in rows:
        assert r["tok_s"] > 0 and r["p90_ms"] >= r["p50_ms"] > 0 and r["kv_mb_per_session"] > 0
    assert summary["summary"] and summary["ours_scaling"] > 0
    text = load_script("batch", monkeypatch).table(rows)
    assert text.count("\n") == 3 and "| 2 |" in text
