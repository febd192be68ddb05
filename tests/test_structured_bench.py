"""benchmarks/structured.py runs end to end on a tiny model (``--quick``): the
constrained rows write JSON of the benchmark's schema."""

from tests.support.bench import run


def test_structured_benchmark(monkeypatch, tmp_path, tiny_bpe_model_dir):
    *rows, summary = run("structured", monkeypatch, tmp_path, tiny_bpe_model_dir)
    assert {(r["mode"], r["sessions"]) for r in rows} == {
        (m, b) for m in ("plain", "schema") for b in (1, 2)
    }
    for r in rows:
        assert r["tok_s"] > 0 and r["p50_ms"] > 0
    for r in rows:
        if r["mode"] == "schema":
            assert r["sample"].startswith("[") and r["mask_ms_per_row"] > 0
    assert summary["summary"] and set(summary["schema_over_plain"]) == {"1", "2"}
