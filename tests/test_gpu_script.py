"""benchmarks/gpu: the packing of the device calls round-trips and names what is missing,
and the prepared GPU run works end to end on MLX's CPU backend (``--dry-run --tiny``),
writing JSON lines with the fields the README's tables read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
import pack  # noqa: E402


def test_parts_fill_each_call_and_join_back_checked(tmp_path):
    files = []
    for name, size in (("big.bin", 5 << 20), ("small.whl", 300_000), ("mid.tar.xz", 2 << 20)):
        files.append(tmp_path / name)
        files[-1].write_bytes(os.urandom(size))
    manifest = pack.pack(files, budget=3 << 20, out=tmp_path / "carry")
    assert manifest["calls"] == 3
    for i in range(1, 4):
        assert sum(f.stat().st_size for f in (tmp_path / f"carry/call{i}").iterdir()) <= 3 << 20
    stash = tmp_path / "stash"
    stash.mkdir()
    for part in (tmp_path / "carry").glob("call[12]/*"):
        (stash / part.name).write_bytes(part.read_bytes())
    problems = pack.join(stash, tmp_path / "files")
    assert problems and all("call 3" in p for p in problems)  # the missing call is named
    for part in (tmp_path / "carry/call3").iterdir():
        (stash / part.name).write_bytes(part.read_bytes())
    assert pack.join(stash, tmp_path / "files") == []
    for f in files:
        assert (tmp_path / "files" / f.name).read_bytes() == f.read_bytes()
    (stash / "big.bin.part1").write_bytes(b"changed")
    assert pack.join(stash, tmp_path / "again") == ["big.bin: big.bin.part1 changed (sha256)"]


@pytest.mark.slow
def test_the_dry_run_writes_the_figures_of_each_part(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               MLX_STREAM_GPU_STASH=str(tmp_path / "stash"),
               MLX_STREAM_GPU_PHASES="exactness,decode-windows,soak")  # fmt: skip
    # Without benchmarks/gpu/carry (CI) the join and install are skipped; with it, checked.
    run = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/run.sh"), "part2", "--dry-run", "--tiny"],
        env=env, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    out = tmp_path / "out"

    def lines(name):
        return [json.loads(line) for line in (out / name).read_text().splitlines()]

    phases = {p["phase"]: p for p in lines("phases.jsonl")}
    assert set(phases) == {"exactness", "decode-windows", "soak"}
    assert all(p["rc"] == 0 for p in phases.values()), phases
    exact = lines("exactness.jsonl")
    checks = [r for r in exact if not r.get("summary")]
    assert {r["check"] for r in checks} == {"kvcache", "speculative", "recall"}
    assert all(r["passed"] and r["device"].startswith("Device(cpu") for r in checks)
    assert {"model", "dtype", "seconds", "mlx", "mlx_lm"} <= set(checks[0])
    assert exact[-1]["summary"] and exact[-1]["failed"] == []
    windows = [r for r in lines("decode_windows.jsonl") if not r.get("summary")]
    assert {r["cache"] for r in windows} == {"sink", "sink-8", "sink-4", "rotating"}
    assert all(r["tok_s"] > 0 for r in windows)
    soak = [r for r in lines("soak.jsonl") if not r.get("summary")]
    assert soak and {"active_mb", "pool_mb", "tokens"} <= set(soak[0])
