"""One vocabulary for bytes (issue 37, items 7 and 8): ``stream-run --recall`` reports
its recall tier (``--json``'s ``recall`` object and a line of the text summary), and
what is reserved is never printed as what is used (tiny model)."""

from __future__ import annotations

import json

from tests import test_recall_cli as recall_cli

BASE = recall_cli.BASE
text_file = recall_cli.text_file  # the fixture: 500 random words of the tiny vocabulary
stream_run = recall_cli.run  # stream-run through typer's CliRunner

RECALL = ["--recall", "--recall-blocks", "2", "--recall-ram", "0"]


def test_stream_run_json_has_a_recall_object(tiny_model_dir, text_file, tmp_path):
    args = [str(text_file), "-m", str(tiny_model_dir), *BASE, "--json"]
    plain = stream_run(*args)
    assert plain.exit_code == 0, plain.stderr
    assert "recall" not in json.loads(plain.stdout)
    result = stream_run(*args, *RECALL, "--recall-dir", str(tmp_path / "store"))
    assert result.exit_code == 0, result.stderr
    recall = json.loads(result.stdout)["recall"]
    # 499 tokens through a 32-token window, blocks of 64: 6 stored by the last call, 2 recalled
    assert recall["stored_blocks"] == 6 and recall["recalled_blocks"] == 2
    assert 0 < recall["scored_blocks"] <= 6 and recall["refresh_seconds"] > 0
    # --recall-ram 0: the blocks and their index on disk, the blocks reserved 32 at a time
    assert 0 < recall["disk_bytes"] < recall["disk_reserved_bytes"]
    assert recall["disk_bytes"] == recall["block_bytes"] + recall["index_bytes"]
    assert recall["ram_bytes"] == recall["ram_reserved_bytes"] == 0
    assert 0 < recall["index_bytes"] < recall["block_bytes"] / 10
    assert recall["reserved_bytes"] == recall["ram_reserved_bytes"] + recall["disk_reserved_bytes"]
    assert recall["region_bytes"] > 0
    on_disk = sum(p.stat().st_size for p in (tmp_path / "store").glob("*.npy"))
    assert on_disk >= recall["disk_reserved_bytes"]  # the files hold the room reserved


def test_stream_run_text_summary_has_a_recall_line(tiny_model_dir, text_file, tmp_path):
    args = [str(text_file), "-m", str(tiny_model_dir), *BASE]
    result = stream_run(*args, *RECALL, "--recall-dir", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("recall "))
    assert line.startswith("recall 6 blocks stored, 2 recalled, 5 scored (")  # by the last refresh
    assert " s choosing) · store " in line and ", index 0.0 MB of it · region " in line
    assert " MB used of " in line and "reserved (RAM) + " in line and "reserved (disk)" in line
    assert line.endswith("reserved (device)")
    assert not any(x.startswith("recall ") for x in stream_run(*args).stdout.splitlines())
