"""Helpers shared by the benchmark scripts: options, environment, output, timing.

Every script prints one JSON line per configuration (``emit``), each carrying the
model, the mlx / mlx-lm versions, the device, the BLAS serving MLX and the machine
(``environment``), and runs its competitor in the same process so machine noise hits
both alike. Importing this module preloads an optimized BLAS (``mlx_stream.blas``)
before MLX is imported, unless ``MLX_STREAM_BLAS=off``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from mlx_stream import blas

blas.preload()  # must run before the first `import mlx.core`

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DEFAULT_MODEL = "smollm2-135m-instruct"
ENV_DATA = "MLX_STREAM_DATA"
DATA = REPO / "benchmarks" / "data"


def data_dir() -> Path:
    """The folder of evaluation texts: ``$MLX_STREAM_DATA``, else the public-domain
    books this repository carries in ``benchmarks/data`` (see its MANIFEST.json)."""
    return Path(os.environ.get(ENV_DATA, DATA))


# Set for the processes a benchmark starts (ranks, children, which also take --child or
# --worker): only the script run by hand takes the default --out.
ENV_DEFAULT_OUT = "MLX_STREAM_BENCH_DEFAULT_OUT"


class _BenchParser(argparse.ArgumentParser):
    """Run as a script (``python benchmarks/NAME.py``) without ``--out`` or ``--quick``,
    a benchmark appends its JSON lines to ``results/NAME/<UTC time>.jsonl``: a new file
    per run in the benchmark's folder, beside the runs benchmarks/README.md cites.
    Imported (the tests) or with ``--quick``, it only prints, as before."""

    script: Path | None = None

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if (
            getattr(parsed, "out", True) is None
            and not any(getattr(parsed, flag, False) for flag in ("quick", "child", "worker"))
            and self.script is not None
            and ENV_DEFAULT_OUT not in os.environ
        ):
            stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
            parsed.out = RESULTS / self.script.stem / f"{stamp}.jsonl"
            os.environ[ENV_DEFAULT_OUT] = str(parsed.out)
            print(f"appending to {parsed.out.relative_to(REPO)}", file=sys.stderr)
        return parsed, rest


def _script_run_by_hand() -> Path | None:
    """The benchmark script that called base_parser, when it is the one run as __main__."""
    caller = Path(inspect.currentframe().f_back.f_back.f_code.co_filename).resolve()
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main and Path(main).resolve() == caller and caller.parent == REPO / "benchmarks":
        return caller
    return None


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark shares."""
    parser = _BenchParser(description=description)
    parser.script = _script_run_by_hand()
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="registry name, mlx-lm folder or .gguf file (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16, quantized"
    )
    parser.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    parser.add_argument(
        "--out",
        type=Path,
        help="also append the JSON lines to this file (default, run by hand: "
        "benchmarks/results/<benchmark>/<UTC time>.jsonl)",
    )
    return parser


def package_version(name: str) -> str | None:
    """The installed version of ``name``, or ``None``."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment() -> dict:
    """Versions, device, BLAS and machine, for every JSON line."""
    active = blas.active_blas()
    return {
        "mlx": mx.__version__,
        "mlx_lm": package_version("mlx-lm"),
        "mlx_stream": package_version("mlx-stream"),
        "device": str(mx.default_device()),
        "blas": os.path.basename(active) if active else None,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus",
        "python": platform.python_version(),
    }


def base_record(bench: str, model: str, weights: str, **fields) -> dict:
    """The fields every JSON line of a run starts with: environment, bench, model."""
    return dict(environment(), bench=bench, model=model_label(model), weights=weights, **fields)


def emit(record: dict, out: Path | None = None) -> dict:
    """Print ``record`` as one JSON line (and append it to ``out``)."""
    line = json.dumps(record, default=_jsonable)
    print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")
    return record


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def load_model(name: str, dtype: str = "auto"):
    """``(model, tokenizer, weights)`` through mlx-stream's loader (registry names,
    mlx-lm folders and GGUF files); ``weights`` says what the weights are now."""
    from mlx_stream.models import loader

    model, tokenizer, info = loader.load(name, dtype=dtype, return_info=True)
    return model, tokenizer, info.weights


def model_label(name: str) -> str:
    """A short model name for the JSON lines (a folder's base name)."""
    return Path(name).name if os.sep in name else name


def book_tokens(tokenizer, n: int, book: str = "moby_dick") -> list[int]:
    """The first ``n`` tokens of ``book`` (``<data>/<book>.txt``), or fewer if it is
    shorter; only as much text as needed is tokenized."""
    text = (data_dir() / f"{book}.txt").read_text(encoding="utf-8")
    chars = max(8 * n, 4096)
    while True:
        tokens = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(tokens) >= n or chars >= len(text):
            return tokens[:n]
        chars *= 2


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (``nan`` when empty)."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def memory_mb() -> dict:
    """MLX active, peak and pool (cache) memory in MB."""
    return {
        "active_mb": round(mx.get_active_memory() / 1e6, 2),
        "peak_mb": round(mx.get_peak_memory() / 1e6, 2),
        "pool_mb": round(mx.get_cache_memory() / 1e6, 2),
    }


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took."""
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def interleave(names: Sequence[str], repeats: int) -> list[str]:
    """``A, B, A, B, ...``: run order that spreads machine noise over all contenders."""
    return [name for _ in range(repeats) for name in names]


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` (folders made) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    pyplot().close(fig)


def saved_records(
    parser: argparse.ArgumentParser, paths: Sequence[Path], usable: Callable[[dict], bool]
) -> list[dict]:
    """The usable records of saved JSON-lines files, for ``--replot``; a missing,
    unreadable or empty input is a one-line usage error, not a traceback."""
    from tables import read  # the JSON-lines reader tables.py renders from

    records = []
    for path in paths:
        if not path.is_file():
            parser.error(f"{path}: no such file")
        try:
            records += [r for r in read(path) if usable(r)]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            parser.error(f"{path}: not JSON lines ({e})")
    if not records:
        parser.error(f"nothing to plot in {', '.join(str(p) for p in paths)}")
    return records


def main_guard(main: Callable[[list[str] | None], object]) -> None:
    """Run ``main(sys.argv[1:])`` as a script."""
    main(sys.argv[1:])
