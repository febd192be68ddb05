"""``benchmarks/forget.py`` runs end to end on the tiny model (``--quick``) and renders
its JSON lines as the README's tables."""

from __future__ import annotations

import json

from tests.support.bench import ENVIRONMENT_KEYS, assert_finite, load_script


def test_forget_quick_and_table(monkeypatch, tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "forget.jsonl"
    script = load_script("forget", monkeypatch)
    returned = script.main(["--quick", "--model", str(tiny_model_dir), "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == json.loads(json.dumps(returned))
    for line in lines:
        assert_finite(line)
        assert ENVIRONMENT_KEYS <= set(line)
    div = [r for r in lines if r["bench"] == "forget-divergence"]
    rec = [r for r in lines if r["bench"] == "forget-recall"]
    assert [(r["window"], r["sinks"]) for r in div] == [(32, 0), (32, 4)]
    assert all(r["tokens"] == 159 and r["evicted_tokens"] > 0 for r in div)
    assert [r["placement"] for r in rec] == ["inside", "just_outside", "far_outside", "system"]
    capsys.readouterr()
    script.main(["--table", str(out)])
    table = capsys.readouterr().out
    assert "| botchan | 159 | 32 | 4 | cache | float |" in table
    assert "| 32 | far_outside |" in table
