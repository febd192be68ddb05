"""Benchmark scripts run as modules, on the tiny model: their JSON lines read back
and checked for finite figures."""

import importlib.util
import json
import math
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ENVIRONMENT_KEYS = {"mlx", "mlx_lm", "device", "blas", "machine"}


def load_script(name: str, monkeypatch):
    """Import ``benchmarks/<name>.py`` as a module (it imports ``common`` beside it)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name, monkeypatch, tmp_path, model_dir, *extra) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    args = ["--quick", "--model", str(model_dir), "--out", str(out), *extra]
    returned = load_script(name, monkeypatch).main(args)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines and lines == json.loads(json.dumps(returned))
    for line in lines:
        assert_finite(line)
    return lines


def assert_finite(value, where="record"):
    if isinstance(value, dict):
        for k, v in value.items():
            assert_finite(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            assert_finite(v, f"{where}[{i}]")
    elif isinstance(value, float):
        assert math.isfinite(value), f"{where} = {value}"
