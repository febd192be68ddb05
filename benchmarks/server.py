"""``mlx-stream serve`` against ``mlx_lm.server``: the same multi-turn chat workload.

``--clients`` clients each hold a ``--turns``-turn conversation behind one long shared
system prompt (``--system-tokens`` tokens of Paradise Lost), resending the whole message
list every turn as OpenAI clients do, and stream each reply (``--max-tokens`` tokens,
greedy). Measured per server: requests/s, p50/p95 time to first token and request
latency, and, sampled every 0.5 s inside the server process, its resident memory (RSS)
and MLX active memory. Both servers run the same weights (float32, as mlx-stream loads
them on a CPU; mlx-lm's loader is wrapped to dequantize the same way) and the same
BLAS, one after the other on the same machine. One JSON line per server, a summary line
with the ratios, and a plot of memory over time (``--plot``).

    python benchmarks/server.py --turns 20 --plot benchmarks/results/server/server.png \
        --out benchmarks/results/server/server.jsonl   # 4 clients x 20 turns
    python benchmarks/server.py --quick         # a smoke test
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import common

SERVERS = ("mlx-stream", "mlx-lm")
# The head of every server process a benchmark starts: preload OpenBLAS (by importing
# mlx_stream; a process of another venv, "vllm-mlx", has it in LD_PRELOAD), then sample
# its RSS and MLX active memory to a file every 0.5 s.
SAMPLER = r"""
import os, sys, threading, time
samples, kind, args = sys.argv[1], sys.argv[2], sys.argv[3:]
if kind != "vllm-mlx":
    import mlx_stream  # noqa: F401 - preloads the optimized BLAS before mlx.core
import mlx.core as mx

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0

def sample():
    with open(samples, "a") as f:
        while True:
            f.write(f"{time.time()} {rss()} {mx.get_active_memory()}\n")
            f.flush()
            time.sleep(0.5)

threading.Thread(target=sample, daemon=True).start()
"""
# Then start the server; mlx-lm's loader is wrapped to dequantize like mlx-stream.
WRAPPER = SAMPLER + r"""
if kind == "mlx-lm":
    import mlx_lm.server as server
    from mlx_stream.models.loader import apply_dtype
    plain = server.load
    def load(*a, **k):
        out = plain(*a, **k)
        apply_dtype(out[0], "float32")
        return out
    server.load = load
    sys.argv = ["mlx_lm.server", *args]
    server.main()
else:
    from cli.main import main
    sys.argv = ["mlx-stream", "serve", *args]
    main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: str, port: int, samples: Path, args) -> subprocess.Popen:
    if kind == "mlx-lm":
        flags = ["--model", model, "--port", str(port), "--log-level", "WARNING",
                 "--max-tokens", str(args.max_tokens)]  # fmt: skip
    else:
        flags = ["-m", model, "--port", str(port), "--sinks", str(args.sinks),
                 "--window", str(args.window), "--max-tokens", str(args.max_tokens)]  # fmt: skip
    cmd = [sys.executable, "-c", WRAPPER, str(samples), kind, *flags]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(common.REPO))
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{kind} server did not start in 180 s")


def texts(tokenizer, args) -> tuple[str, list[list[str]]]:
    """The shared system prompt and each client's user messages (book passages)."""
    tokens = common.book_tokens(tokenizer, args.system_tokens, "paradise_lost")
    system = "You are a helpful reader. The text you know:\n" + tokenizer.decode(tokens)
    words = (common.data_dir() / "moby_dick.txt").read_text(encoding="utf-8").split()
    per = args.message_words
    users = [
        [" ".join(words[(c * args.turns + t) * per : (c * args.turns + t + 1) * per])
         + "\nWhat happens next?" for t in range(args.turns)]
        for c in range(args.clients)
    ]  # fmt: skip
    return system, users


def client(base: str, model: str, system: str, messages: list[str], args, out: list) -> None:
    """One conversation: stream each turn, resend the whole history."""
    import openai  # imported before the clock starts (see main)

    api = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    history = [{"role": "system", "content": system}]
    for text in messages:
        history.append({"role": "user", "content": text})
        tic = time.perf_counter()
        first, parts, usage = None, [], None
        try:
            stream = api.chat.completions.create(
                model=model, messages=history, max_tokens=args.max_tokens, temperature=0.0,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        first = first or time.perf_counter()
                        parts.append(choice.delta.content)
        except openai.APIError as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            history.pop()
            continue
        done = time.perf_counter()
        history.append({"role": "assistant", "content": "".join(parts)})
        out.append(
            {
                "ttft_s": (first or done) - tic,
                "latency_s": done - tic,
                "completion_tokens": usage.completion_tokens if usage else None,
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "cached_tokens": getattr(usage.prompt_tokens_details, "cached_tokens", None)
                if usage and usage.prompt_tokens_details
                else None,
            }
        )


def workload(kind: str, port: int, system: str, users, args) -> tuple[list, float, float]:
    """Every client's conversation at once; returns (per-request results, wall s, start)."""
    if kind == "mlx-lm":
        model_id = "default_model"  # mlx_lm.server's name for its --model
    else:
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))
        model_id = models["data"][0]["id"]
    results: list[dict] = []
    base = f"http://127.0.0.1:{port}/v1"
    threads = [
        threading.Thread(target=client, args=(base, model_id, system, users[c], args, results))
        for c in range(args.clients)
    ]
    tic = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.time() - tic, tic


def run_server(kind: str, model_path: str, system: str, users, args) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        samples = Path(tmp) / "memory.txt"
        proc = start(kind, model_path, port, samples, args)
        try:
            results, wall, tic = workload(kind, port, system, users, args)
            time.sleep(1.0)  # one more memory sample after the last reply
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        series = [tuple(map(float, line.split())) for line in samples.read_text().splitlines()]
    ok = [r for r in results if "error" not in r]
    series = [(t - tic, rss, active) for t, rss, active in series if t >= tic - 1]
    rss = [s[1] / 1e6 for s in series]
    active = [s[2] / 1e6 for s in series]
    gen = sum(r["completion_tokens"] or 0 for r in ok)
    return {
        "server": kind,
        "requests": len(ok),
        "errors": [r["error"] for r in results if "error" in r][:5],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 4),
        "completion_tok_s": round(gen / wall, 2),
        "ttft_p50_s": round(common.percentile([r["ttft_s"] for r in ok], 50), 3),
        "ttft_p95_s": round(common.percentile([r["ttft_s"] for r in ok], 95), 3),
        "latency_p50_s": round(common.percentile([r["latency_s"] for r in ok], 50), 3),
        "latency_p95_s": round(common.percentile([r["latency_s"] for r in ok], 95), 3),
        "last_prompt_tokens": max((r["prompt_tokens"] or 0 for r in ok), default=0),
        "cached_tokens_total": sum(r["cached_tokens"] or 0 for r in ok),
        "rss_mb_first": round(rss[0], 1) if rss else None,
        "rss_mb_last": round(rss[-1], 1) if rss else None,
        "rss_mb_max": round(max(rss), 1) if rss else None,
        "active_mb_first": round(active[0], 1) if active else None,
        "active_mb_last": round(active[-1], 1) if active else None,
        "active_mb_max": round(max(active), 1) if active else None,
        "series": [[round(t, 2), round(r / 1e6, 1), round(a / 1e6, 1)] for t, r, a in series],
    }


def plot(
    records: list[dict],
    path: Path,
    xlabel: str = "seconds into the workload",
    title: str = "Same multi-turn workload: mlx-stream serve vs mlx_lm.server",
) -> None:
    """Each record's ``series`` of (seconds, RSS MB, MLX active MB): two panels."""
    plt = common.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in records:
        t = [s[0] for s in r["series"]]
        top.plot(t, [s[1] for s in r["series"]], label=r["server"])
        bottom.plot(t, [s[2] for s in r["series"]], label=r["server"])
    top.set_ylabel("server RSS (MB)")
    bottom.set_ylabel("MLX active memory (MB)")
    bottom.set_xlabel(xlabel)
    top.set_title(title)
    top.legend()
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--message-words", type=int, default=40)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--plot", type=Path, help="save a PNG of memory over time")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.turns, args.max_tokens, args.system_tokens = 2, 2, 6, 60
    import openai  # noqa: F401 - the clients' first import must not count as serving time

    from mlx_stream.models import loader

    folder = Path(args.model)
    model_path = str(folder if folder.is_dir() else loader.model_path(args.model))
    tokenizer = common.load_model(model_path)[1]
    system, users = texts(tokenizer, args)
    records = []
    for kind in args.servers.split(","):
        record = common.base_record(
            "server", model_path, "float32", clients=args.clients, turns=args.turns,
            max_tokens=args.max_tokens, system_tokens=args.system_tokens,
            sinks=args.sinks, window=args.window,
            **run_server(kind, model_path, system, users, args),
        )  # fmt: skip
        records.append(common.emit(record, args.out))
    by = {r["server"]: r for r in records}
    if set(SERVERS) <= set(by):
        ours, theirs = by["mlx-stream"], by["mlx-lm"]
        summary = {"bench": "server", "summary": True}
        for key in ("requests_per_s", "completion_tok_s"):
            summary[f"{key}_ratio"] = round(ours[key] / max(theirs[key], 1e-9), 3)
        for key in ("ttft_p50_s", "ttft_p95_s", "latency_p50_s", "latency_p95_s"):
            summary[f"{key}_ratio"] = round(ours[key] / max(theirs[key], 1e-9), 3)
        for r in (ours, theirs):
            summary[f"{r['server']}_rss_growth_mb"] = round(r["rss_mb_last"] - r["rss_mb_first"], 1)
            summary[f"{r['server']}_active_growth_mb"] = round(
                r["active_mb_last"] - r["active_mb_first"], 1
            )
        records.append(common.emit(summary, args.out))
    if args.plot:
        plot([r for r in records if "series" in r], args.plot)
    return records


if __name__ == "__main__":
    common.main_guard(main)
