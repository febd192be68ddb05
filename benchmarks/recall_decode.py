"""Decode with recall at N stored tokens against the same window without it.

The same book tokens (``--stored``, default 32,768; the books in the data folder
concatenated if one is too short) are prefilled, through mlx-stream's decode engine
(``generate_step``, chunks of ``--chunk``), into a sink cache with the recall tier and
into the same sink cache without it (and, with ``window-slack`` among ``--contenders``,
one without recall but with the slack recall raises the cache to, which isolates what
the slack alone costs). Then ``--rounds`` rounds (the contenders' order
alternated every step) each greedily decode ``--tokens`` steps per contender, in
lockstep: one step (model call, argmax, evaluated) of one contender, then one of the
other, so the machine's noise (a shared machine) hits both alike; the first step feeds
the book's next token. ``--tokens 64`` steps cover exactly one block boundary, so every
round pays the per-block selection refresh and region rebuild once (there is no
prompt end in a decode step, so no other refresh); each line says where its boundaries
fell.

One JSON line per contender and round (``recall-decode``), then a summary line: the
median over rounds of each contender's mean ms per step, the ratio recall / window
(and its range over rounds), the same for the median step (a step without refresh),
and the split of the recall rounds' time: selection
refresh (numpy scoring, timed in place), region rebuild (the region's device arrays
evaluated right after it is built, timed in place) and the attention over
``[region, ring]`` (one layer's call of the tier's attention, with the region,
against the plain call on the ring alone, interleaved, times the layers).

    nice python benchmarks/recall_decode.py --out benchmarks/results/recall_decode/recall_decode.jsonl
    nice python benchmarks/recall_decode.py --stored 4096 --out ...   # quick
"""

from __future__ import annotations

import statistics
import time

from common import (  # first: it preloads OpenBLAS before mlx.core
    base_parser,
    base_record,
    data_dir,
    emit,
    interleave,
    load_model,
    main_guard,
    mx,  # imported there, after the BLAS preload
)

BOOKS = ("moby_dick", "paradise_lost", "botchan", "alice_in_wonderland")


def stream_tokens(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of the books, concatenated in ``BOOKS`` order."""
    out: list[int] = []
    for book in BOOKS:
        path = data_dir() / f"{book}.txt"
        out += tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(out) >= n:
            break
    if len(out) < n:
        raise SystemExit(f"the books hold only {len(out)} tokens (asked {n})")
    return out[:n]


class Split:
    """Wall time of the tier's selection refreshes and region rebuilds (wrapped on the
    instance: the tier's code is unchanged; a rebuilt region is evaluated at once so
    its cost lands here rather than in the next attention call)."""

    def __init__(self, tier):
        self.tier = tier
        self.refresh_s = self.build_s = 0.0
        self.refreshes = self.builds = 0
        self.profile, self.profiled = None, 0  # cProfile of the refreshes from start_profile
        refresh, build = tier.refresh, tier.build_region

        def timed_refresh(point, *rest):
            tic = time.perf_counter()
            if self.profile is not None:
                self.profile.enable()
            refresh(point, *rest)
            if self.profile is not None:
                self.profile.disable()
                self.profiled += 1
            self.refresh_s += time.perf_counter() - tic
            self.refreshes += 1

        def timed_build(cache, n):
            before = tier.region.applied[cache.hook_index]
            tic = time.perf_counter()
            build(cache, n)
            if tier.region.applied[cache.hook_index] != before:
                mx.eval(tier.region.buffers(cache)[:2])
                self.build_s += time.perf_counter() - tic
                self.builds += 1

        tier.refresh, tier.build_region = timed_refresh, timed_build

    def snapshot(self) -> tuple:
        return self.refresh_s, self.build_s, self.refreshes, self.builds

    def start_profile(self) -> None:
        import cProfile

        self.profile = cProfile.Profile()

    def refresh_parts(self) -> dict:
        """With ``profile``: ms per refresh in gathering the queries (``recent_queries``) and
        in scoring the blocks (``select``'s ``layer_scores_*``), from cProfile."""
        import pstats

        if self.profile is None or not self.profiled:
            return {}
        parts = {"gather_queries": 0.0, "score_blocks": 0.0}
        for (_, _, name), (_, _, _, cum, _) in pstats.Stats(self.profile).stats.items():
            if name == "recent_queries":
                parts["gather_queries"] += cum
            elif name.startswith("layer_scores_"):
                parts["score_blocks"] += cum
        return {k: round(v * 1e3 / self.profiled, 2) for k, v in parts.items()}


def prefill(model, cache, tokens: list[int], chunk: int) -> tuple[int, float]:
    """Feed ``tokens`` through ``generate_step`` (one greedy token out, which the
    engine feeds too when it stops); returns the token and the seconds it took."""
    from mlx_stream.generate.decode import generate_step

    tic = time.perf_counter()
    gen = generate_step(mx.array(tokens), model, cache, max_tokens=1, prefill_step_size=chunk)
    token = int(next(gen)[0])
    gen.close()
    return token, time.perf_counter() - tic


def step(model, cache, token: int) -> tuple[int, float]:
    """One greedy decode step (the model call, the argmax, evaluated): the next
    token and the seconds it took."""
    tic = time.perf_counter()
    logits = model(mx.array([[token]]), cache=cache)
    nxt = mx.argmax(logits[0, -1], axis=-1)
    mx.eval(nxt)
    return int(nxt), time.perf_counter() - tic


def attention_cost(tier, plain_cache, reps: int) -> dict:
    """One layer's attention per decode step: the tier's call (region + ring, the
    concatenation and mask included) against mlx-lm's on the plain cache's ring, on
    the recall cache's ring (its slack) and on as many keys as the tier attends to,
    already in one array (``keys-only``: what the extra keys cost without the
    concatenation), interleaved, on random queries of the model's shapes."""
    from mlx_lm.models.base import scaled_dot_product_attention as original

    c = tier.layers[0]
    sel = tier.selection
    if not sel:
        return {}
    kd = tier.store.shapes[0]
    H, D, dtype = kd
    Hq = tier.queries[0][-1][1].shape[1] if tier.queries[0] else H
    ring = _slots(c)
    plain = _slots(plain_cache)
    q = mx.random.normal((1, Hq, 1, D)).astype(dtype)
    kr, vr = (mx.random.normal((1, H, ring, D)).astype(dtype) for _ in range(2))
    kp, vp = (mx.random.normal((1, H, plain, D)).astype(dtype) for _ in range(2))
    mr, mp = mx.zeros((1, 1, 1, ring), dtype), mx.zeros((1, 1, 1, plain), dtype)
    # the ring and the region: one buffer (the storage's tail), or joined without the
    # ring's sinks when the region holds their copy
    total = ring + tier.region.slots(c) - (0 if c.storage.tail else tier.lead_slots(c))
    ka, va = (mx.random.normal((1, H, total, D)).astype(dtype) for _ in range(2))
    ma = mx.zeros((1, 1, 1, total), dtype)
    mx.eval(q, kr, vr, kp, vp, ka, va, mr, mp, ma)
    scale = tier.scale or D**-0.5
    saved = list(tier.queries[0])
    n0 = c.tokens_seen - 1
    if tier.region.applied[0] != (sel, tier.region_anchor(c, n0), tier.placement):
        return {}
    times = {"recall": [], "window": [], "window-slack": [], "keys-only": []}

    def call(name):
        if name == "recall":
            out = tier.attend(c, q, kr, vr, scale, mr, None, original)
            tier.queries[0] = list(saved)  # the bench's query is not the stream's
        elif name == "window-slack":
            out = original(q, kr, vr, cache=None, scale=scale, mask=mr)
        elif name == "keys-only":
            out = original(q, ka, va, cache=None, scale=scale, mask=ma)
        else:
            out = original(q, kp, vp, cache=None, scale=scale, mask=mp)
        mx.eval(out)

    for name in interleave(list(times), 10):  # warm up
        call(name)
    for name in interleave(list(times), reps):
        tic = time.perf_counter()
        call(name)
        times[name].append(time.perf_counter() - tic)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "attn_layer_ms": {k: round(v, 4) for k, v in med.items()},
        "attn_keys": {"recall": total, "window-slack": ring, "window": plain, "keys-only": total},
        "attn_extra_ms_per_token": round((med["recall"] - med["window"]) * len(tier.layers), 3),
        "attn_extra_over_slack_ms_per_token": round(
            (med["recall"] - med["window-slack"]) * len(tier.layers), 3
        ),
        "attn_keys_only_extra_ms_per_token": round(
            (med["keys-only"] - med["window"]) * len(tier.layers), 3
        ),
    }


def _slots(cache_list_or_layer) -> int:
    c = cache_list_or_layer
    if isinstance(c, list):
        c = next(x for x in c if hasattr(x, "ring"))
    return c.ring.slots_total


def main(argv: list[str] | None = None) -> list[dict]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--stored", type=int, default=32768, help="tokens prefilled")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8, help="recall blocks (k)")
    parser.add_argument("--bits", type=int, default=None, help="store bits (4, 8)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="timed steps per round")
    parser.add_argument("--contenders", default="recall,window",
                        help="recall, window, window-slack (comma-separated)")  # fmt: skip
    parser.add_argument("--attn-reps", type=int, default=200)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the refreshes: gathering queries vs scoring")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:  # the tiny model
        args.stored, args.window, args.rounds, args.tokens = 600, 32, 2, 64
        args.blocks, args.attn_reps = 2, 20
        args.contenders = "recall,window,window-slack"
    names = [n for n in args.contenders.split(",") if n]
    if "recall" not in names or "window" not in names:
        parser.error("--contenders must name recall and window")
    from mlx_stream.cache.sink import make_sink_cache
    from mlx_stream.recall import RecallSpec, tier_of
    from mlx_stream.recall.spec import SELECTOR

    model, tokenizer, weights = load_model(args.model, args.dtype)
    tokens = stream_tokens(tokenizer, args.stored + 1)
    spec = RecallSpec(blocks=args.blocks, bits=args.bits)
    caches = {"recall": make_sink_cache(model, args.sinks, args.window, recall=spec)}
    tier = tier_of(caches["recall"])
    slack = tier.layers[0].slack  # what recall raised it to
    caches["window"] = make_sink_cache(model, args.sinks, args.window)
    if "window-slack" in names:
        caches["window-slack"] = make_sink_cache(model, args.sinks, args.window, slack=slack)
    split = Split(tier)
    fields = dict(stored=args.stored, window=args.window, sinks=args.sinks,
                  blocks=args.blocks, block=spec.block, selector=SELECTOR,
                  store_bits=args.bits, slack=slack)  # fmt: skip
    records: list[dict] = []

    def row(**r) -> None:
        records.append(emit(base_record("recall-decode", args.model, weights, **fields, **r),
                            args.out))  # fmt: skip

    last, prefill_s = {}, {}
    for name in names:
        _, prefill_s[name] = prefill(model, caches[name], tokens[:-1], args.chunk)
        last[name] = tokens[-1]  # the first step feeds the book's next token
        extra = {}
        if name == "recall":
            extra = dict(stored_blocks=tier.stored, store_mb=round(tier.store_nbytes / 1e6, 2),
                         region_mb=round(tier.device_nbytes / 1e6, 3))  # fmt: skip
        row(phase="prefill", cache=name, seconds=round(prefill_s[name], 1),
            tok_s=round(args.stored / prefill_s[name], 2), **extra)  # fmt: skip
        print(f"# prefill {name}: {prefill_s[name]:.0f} s", flush=True)

    if args.profile:  # the decode rounds' refreshes only
        split.start_profile()
    per_round: dict[str, list[float]] = {n: [] for n in names}
    p50: dict[str, list[float]] = {n: [] for n in names}
    rec_split: list[tuple] = []
    sink = caches["recall"][0]
    for rnd in range(args.rounds):
        start = sink.tokens_seen  # every contender is at the same token
        times: dict[str, list[float]] = {n: [] for n in names}
        before = split.snapshot()
        for s in range(args.tokens):  # lockstep: machine noise hits every contender alike
            order = names if (rnd * args.tokens + s) % 2 == 0 else names[::-1]
            for name in order:
                last[name], dt = step(model, caches[name], last[name])
                times[name].append(dt)
        after = split.snapshot()
        boundaries = [t for t in range(start, start + args.tokens) if t % spec.block == 0]
        d = [a - b for a, b in zip(after, before)]
        rec_split.append(d)
        for name in names:
            ms = sum(times[name]) / len(times[name]) * 1e3
            per_round[name].append(ms)
            p50[name].append(statistics.median(times[name]) * 1e3)
            extra = {}
            if name == "recall":
                extra = dict(refresh_ms=round(d[0] * 1e3, 2), rebuild_ms=round(d[1] * 1e3, 2),
                             refreshes=d[2], rebuilds=d[3], selection=list(tier.selection),
                             stored_blocks=tier.stored)  # fmt: skip
            row(phase="decode", cache=name, round=rnd, first_step=start, steps=args.tokens,
                boundaries=boundaries, ms_per_step=round(ms, 3), p50_ms=round(p50[name][-1], 3),
                max_ms=round(max(times[name]) * 1e3, 3), **extra)  # fmt: skip

    attention = attention_cost(tier, caches["window"], args.attn_reps)
    med = {n: statistics.median(v) for n, v in per_round.items()}
    pair = [a / b for a, b in zip(per_round["recall"], per_round["window"])]
    steps = args.tokens
    refresh = statistics.median(d[0] for d in rec_split) * 1e3 / steps
    rebuild = statistics.median(d[1] for d in rec_split) * 1e3 / steps
    summary = dict(
        summary=True, rounds=args.rounds, steps_per_round=steps,
        ms_per_step={n: round(v, 3) for n, v in med.items()},
        recall_over_window=round(med["recall"] / med["window"], 3),
        recall_over_window_range=[round(min(pair), 3), round(max(pair), 3)],
        recall_over_window_median_round=round(statistics.median(pair), 3),
        p50_ms_per_step={n: round(statistics.median(v), 3) for n, v in p50.items()},
        p50_recall_over_window=round(
            statistics.median(p50["recall"]) / statistics.median(p50["window"]), 3
        ),
        target_max=1.3,
        refresh_ms_per_step=round(refresh, 3), rebuild_ms_per_step=round(rebuild, 3),
        extra_ms_per_step=round(med["recall"] - med["window"], 3),
        prefill_s={n: round(v, 1) for n, v in prefill_s.items()}, **attention,
        refresh_profile_ms=split.refresh_parts(),
    )  # fmt: skip
    if "window-slack" in med:
        summary["slack_over_window"] = round(med["window-slack"] / med["window"], 3)
        summary["recall_over_slack"] = round(med["recall"] / med["window-slack"], 3)
    row(**summary)
    tier.close()
    return records


if __name__ == "__main__":
    main_guard(main)
