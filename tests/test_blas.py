"""The optional OpenBLAS preload (``mlx_stream.blas``).

A preload must precede the first ``import mlx.core`` and cannot be undone, so the
tests that compare BLAS libraries run fresh interpreters.
"""

import ctypes.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mlx_stream import blas
from tests.support.paths import REAL_HOME

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
needs_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux") or blas.find_openblas() is None,
    reason="no OpenBLAS installed (apt-get install libopenblas0-pthread)",
)


@pytest.fixture
def unloaded(monkeypatch):
    """This process as one that has preloaded nothing yet (undone after the test)."""
    monkeypatch.setattr(blas, "_loaded", None)
    monkeypatch.setattr(blas, "_status", None)


# Preloads (or not), then prints the preload state, the BLAS serving MLX, and saves the
# last-position logits of `model` on `tokens` to `out`.
CHILD = """
import json, sys
from mlx_stream import blas
state = blas.preload()
import mlx.core as mx
import numpy as np
result = {"state": state.state, "active": blas.active_blas()}
if len(sys.argv) > 1:
    from mlx_stream.models.loader import load
    model, _ = load(sys.argv[1], dtype="float32")
    tokens = mx.array(json.loads(sys.argv[2]))[None]
    np.save(sys.argv[3], np.array(model(tokens).astype(mx.float32)))
print(json.dumps(result))
"""


def run_child(setting: str, *args: str) -> dict:
    env = dict(os.environ, MLX_STREAM_BLAS=setting)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@linux_only
def test_off_is_a_no_op():
    result = run_child("off")
    assert result["state"] == "off"
    assert "openblas" not in (result["active"] or "")


def test_not_found_does_nothing_and_says_so(monkeypatch, unloaded):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "_candidates", lambda: [])
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    monkeypatch.setenv(blas.ENV, "auto")
    status = blas.preload()
    assert status.state == "not-found" and not status.loaded
    assert "libopenblas0-pthread" in status.detail
    assert blas.status() is status
    assert blas.loaded_openblas() is None


def test_missing_explicit_path_is_not_found(monkeypatch, tmp_path, unloaded, capsys):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv(blas.ENV, str(tmp_path / "libopenblas.so.0"))
    status = blas.preload(force=True)
    assert status.state == "not-found" and "does not exist" in status.detail
    # asked for by path, it is not silently replaced: one line says so
    assert capsys.readouterr().err.count("does not exist; using MLX's own BLAS") == 1


def test_an_explicit_library_that_cannot_load_says_why(monkeypatch, tmp_path, unloaded, capsys):
    monkeypatch.setattr(sys, "platform", "linux")
    broken = tmp_path / "libopenblas.so.0"
    broken.write_bytes(b"not a shared object")  # as one missing its libgfortran fails
    monkeypatch.setenv(blas.ENV, str(broken))
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)  # as before MLX loads
    status = blas.preload(force=True)
    assert status.state == "failed" and not status.loaded
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mlx-stream: {blas.ENV}: cannot load {broken}")


def test_late_preload_is_reported(monkeypatch, unloaded):
    import mlx.core  # noqa: F401 - the test process has imported MLX already

    monkeypatch.setenv(blas.ENV, "auto")
    status = blas.preload(force=True)
    assert status.state in ("late", "not-found", "not-linux")
    assert not status.loaded


def compare_logits(tmp_path, model_dir, tokens, tolerance):
    """Logits agree to ``tolerance`` times their largest magnitude (float32 sums in
    another order), and so do nearly all argmaxes."""
    ids = json.dumps(tokens)
    off = run_child("off", str(model_dir), ids, str(tmp_path / "off.npy"))
    on = run_child("auto", str(model_dir), ids, str(tmp_path / "on.npy"))
    assert off["state"] == "off" and "openblas" not in off["active"]
    assert on["state"] == "loaded" and "openblas" in on["active"]
    reference, optimized = np.load(tmp_path / "off.npy"), np.load(tmp_path / "on.npy")
    scale = float(np.abs(reference).max())
    np.testing.assert_allclose(optimized, reference, rtol=0, atol=tolerance * scale)
    assert (optimized.argmax(-1) == reference.argmax(-1)).mean() > 0.95


@needs_openblas
def test_openblas_gives_the_same_logits(tmp_path, tiny_model_dir):
    from tests import tiny

    compare_logits(tmp_path, tiny_model_dir, tiny.random_tokens(48), 1e-4)


@needs_openblas
@pytest.mark.real_model
@pytest.mark.slow
def test_openblas_gives_the_same_logits_on_the_default_model(tmp_path, monkeypatch):
    if REAL_HOME:
        monkeypatch.setenv("MLX_STREAM_HOME", REAL_HOME)
    else:
        monkeypatch.delenv("MLX_STREAM_HOME")
    from mlx_stream.models import loader

    if not loader.is_pulled():
        pytest.skip("default model not pulled (mlx-stream models pull)")
    tokens = list(range(100, 164))
    compare_logits(tmp_path, loader.model_path(), tokens, 1e-4)


def test_doctor_reports_blas_and_model():
    import typer
    from typer.testing import CliRunner

    from cli.doctor import doctor

    app = typer.Typer()
    app.command()(doctor)
    result = CliRunner().invoke(app, ["--no-speed", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {"mlx", "mlx_lm", "device", "blas", "blas_preload", "default_model_pulled"} <= set(
        report
    )
    assert report["default_model_pulled"] is False  # the tests' home is empty


def test_doctor_hints_at_the_debian_package():
    from cli.doctor import hints

    report = {"device": "Device(cpu, 0)", "blas_preload": "not-found", "mlx_over_numpy": 0.04}
    lines = hints(report)
    assert any("libopenblas0-pthread" in line for line in lines)
    assert any("4%" in line for line in lines)
