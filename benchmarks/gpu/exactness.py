"""The cache's exactness checks, per dtype, on whatever device MLX computes on.

The properties the tests pin on the CPU backend in float32, measured again here in
float32, bfloat16 and float16 on tiny random models and on the default model (or a
folder of the same shapes): one JSON line per (check, model, dtype) with ``passed``,
``bitwise`` and the largest difference, so a GPU run says which property holds in
which dtype instead of stopping at the first failure.

- ``kvcache``: the sink cache against mlx-lm's ``KVCache`` before the first eviction,
  logits bit for bit (tests/test_cache.py);
- ``speculative``: speculative greedy decoding equals plain greedy after several wraps
  of the ring (tests/test_decode.py; a one-layer draft, or the model as its own);
- ``quantized-8``, ``quantized-4``: the 8- and 4-bit windows close to the float window
  before eviction, and speculative == plain greedy on the 4-bit one
  (tests/test_cache_quantized.py, tests/test_kvquant.py);
- ``batching``: rows of one batch at different offsets give what each session gives
  alone (tests/test_batch.py);
- ``recall``: a recall cache saved, loaded and fed on gives the logits of a run that
  never stopped, bit for bit (tests/test_recall_persist.py; float and 4-bit stores).

    python benchmarks/gpu/exactness.py --out exactness.jsonl          # tiny + default
    python benchmarks/gpu/exactness.py --models tiny --dtypes float32 --quick
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]  # the tests' helpers, common

import common  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
# The default model's weights are 4-bit as stored: also checked as they are.
DEFAULT_DTYPES = (*DTYPES, "quantized")
CHECKS = ("kvcache", "speculative", "quantized-8", "quantized-4", "batching", "recall")
S, W, SLACK = 4, 32, 8  # sinks, window and slack of tests/test_decode.py
# Largest logit difference relative to the largest logit where a check allows one
# (a BLAS or a GPU kernel may sum in another order for 1-row and many-row calls).
CLOSE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
QUANTIZED = {8: 0.01, 4: 0.10}  # tests/test_cache_quantized.py's TOLERANCE
G = 32  # kv_group_size
HEAD64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64


def compare(a, b) -> dict:
    """``bitwise``, ``max_abs`` and ``rel`` (to the largest of ``b``) of two logit
    arrays, and whether their argmax rows agree."""
    import mlx.core as mx

    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    diff = mx.abs(a32 - b32).max().item()
    scale = mx.abs(b32).max().item() or 1.0
    return {
        "bitwise": bool(mx.array_equal(a, b).item()),
        "max_abs": diff,
        "rel": diff / scale,
        "argmax_equal": bool(mx.array_equal(a32.argmax(-1), b32.argmax(-1)).item()),
        "finite": bool(mx.isfinite(a32).all().item()),
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check_kvcache(model, case) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_stream.cache.sink import make_sink_cache
    from tests.support.cache import TOKENS

    reference, ours = make_prompt_cache(model), make_sink_cache(model, sinks=S, window=W)
    want, got = [], []
    calls = [TOKENS[:20]] + [[t] for t in TOKENS[20 : S + W]]
    for tokens in calls:
        x = mx.array([tokens])
        want.append(model(x, cache=reference)[0])
        got.append(model(x, cache=ours)[0])
    figures = compare(mx.concatenate(got), mx.concatenate(want))
    return dict(figures, passed=figures["bitwise"], tokens=S + W)


def greedy(model, cache, prompt, n, **kwargs) -> list[int]:
    from mlx_stream.generate.decode import generate_step

    return [t for t, _, _ in generate_step(prompt, model, cache, max_tokens=n, **kwargs)]


def speculative(model, draft, kv_bits=None, tokens=5 * W + 8) -> dict:
    """Plain greedy against speculative greedy (3 drafted tokens) on sink caches."""
    from mlx_stream.cache.sink import make_sink_cache
    from mlx_stream.generate.decode import DecodeState
    from tests import tiny

    def caches(m):
        if kv_bits:
            return make_sink_cache(m, S, W, 16, stride=16, kv_bits=kv_bits, kv_group_size=G)
        return make_sink_cache(m, S, W, SLACK)

    prompt = tiny.random_tokens(40, seed=3)
    plain = greedy(model, caches(model), prompt, tokens)
    state = DecodeState()
    spec = greedy(model, caches(model) + caches(draft), prompt, tokens, draft_model=draft,
                  num_draft_tokens=3, state=state)  # fmt: skip
    return {
        "passed": spec == plain,
        "tokens": tokens,
        "wraps": round((len(prompt) + tokens) / (S + W), 1),
        "first_divergence": first_divergence(spec, plain),
        "drafted": state.drafted,
        "accepted": state.accepted,
    }


def check_speculative(model, case) -> dict:
    return speculative(model, case["draft"], tokens=case["tokens"])


def check_quantized(bits: int):
    def check(model, case) -> dict:
        from mlx_stream.cache.sink import make_sink_cache
        from tests.support.cache import TOKENS, feed

        qmodel = case.get("qmodel", model)
        sizes = dict(sinks=S, window=W, slack=16, stride=16)
        ours = feed(qmodel, make_sink_cache(qmodel, kv_bits=bits, kv_group_size=G, **sizes),
                    TOKENS[: S + W], 8)  # fmt: skip
        ref = feed(qmodel, make_sink_cache(qmodel, **sizes), TOKENS[: S + W], 8)
        figures = compare(ours, ref)
        record = dict(figures, passed=figures["rel"] < QUANTIZED[bits])
        if bits == 4:  # speculative == plain greedy across group fills and rollbacks
            spec = speculative(qmodel, case.get("qdraft", case["draft"]), 4, case["tokens"])
            record.update({f"speculative_{k}": v for k, v in spec.items()})
            record["passed"] = record["passed"] and spec["passed"]
        return record

    return check


def check_batching(model, case) -> dict:
    import mlx.core as mx

    from mlx_stream.cache.batched import check_batchable
    from mlx_stream.cache.sink import make_sink_cache
    from mlx_stream.generate.batch import Batch
    from mlx_stream.generate.decode import generate_step
    from tests.tiny import random_tokens

    check_batchable(model)  # Unsupported (a skip) for models a batch cannot take
    sizes = dict(sinks=4, window=16, slack=4, stride=4)  # tests/test_batch.py's SIZES
    prompts = [random_tokens(n, seed=i) for i, n in enumerate((5, 37, 70))]
    n = case["tokens"] // 3
    alone = [
        [(t, lp) for t, lp, _ in generate_step(p, model, make_sink_cache(model, **sizes),
                                                max_tokens=n)]
        for p in prompts
    ]  # fmt: skip
    batch = Batch(model)
    rows = [batch.add(make_sink_cache(model, **sizes), p, max_tokens=n) for p in prompts]
    got = [[] for _ in prompts]
    while any(len(g) < n for g in got):
        batch.step()
        for row, out in zip(rows, got):
            while row.inbox:
                out.append(row.inbox.popleft())
    tokens = [[t for t, _ in g] for g in got] == [[t for t, _ in a] for a in alone]
    err = max(
        mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        for g, r in zip(got, alone) for (_, a), (_, b) in zip(g, r)
    )  # fmt: skip
    return {"passed": tokens and err <= CLOSE[case["float"]], "tokens_equal": tokens,
            "logprob_max_abs": err, "rows": len(prompts), "tokens": n}  # fmt: skip


def check_recall(model, case) -> dict:
    import mlx.core as mx

    from mlx_stream.cache.sink import load_cache, save_cache
    from tests import tiny
    from tests.support.recall import feed, recall_cache, spec

    record = {}
    stores = {"float": ({}, model)}
    if case.get("head64") is not None:  # a 4-bit store's groups must divide head_dim
        stores["4bit"] = ({"bits": 4, "group_size": 32}, case["head64"])
    tokens = tiny.random_tokens(200, seed=7)
    for name, (kw, m) in stores.items():
        whole = recall_cache(m, **kw)
        want = mx.concatenate([feed(m, whole, tokens[:100]), feed(m, whole, tokens[100:])])
        part = recall_cache(m, **kw)
        feed(m, part, tokens[:100])
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "c.safetensors"
            save_cache(path, part)
            fresh, _ = load_cache(path, m, spec(**kw))
            got = feed(m, fresh, tokens[100:])
        figures = compare(got, want[100:])
        record.update({f"{name}_{k}": v for k, v in figures.items()})
    record["passed"] = all(record[f"{name}_bitwise"] for name in stores)
    return record


RUNNERS = {
    "kvcache": check_kvcache,
    "speculative": check_speculative,
    "quantized-8": check_quantized(8),
    "quantized-4": check_quantized(4),
    "batching": check_batching,
    "recall": check_recall,
}


def tiny_cases(dtype: str, tokens: int):
    """``(label, model, case)`` for the tiny random models in ``dtype``."""
    import mlx.core as mx

    from tests import tiny

    d = getattr(mx, dtype)
    draft = tiny.make_model("llama", seed=1, num_hidden_layers=1, dtype=d)
    # tests/test_kvquant.py's shape: head_dim 32, so 32-wide groups divide it
    qshape = dict(num_attention_heads=2, num_key_value_heads=1, scale=1.0, dtype=d)
    common_case = {
        "draft": draft,
        "tokens": tokens,
        "float": dtype,
        "qmodel": tiny.make_model("llama", **qshape),
        "qdraft": tiny.make_model("llama", seed=7, num_hidden_layers=1, **qshape),
        "head64": tiny.make_model("llama", seed=3, dtype=d, **HEAD64),
    }
    for arch in ("llama", "qwen2", "gemma3_text"):
        checks = CHECKS if arch == "llama" else ("kvcache", "batching")
        yield f"tiny-{arch}", tiny.make_model(arch, dtype=d), common_case, checks


def default_cases(name: str, dtype: str, tokens: int):
    """The default model (a registry name or a folder) in ``dtype``: its own draft."""
    model, _, weights = common.load_model(name, dtype)
    case = {"draft": model, "tokens": tokens, "weights": weights,
            "float": "float32" if dtype == "quantized" else dtype}  # fmt: skip
    case["head64"] = model if _head_dim(model) % G == 0 else None
    yield common.model_label(name), model, case, CHECKS


def _head_dim(model) -> int:
    layer = model.layers[0].self_attn
    return getattr(layer, "head_dim", None) or model.args.hidden_size // layer.n_heads


def run(args) -> list[dict]:
    import mlx.core as mx

    records = []
    plans = []
    if "tiny" in args.models:
        dtypes = [d for d in args.dtypes if d in DTYPES]
        plans += [(d, lambda d=d: tiny_cases(d, args.tokens)) for d in dtypes]
    if "default" in args.models:
        plans += [(d, lambda d=d: default_cases(args.model, d, args.tokens)) for d in args.dtypes]
    for dtype, cases in plans:
        for label, model, case, checks in cases():
            for check in [c for c in checks if c in args.checks]:
                tic = time.perf_counter()
                try:
                    figures = RUNNERS[check](model, case)
                except Exception as e:  # one failing check must not hide the others
                    skipped = type(e).__name__ == "Unsupported"
                    figures = {"passed": None if skipped else False, "skipped": skipped,
                               "error": f"{type(e).__name__}: {e}"[:300]}  # fmt: skip
                    if not skipped:
                        traceback.print_exc()
                base = common.base_record("gpu-exactness", label,
                                          case.get("weights", dtype))  # fmt: skip
                record = dict(base, check=check, dtype=dtype, **figures,
                              seconds=round(time.perf_counter() - tic, 2))  # fmt: skip
                records.append(common.emit(record, args.out))
            mx.clear_cache()
    passed = [r for r in records if r["passed"] is not None]
    summary = dict(common.base_record("gpu-exactness", args.model, "-"), summary=True,
                   checks=len(passed), passed=sum(bool(r["passed"]) for r in passed),
                   failed=[f"{r['model']}/{r['dtype']}/{r['check']}"
                           for r in passed if not r["passed"]])  # fmt: skip
    records.append(common.emit(summary, args.out))
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,default", help="tiny, default or both")
    parser.add_argument(
        "--dtypes", default=",".join(DEFAULT_DTYPES),
        help="comma-separated; quantized (the weights as stored) only for the default model",
    )  # fmt: skip
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated")
    parser.add_argument("--tokens", type=int, default=5 * W + 8, help="greedy tokens per run")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = min(args.tokens, 2 * W + 8)
    args.models, args.dtypes = args.models.split(","), args.dtypes.split(",")
    args.checks = args.checks.split(",")
    unknown = [c for c in args.checks if c not in CHECKS] + [
        d for d in args.dtypes if d not in DEFAULT_DTYPES
    ]
    if unknown:
        parser.error(f"unknown check or dtype: {', '.join(unknown)}")
    return run(args)


if __name__ == "__main__":
    common.main_guard(main)
