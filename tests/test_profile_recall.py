"""``profile --recall``: the store's host-memory and disk parts apart from the flat
device bytes (tiny model)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


def test_profile_splits_the_store_into_host_memory_and_disk(tiny_model_dir, tmp_path):
    args = ["profile", "-m", str(tiny_model_dir), "--prompt", "the sea and the ship",
            "--tokens", "200", "--window", "32", "--sinks", "4", "--recall",
            "--recall-blocks", "2", "--recall-ram", "0", "--recall-dir", str(tmp_path)]  # fmt: skip
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    ram, disk = data["recall_store_ram_mb"], data["recall_store_disk_mb"]
    used = data["recall_store_disk_used_mb"]
    # --recall-ram 0: every block and its summaries on disk, nothing in RAM.
    assert ram["end"] == 0 and 0 < used["end"] <= disk["end"]
    assert data["recall_store_mb"]["end"] == round(ram["end"] + disk["end"], 3)
    assert data["recall_store_used_mb"]["end"] <= data["recall_store_mb"]["end"]
    # 200 tokens past a 32 window, in blocks of 64: 2 stored (reserved: 32 a segment)
    assert data["recall_stored_blocks"]["end"] == 2 and used["end"] < disk["end"] / 10
    assert data["recall_device_mb"]["end"] > 0  # allocated once, at the first selection
    assert data["kv_cache_mb"]["start"] == data["kv_cache_mb"]["end"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.stderr
    line = next(x for x in table.stdout.splitlines() if "recall store" in x)
    assert "recall region" in line and "reserved (device)" in line
    assert f"recall store 2 blocks ({data['recall_recalled_blocks']['end']} recalled): " in line
    assert "MB used of " in line and "MB reserved (disk)" in line
    assert data["recall_stored_tokens"]["end"] == 2 * 64
    per_1k = used["end"] * 1000 / (2 * 64)  # MB of disk per 1k stored tokens
    want = f"recall store per 1k stored tokens: 0.0 MB RAM + {per_1k:.1f} MB disk"
    assert want in table.stdout
