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
    assert ram["end"] == 0 and disk["end"] > 0  # --recall-ram 0: every block on disk
    assert disk["end"] <= data["recall_store_mb"]["end"]  # the rest: block summaries
    assert data["recall_device_mb"]["end"] > 0  # allocated once, at the first selection
    assert data["kv_cache_mb"]["start"] == data["kv_cache_mb"]["end"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "0.0 MB host memory +" in table.stdout
