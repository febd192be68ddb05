"""``mlx-stream doctor``: what this install runs on, and how fast.

Prints the versions (mlx-stream, mlx, mlx-lm, Python), MLX's device, which BLAS serves
MLX's CPU matmuls (read from ``/proc/self/maps`` on Linux), a float32 matmul's GFLOP/s
against numpy's in the same run, whether the default model is pulled, and the MLX
models found in the Hugging Face cache and LM Studio's folder. A hint follows each
finding that has a fix.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .common import handle_errors

# A float32 matmul slower than this fraction of numpy's means a reference BLAS.
SLOW_FRACTION = 0.5
MATMUL_N = 1024


def _matmul_gflops(n: int, seconds: float) -> tuple[float, float]:
    """float32 ``n x n`` matmul GFLOP/s of MLX and of numpy, back to back."""
    import time

    import mlx.core as mx
    import numpy as np

    a = mx.random.normal((n, n), key=mx.random.key(0))
    an = np.array(a)

    def rate(fn) -> float:
        fn()
        reps, tic = 0, time.perf_counter()
        while reps < 2 or time.perf_counter() - tic < seconds:
            fn()
            reps += 1
        return 2 * n**3 * reps / (time.perf_counter() - tic) / 1e9

    return rate(lambda: mx.eval(a @ a)), rate(lambda: an @ an)


def collect(speed: bool = True) -> dict:
    """Every finding of the doctor, as a dict (also the ``--json`` output)."""
    from mlx_stream import blas

    status = blas.preload()  # before mlx.core, in case nothing imported it yet
    import os
    import platform
    from importlib.metadata import version

    import mlx.core as mx

    from mlx_stream import __version__
    from mlx_stream.models import loader, registry

    active = blas.active_blas()
    report = {
        "mlx_stream": __version__,
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus",
        "device": str(mx.default_device()),
        "metal": bool(mx.metal.is_available()),
        "blas_preload": status.state,
        "blas_detail": status.detail,
        "blas": active,
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
    }
    if speed:
        mlx_rate, numpy_rate = _matmul_gflops(MATMUL_N, 0.5)
        report.update(
            matmul_n=MATMUL_N,
            mlx_gflops=round(mlx_rate, 1),
            numpy_gflops=round(numpy_rate, 1),
            mlx_over_numpy=round(mlx_rate / numpy_rate, 2),
        )
    try:
        report["default_model"] = registry.get(None).name
        report["default_model_pulled"] = loader.is_pulled()
        report["default_model_path"] = str(loader.model_path())
    except Exception as e:  # a broken models.yaml is a finding, not a crash
        report["default_model_error"] = " ".join(str(e).split())
    from mlx_stream.models import hub

    report["hf_cache"] = str(hub.hf_cache_dir())
    report["hf_cache_models"] = len(hub.scan_hf_cache())
    report["lmstudio_models_dir"] = str(hub.lmstudio_models_dir())
    report["lmstudio_models"] = len(hub.scan_lmstudio())
    return report


def hints(report: dict) -> list[str]:
    """One line per finding that has a fix."""
    out = []
    cpu = "cpu" in report["device"]
    if cpu and report["blas_preload"] == "not-found":
        out.append(
            "MLX uses a reference BLAS: `apt-get install libopenblas0-pthread` (Debian/"
            "Ubuntu) makes float32 prefill ~20x faster"
        )
    if report["blas_preload"] == "late":
        out.append("mlx was imported before mlx_stream, so OpenBLAS could not be preloaded")
    if cpu and report.get("mlx_over_numpy", 1.0) < SLOW_FRACTION:
        out.append(
            f"MLX's matmul runs at {report['mlx_over_numpy']:.0%} of numpy's: "
            "check the BLAS line above"
        )
    if report.get("default_model_pulled") is False:
        out.append("the default model is not pulled: `mlx-stream models pull`")
    return out


@handle_errors
def doctor(
    speed: Annotated[
        bool, typer.Option("--speed/--no-speed", help="Measure matmul GFLOP/s (~2 s).")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Check the install: versions, device, BLAS, matmul speed, default model."""
    report = collect(speed)
    if as_json:
        typer.echo(json.dumps(report))
        return
    lines = [
        ("mlx-stream", report["mlx_stream"]),
        ("mlx / mlx-lm", f"{report['mlx']} / {report['mlx_lm']}"),
        ("python", f"{report['python']} on {report['platform']}"),
        ("device", report["device"] + ("  (Metal available)" if report["metal"] else "")),
        ("blas", f"{report['blas'] or 'platform default'}"),
        ("blas preload", f"{report['blas_preload']}: {report['blas_detail']}"),
    ]
    if "mlx_gflops" in report:
        lines.append(
            (
                "fp32 matmul",
                f"MLX {report['mlx_gflops']} GFLOP/s, numpy {report['numpy_gflops']} GFLOP/s "
                f"({report['mlx_over_numpy']:.0%}; {report['matmul_n']}x{report['matmul_n']})",
            )
        )
    if "default_model" in report:
        where = "pulled" if report["default_model_pulled"] else "not pulled"
        lines.append(
            (
                "default model",
                f"{report['default_model']}: {where} ({report['default_model_path']})",
            )
        )
    else:
        lines.append(("default model", f"error: {report['default_model_error']}"))
    for name, folder, count in (("hf cache", "hf_cache", "hf_cache_models"),
                                ("lm studio", "lmstudio_models_dir", "lmstudio_models")):  # fmt: skip
        n = report[count]
        lines.append((name, f"{report[folder]}: {n} MLX model{'' if n == 1 else 's'}"))
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        typer.echo(f"{name:<{width}}  {value}")
    for hint in hints(report):
        typer.echo(f"hint: {hint}")
