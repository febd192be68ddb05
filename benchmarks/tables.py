"""Markdown tables (for the README) from the JSON lines under ``benchmarks/results/<benchmark>/``.

python benchmarks/tables.py                       # every results file of a known kind
python benchmarks/tables.py --results other/dir
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def read(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def rounded(x, digits: int = 3):
    """``x`` to ``digits`` significant figures (medians print as 4.8100000000000005)."""
    return float(f"{x:.{digits}g}") if isinstance(x, float) else x


def machine(r: dict) -> str:
    """One line naming the model, machine, versions and BLAS of a record."""
    return (
        f"{r.get('model')} ({r.get('weights')}), {r['machine']}, {r['device']}, "
        f"mlx {r['mlx']}, mlx-lm {r['mlx_lm']}, BLAS {r.get('blas')}"
    )


def decode_tables(records: list[dict]) -> str:
    rows = [r for r in records if "cache" in r]
    if not rows:
        return ""
    out = [f"Machine: {machine(rows[0])}.", ""]
    out.append(
        table(
            [
                "cache",
                "context",
                "tok/s",
                "p50 ms",
                "p90 ms",
                "bare call ms",
                "prefill tok/s",
                "KV MB",
            ],
            [
                [
                    r["cache"],
                    r["context"],
                    r["tok_s"],
                    r["p50_ms"],
                    r["p90_ms"],
                    r.get("bare_p50_ms", ""),
                    r["prefill_tps"],
                    r["kv_mb"],
                ]  # fmt: skip
                for r in sorted(rows, key=lambda r: (r["context"], r["cache"]))
            ],
        )
    )
    summary = next((r for r in records if r.get("summary")), None)
    if summary:

        def by_context(prefix: str) -> dict:
            """context -> value, with the per-repeat range where the summary has one."""
            out = {}
            for k, v in summary.items():
                if k.startswith(prefix) and not k.endswith("_range"):
                    spread = summary.get(f"{k}_range")
                    out[k.rsplit("_", 1)[-1]] = f"{v} ({spread[0]}-{spread[1]})" if spread else v
            return out

        ratios, bare = (
            by_context("sink_over_rotating_tok_s_"),
            by_context("sink_over_rotating_bare_"),
        )
        loop = by_context("rotating_ours_over_rotating_tok_s_")
        if loop:  # --caches rotating-ours: the ratio split into loop and cache
            cache = by_context("sink_over_rotating_ours_tok_s_")
            out += ["", f"Loop (ours/mlx-lm, both on RotatingKVCache): {loop}; cache "
                    f"(SinkCache/RotatingKVCache, both in our loop): {cache}."]  # fmt: skip
        out += ["", f"sink / rotating tok/s by context: {ratios}; bare call ms: {bare}; "
                f"sink p50 growth {summary.get('sink_p50_growth')}, full-cache p50 growth "
                f"{summary.get('full_p50_growth')}, full KV MB {summary.get('full_kv_mb_growth')}."]  # fmt: skip
    return "\n".join(out)


def spec_tables(records: list[dict]) -> str:
    if not records:
        return ""
    r0 = records[0]
    out = [
        f"Machine: {machine(r0)}. Draft {r0['draft']}, {r0['num_draft_tokens']} drafts/round, "
        f"{r0['tokens']} tokens, reclaim every {r0['every']}.",
        "",
    ]
    out.append(
        table(
            [
                "contender",
                "pool MB max",
                "pool MB last",
                "active MB max",
                "KV MB",
                "reclaims",
                "tok/s",
                "accepted",
            ],  # fmt: skip
            [
                [
                    r["contender"],
                    r["pool_mb_max"],
                    r["pool_mb_last"],
                    r["active_mb_max"],
                    r["kv_mb"],
                    r["reclaims"],
                    r["tok_s"],
                    r["accepted_fraction"],
                ]  # fmt: skip
                for r in records
            ],
        )
    )
    return "\n".join(out)


def perplexity_tables(records: list[dict]) -> str:
    rows = [r for r in records if "segments" in r]
    if not rows:
        return ""
    out = [f"Machine: {machine(rows[0])}. Stream: {rows[0]['stream_tokens']} tokens of "
           f"{rows[0]['book']}.", ""]  # fmt: skip
    out.append(
        table(
            ["configuration", "tokens scored", "perplexity", "tok/s", "peak MB"],
            [[r["config"], r["tokens"], r["perplexity"], r["tok_s"], r["peak_mb"]] for r in rows],
        )
    )
    for r in records:
        if r["config"].startswith("recompute"):
            same = ", ".join(f"{k}: {v}" for k, v in r["same_tokens_perplexity"].items())
            out += ["", f"{r['config']} (oracle) on {r['tokens']} sampled tokens: "
                    f"{r['perplexity']} at {r['tok_s']} tok/s. Same tokens: {same}."]  # fmt: skip
        if r["config"].startswith("throughput"):
            out += ["", f"Chunked vs token-by-token ({r['config']}, {r['tokens']} tokens): "
                    f"perplexity {r['chunked_perplexity']} vs {r['token_by_token_perplexity']}, "
                    f"{r['chunked_tok_s']} vs {r['token_by_token_tok_s']} tok/s "
                    f"({r['speedup']}x)."]  # fmt: skip
    return "\n".join(out)


def attention_tables(records: list[dict]) -> str:
    if not records:
        return ""
    r0 = records[0]
    out = [
        f"Machine: {machine(r0)}. Decode attention of {r0['layers']} layers "
        f"({r0['heads']} query / {r0['kv_heads']} key-value heads, head dim {r0['head_dim']}), "
        f"sinks {r0['sinks']}, window {r0['window']}, median of {r0['rounds']} tokens.",
        "",
    ]
    rows = [[r["contender"], r["keys"], r["ms_per_token"], r["over_rotating"]] for r in records]
    out.append(table(["cache", "keys attended", "ms per token", "over rotating"], rows))
    return "\n".join(out)


def quantized_tables(records: list[dict]) -> str:
    summary = next((r for r in records if r.get("benchmark") == "quantized-summary"), None)
    if not summary:
        return ""
    r0 = next(r for r in records if r.get("benchmark") == "quantized")
    scored = f"{r0['tokens']} tokens scored" if r0["tokens"] else "decode speed only"
    out = [f"Machine: {machine(r0)}. Sinks {r0['sinks']}, {scored}.", ""]
    rows = [
        [r["config"], r["window"], rounded(r.get("perplexity"), 5),
         rounded(100 * r["perplexity_vs_float"]) if r.get("perplexity_vs_float") is not None
         else "", round(r["cache_bytes_per_token"]), r["cache_mb"],
         rounded(r["decode_ratio_vs_float"])]
        for r in summary["rows"]
    ]  # fmt: skip
    header = ["cache", "window", "perplexity", "vs float %", "bytes/token", "cache MB",
              "decode vs float"]  # fmt: skip
    out.append(table(header, rows))
    return "\n".join(out)


def blas_tables(records: list[dict]) -> str:
    summary = next((r for r in records if r.get("summary")), None)
    rows = [r for r in records if not r.get("summary")]
    if not summary or not rows:
        return ""
    out = [f"Machine: {machine(rows[0])} (BLAS column per configuration).", ""]
    out.append(
        table(
            [
                "configuration",
                "MLX GFLOP/s",
                "numpy GFLOP/s",
                "MLX/numpy",
                "prefill tok/s",
                "decode tok/s",
            ],  # fmt: skip
            [
                [name]
                + [
                    rounded(m.get(k))
                    for k in (
                        "mlx_gflops",
                        "numpy_gflops",
                        "mlx_over_numpy",
                        "prefill_tps",
                        "decode_tps",
                    )
                ]  # fmt: skip
                for name, m in summary["configs"].items()
            ],
        )
    )
    speedups = {k: v for k, v in summary.items() if k.endswith("_speedup")}
    out += ["", f"Speed-ups over netlib (medians of {len(rows)} interleaved runs): {speedups}."]
    return "\n".join(out)


def distributed_tables(records: list[dict]) -> str:
    rows = [r for r in records if r.get("bench") == "distributed" and not r.get("summary")]
    if not rows:
        return ""
    r0 = rows[0]
    out = [
        f"Machine: {machine(r0)}. Loopback ring, {r0['context']} tokens prefilled, "
        f"{r0['decode_tokens']} decoded, sinks {r0['sinks']} + window {r0['window']}.",
        "",
    ]
    body = [
        [r["ranks"], r.get("strategy") or "-", r["cache"], rounded(r["tok_s"]),
         rounded(r["prefill_tps"]), max(x["weights_mb"] for x in r["per_rank"]),
         max(x["kv_mb"] for x in r["per_rank"]), max(x["peak_mb"] for x in r["per_rank"])]
        for r in rows
    ]  # fmt: skip
    header = ["ranks", "strategy", "cache", "decode tok/s", "prefill tok/s",
              "weights MB/rank", "KV MB/rank", "peak MB/rank"]  # fmt: skip
    out.append(table(header, body))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    renderers = (  # by file-name prefix: every results file of a kind, long runs too
        ("attention", "Decode attention", attention_tables),
        ("blas", "BLAS", blas_tables),
        ("decode", "Decode", decode_tables),
        ("distributed", "Sharded over loopback ranks", distributed_tables),
        ("spec_memory", "Speculative decoding memory", spec_tables),
        ("perplexity", "Perplexity", perplexity_tables),
        ("quantized", "Quantized cache", quantized_tables),
    )
    parts = []
    for path in sorted(args.results.rglob("*.jsonl")):  # results/<benchmark>/*.jsonl
        for prefix, title, render in renderers:
            if path.name.startswith(prefix):
                text = render(read(path))
                if text:
                    parts.append(f"### {title} (`{path.relative_to(args.results)}`)\n\n{text}\n")
    output = "\n".join(parts)
    print(output)
    return output


if __name__ == "__main__":
    main()
