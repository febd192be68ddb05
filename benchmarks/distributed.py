"""Sharded decode on loopback ranks: mlx-stream vs mlx-lm on the same sharded model.

For each rank count (default 1, 2 and 3; a count the model's heads do not divide is
skipped with a line saying so) this script starts the ranks with
``mlx.launch --backend ring --hosts 127.0.0.1 -n N`` and runs itself inside them
(``--worker``). Every rank loads the model through mlx-stream's loader with
``distributed.shard`` cutting its part while the weights are lazy (one rank: no cut),
prefills ``--context`` tokens of Moby-Dick and decodes ``--tokens`` greedy tokens with

- ``sink``: mlx-stream's ``generate_step`` on ``make_sink_cache(model, sinks, window)``;
- ``rotating``: mlx-lm's ``generate_step`` on ``RotatingKVCache(max_size=sinks+window,
  keep=sinks)`` per layer: mlx-lm's own generation on the same sharded model,

alternating ``--repeats`` times. Rank 0 prints one JSON line per (ranks, cache): decode
tok/s, prefill tok/s, and per rank the weights, the KV cache and MLX's peak memory
(gathered with ``all_gather``). A summary line gives sink/rotating tok/s per rank count
and each count's tok/s against one rank.

On one machine the ranks share its cores and talk over loopback: this measures the
overhead of sharding, not a speed-up. What sharding buys is the per-rank memory.

    python benchmarks/distributed.py --by-hand --context 128 --tokens 8   # the recorded run
    python benchmarks/distributed.py --ranks 1,3 --tokens 32             # under mlx.launch
    python benchmarks/distributed.py --by-hand --ranks 1,2 --strategy pipeline -m DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

CACHES = ("sink", "rotating")
SCRIPT = Path(__file__).resolve()
WORKER_TIMEOUT = 900


def make_cache(name: str, model, sinks: int, window: int) -> list:
    from mlx_lm.models.cache import RotatingKVCache

    from mlx_stream.cache.sink import make_sink_cache

    if name == "sink":
        return make_sink_cache(model, sinks, window)
    return [RotatingKVCache(max_size=sinks + window, keep=sinks) for _ in model.layers]


def run_once(name: str, model, prompt: list[int], tokens: int, sinks: int, window: int) -> dict:
    """Prefill ``prompt`` and decode ``tokens`` tokens; times and the cache's bytes."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step as mlx_lm_step
    from mlx_lm.sample_utils import make_sampler

    from mlx_stream.generate.decode import generate_step

    cache = make_cache(name, model, sinks, window)
    step = generate_step if name == "sink" else mlx_lm_step
    start = time.perf_counter()
    stamps = []
    for _step, _ in zip(
        step(mx.array(prompt), model, prompt_cache=cache, sampler=make_sampler(0.0)),
        range(tokens + 1),
        strict=False,
    ):
        stamps.append(time.perf_counter())
    intervals = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    kv = sum(int(c.nbytes) for c in cache)
    return {"ttft": stamps[0] - start, "intervals": intervals, "kv_bytes": kv}


def worker(args) -> None:
    """One rank: load, shard, run both caches; rank 0 prints the JSON lines."""
    import mlx.core as mx

    from mlx_stream import distributed
    from mlx_stream.models import loader

    cluster = distributed.start(args.strategy) if distributed.launched() else None
    model, tokenizer, info = loader.load(
        args.model, dtype=args.dtype, return_info=True, prepare=distributed.preparer(cluster)
    )
    prompt = common.book_tokens(tokenizer, args.context)
    runs: dict[str, list[dict]] = {name: [] for name in CACHES}
    for name in common.interleave(CACHES, args.repeats):
        runs[name].append(run_once(name, model, prompt, args.tokens, args.sinks, args.window))
    weights = distributed.weight_bytes(model)
    size = 1 if cluster is None else cluster.size
    for name, results in runs.items():
        intervals = [x for r in results for x in r["intervals"]]
        mine = [weights / 1e6, results[-1]["kv_bytes"] / 1e6, mx.get_peak_memory() / 1e6]
        rows = [mine] if cluster is None else cluster.gather(mine)
        record = dict(
            common.base_record("distributed", args.model, info.weights),
            cache=name,
            ranks=size,
            strategy=None if cluster is None else cluster.strategy,
            context=len(prompt),
            sinks=args.sinks,
            window=args.window,
            decode_tokens=len(intervals),
            tok_s=round(len(intervals) / sum(intervals), 2),
            run_tok_s=[round(len(r["intervals"]) / sum(r["intervals"]), 2) for r in results],
            p50_ms=round(1e3 * common.percentile(intervals, 50), 2),
            prefill_tps=round(len(prompt) / min(r["ttft"] for r in results), 1),
            per_rank=[
                {"rank": i, "weights_mb": round(w, 2), "kv_mb": round(k, 3), "peak_mb": round(p, 1)}
                for i, (w, k, p) in enumerate(rows)
            ],
        )
        if cluster is None or cluster.is_root:
            print(json.dumps(record), flush=True)


def by_hand(ranks: int, command: list[str]) -> tuple[str, str]:
    """Start ``command`` on ``ranks`` loopback ranks as mlx.launch would (a hostfile and
    ``MLX_RANK``) but without its I/O threads, which poll busily; rank 0's output."""
    from mlx_stream.distributed import loopback_envs

    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                stderr=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            for r, env in enumerate(loopback_envs(ranks, Path(tmp)))
        ]
        try:
            out, err = procs[0].communicate(timeout=WORKER_TIMEOUT)
            for p in procs[1:]:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    return out, err


def launch(ranks: int, argv: list[str], hand: bool = False) -> list[dict]:
    """This script's worker on ``ranks`` loopback ranks; rank 0's JSON lines."""
    command = [sys.executable, str(SCRIPT), "--worker", *argv]
    if ranks > 1 and hand:
        stdout, stderr = by_hand(ranks, command)
        return _records(ranks, stdout, stderr)
    if ranks > 1:
        from mlx_stream.distributed import loopback_launch

        command = loopback_launch(ranks, [str(SCRIPT), "--worker", *argv])
    # stdin stays open and empty: at end of input mlx.launch spins on it
    with subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            proc.wait(timeout=WORKER_TIMEOUT)  # rank 0 prints a few lines only
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.stdout.read(), proc.stderr.read()
    return _records(ranks, stdout, stderr)


def _records(ranks: int, stdout: str, stderr: str) -> list[dict]:
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if not records:
        errors = [line for line in stderr.splitlines() if "Error" in line]
        raise SystemExit(f"{ranks} ranks: {errors[-1] if errors else stderr[-500:]}")
    return records


def divides(model: str, ranks: int, strategy: str = "auto") -> str | None:
    """Why ``model`` cannot be sharded over ``ranks`` (None: it can)."""
    if ranks == 1:
        return None
    from mlx_lm.utils import load_model

    from mlx_stream import distributed
    from mlx_stream.errors import UserError
    from mlx_stream.models import loader

    folder, _ = loader.resolve(model)
    lazy, _ = load_model(folder, lazy=True, strict=False)
    try:
        distributed.choose(lazy, ranks, strategy)
    except UserError as e:
        return str(e)
    return None


def summarize(records: list[dict]) -> dict:
    at = {(r["cache"], r["ranks"]): r for r in records}
    counts = sorted({r["ranks"] for r in records})
    summary = dict(records[0], summary=True, ranks=counts)
    for key in ("cache", "strategy", "run_tok_s", "p50_ms", "prefill_tps", "per_rank", "tok_s"):
        summary.pop(key, None)
    for n in counts:
        if ("sink", n) in at and ("rotating", n) in at:
            ratio = at["sink", n]["tok_s"] / at["rotating", n]["tok_s"]
            summary[f"sink_over_rotating_tok_s_{n}"] = round(ratio, 3)
        for cache in CACHES:
            if (cache, n) in at and (cache, 1) in at:
                ratio = at[cache, n]["tok_s"] / at[cache, 1]["tok_s"]
                summary[f"{cache}_tok_s_{n}_over_1"] = round(ratio, 3)
        if ("sink", n) in at:
            summary[f"weights_mb_per_rank_{n}"] = max(
                r["weights_mb"] for r in at["sink", n]["per_rank"]
            )
    return summary


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,3", help="comma-separated rank counts")
    parser.add_argument("--context", type=int, default=512, help="tokens prefilled")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cache")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument(
        "--strategy", default="auto", choices=("auto", "tensor", "pipeline"),
        help="how to shard: auto (tensor parallel where it fits, else pipeline)",
    )  # fmt: skip
    parser.add_argument(
        "--by-hand",
        action="store_true",
        help="start the ranks without mlx.launch (its I/O threads poll busily, which "
        "takes a small machine's cores from the ranks)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.context, args.tokens, args.repeats, args.window = 48, 8, 1, 16
    if args.worker:
        worker(args)
        return []
    passed = ["--model", args.model, "--dtype", args.dtype, "--context", str(args.context),
              "--tokens", str(args.tokens), "--repeats", str(args.repeats),
              "--sinks", str(args.sinks), "--window", str(args.window),
              "--strategy", args.strategy]  # fmt: skip
    records = []
    for ranks in (int(n) for n in args.ranks.split(",")):
        reason = divides(args.model, ranks, args.strategy)
        if reason is not None:
            print(f"skipping {ranks} ranks: {reason}", file=sys.stderr, flush=True)
            continue
        for record in launch(ranks, passed, args.by_hand):
            records.append(common.emit(record, args.out))
    if not records:
        raise SystemExit(f"no rank count in --ranks {args.ranks} can shard {args.model}")
    records.append(common.emit(summarize(records), args.out))
    return records


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    common.main_guard(main)
