"""MLX float32 matmul and model prefill/decode speed with and without an optimized BLAS.

The ``mlx[cpu]`` wheel on Linux links netlib's reference BLAS; ``mlx_stream.blas``
preloads a system OpenBLAS before MLX is imported. A preload cannot be undone in a
process, so every configuration runs in its own subprocess (``MLX_STREAM_BLAS=off`` vs
the default), interleaved (off, on, off, on). Each child measures numpy's matmul in the
same run as the reference, then the model's prefill and decode through mlx-stream's
``generate_step`` on a sink cache.

    python benchmarks/blas.py                      # default model, 2 rounds
    python benchmarks/blas.py --threads 1,2        # also vary OPENBLAS_NUM_THREADS
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import common

SCRIPT = Path(__file__).resolve()


def matmul_gflops(n: int, seconds: float = 1.0) -> dict:
    """float32 ``n x n`` matmul GFLOP/s of MLX and numpy, measured back to back."""
    import mlx.core as mx
    import numpy as np

    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    an, bn = np.array(a), np.array(b)

    def rate(fn) -> float:
        fn()  # warm-up
        reps, elapsed = 0, 0.0
        while elapsed < seconds or reps < 2:
            elapsed += common.timed(fn)
            reps += 1
        return 2 * n**3 * reps / elapsed / 1e9

    mlx_rate = rate(lambda: mx.eval(a @ b))
    numpy_rate = rate(lambda: an @ bn)
    error = float(np.abs(np.array(a @ b) - an @ bn).max())
    return {
        "matmul_n": n,
        "mlx_gflops": round(mlx_rate, 2),
        "numpy_gflops": round(numpy_rate, 2),
        "mlx_over_numpy": round(mlx_rate / numpy_rate, 3),
        "max_abs_diff": error,
    }


def model_speed(name: str, dtype: str, prompt_tokens: int, decode_tokens: int) -> dict:
    """Prefill and decode tokens/s of mlx-stream's ``generate_step`` on a sink cache."""
    from mlx_stream.cache.sink import make_sink_cache
    from mlx_stream.generate.decode import DecodeState, generate_step

    model, tokenizer, weights = common.load_model(name, dtype)
    prompt = common.book_tokens(tokenizer, prompt_tokens)
    # Warm-up (first-call costs), then one measured run on a fresh cache.
    for _ in generate_step(prompt[:16], model, make_sink_cache(model), max_tokens=2):
        pass
    state = DecodeState()
    cache = make_sink_cache(model, slack=512)
    tic = None
    for i, _ in enumerate(
        generate_step(prompt, model, cache, max_tokens=decode_tokens, state=state)
    ):
        if i == 0:
            tic = time.perf_counter()
    decode_s = time.perf_counter() - tic
    return {
        "weights": weights,
        "prompt_tokens": len(prompt),
        "prefill_tps": round(len(prompt) / state.prompt_time, 2),
        "decode_tokens": decode_tokens,
        "decode_tps": round((decode_tokens - 1) / decode_s, 2),
    }


def child(args) -> None:
    """Measure in this process (the BLAS was chosen by the parent's environment)."""
    record = {"config": args.config}
    record.update(common.environment())
    record["blas_state"] = common.blas.status().state
    record["openblas_threads"] = os.environ.get("OPENBLAS_NUM_THREADS")
    record.update(matmul_gflops(args.n))
    if args.model != "none":
        record["model"] = common.model_label(args.model)
        record.update(model_speed(args.model, args.dtype, args.prompt, args.decode))
    print(json.dumps(record), flush=True)


def configurations(threads: str | None) -> list[tuple[str, dict]]:
    """``(name, extra environment)`` per configuration: netlib, then OpenBLAS."""
    configs = [("netlib", {"MLX_STREAM_BLAS": "off"}), ("openblas", {"MLX_STREAM_BLAS": "auto"})]
    for t in (threads or "").split(","):
        if t.strip():
            env = {"MLX_STREAM_BLAS": "auto", "OPENBLAS_NUM_THREADS": t.strip()}
            configs.append((f"openblas-{t.strip()}t", env))
    return configs


def run_child(args, name: str, extra: dict) -> dict:
    """One configuration in a fresh interpreter; returns its JSON record."""
    env = dict(os.environ, **extra)
    cmd = [sys.executable, str(SCRIPT), "--child", "--config", name, "--model", args.model]
    cmd += ["--dtype", args.dtype, "--n", str(args.n)]
    cmd += ["--prompt", str(args.prompt), "--decode", str(args.decode)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(records: list[dict]) -> dict:
    """Per-configuration medians and OpenBLAS / netlib speed-ups."""
    import numpy as np

    keys = ("mlx_gflops", "numpy_gflops", "mlx_over_numpy", "prefill_tps", "decode_tps")
    by = {}
    for r in records:
        by.setdefault(r["config"], []).append(r)
    medians = {
        name: {k: round(float(np.median([r[k] for r in rs])), 3) for k in keys if k in rs[0]}
        for name, rs in by.items()
    }
    summary = {"summary": True, "configs": medians}
    base = medians.get("netlib", {})
    for name, m in medians.items():
        for k in ("mlx_gflops", "prefill_tps", "decode_tps"):
            if name != "netlib" and k in m and base.get(k):
                summary[f"{name}_{k}_speedup"] = round(m[k] / base[k], 2)
    return summary


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024, help="matmul size (default: 1024)")
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens (default: 512)")
    parser.add_argument("--decode", type=int, default=64, help="decode tokens (default: 64)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of off/on (default: 2)")
    parser.add_argument("--threads", help="also run OpenBLAS with these thread counts: 1,2")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", default="this", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.prompt, args.decode, args.repeats = 256, 32, 8, 1
    if args.child:
        child(args)
        return []
    records = []
    for name, extra in common.interleave(configurations(args.threads), args.repeats):
        records.append(common.emit(run_child(args, name, extra), args.out))
    records.append(common.emit(summarize(records), args.out))
    return records


if __name__ == "__main__":
    main()
