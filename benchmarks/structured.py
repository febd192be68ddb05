"""Structured output's cost: decode tok/s with a JSON schema vs without (issue 25).

B sessions (``--batches``, default 1 and 8) each get a different ``--context``-token
stretch of Moby-Dick as their prompt, then decode ``--tokens`` greedy steps together in
one :class:`mlx_stream.generate.batch.Batch` (one row per session on its own sink cache, as
``serve`` runs them):

- ``plain``: no logits processor;
- ``schema``: every row carries its own llguidance constraint
  (:class:`mlx_stream.serve.structured.Constraint`, what ``response_format``
  ``json_schema`` gives a request), for a schema of an array of ``{"name": string,
  "age": integer}`` objects with ``minItems`` large enough that it never completes
  within the steps timed, so every step is constrained.

Both sets of rows exist at once and decode in alternating blocks of ``--block`` steps
(noise on this shared machine falls on both alike); only decode steps are timed. One
JSON line per (mode, B) with aggregate tok/s (steps over total time) and the median
step time (the schema line also: the constraint's own CPU time per row and token,
replayed on ready logits), and a summary line with the schema/plain speed ratio per B from both
(target: at least 0.90, i.e. at most 10% slower; the median resists load spikes).

    python benchmarks/structured.py --batches 1,8 --tokens 48
"""

from __future__ import annotations

import time

import common

SCHEMA = {
    "type": "array",
    "minItems": 100000,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}


class Rows:
    """B rows in their own batch, with or without a constraint each."""

    def __init__(self, model, tokenizer, prompts, args, constrained: bool):
        from mlx_stream.cache import make_sink_cache
        from mlx_stream.generate.batch import Batch
        from mlx_stream.serve.structured import Grammars, json_schema_grammar

        grammars = Grammars(tokenizer)
        grammar = json_schema_grammar(SCHEMA, "schema")
        self.batch = Batch(model, prefill_chunk=512)
        self.rows = []
        for p in prompts:
            procs = [grammars.constraint(grammar)] if constrained else None
            cache = make_sink_cache(model, args.sinks, args.window)
            self.rows.append(self.batch.add(cache, p, processors=procs))
        self.tokens: list[list[int]] = [[] for _ in self.rows]
        while self.batch.waiting:  # prefill (not timed)
            self.batch.step()
        self.step()

    def step(self) -> None:
        self.batch.step()
        for i, r in enumerate(self.rows):
            while r.inbox:
                self.tokens[i].append(r.inbox.popleft()[0])

    def close(self) -> None:
        for r in list(self.rows):
            self.batch.remove(r)


def run(model, tokenizer, prompts, args) -> dict[str, list[float]]:
    import mlx.core as mx

    modes = {m: Rows(model, tokenizer, prompts, args, m == "schema") for m in ("plain", "schema")}
    mx.synchronize()
    times: dict[str, list[float]] = {m: [] for m in modes}
    order = list(modes)
    for b in range(-(-args.tokens // args.block)):
        steps = min(args.block, args.tokens - b * args.block)
        for name in order if b % 2 == 0 else order[::-1]:
            tic = time.perf_counter()
            for _ in range(steps):
                modes[name].step()
            mx.synchronize()
            times[name] += [(time.perf_counter() - tic) / steps] * steps
    sample = modes["schema"].tokens[0]
    for m in modes.values():
        m.close()
    return times, sample


def mask_cost(tokenizer, tokens: list[int], vocab: int) -> float:
    """Milliseconds the constraint itself takes per token (grammar step, mask, its
    MLX array), replaying ``tokens`` on ready logits: the CPU work it adds to a step."""
    import mlx.core as mx

    from mlx_stream.serve.structured import Grammars, json_schema_grammar

    constraint = Grammars(tokenizer).constraint(json_schema_grammar(SCHEMA, "schema"))
    logits = mx.zeros((1, vocab))
    mx.eval(logits)
    tic = time.perf_counter()
    for token in [0, *tokens]:
        mx.eval(constraint(mx.array([token]), logits))
    return 1e3 * (time.perf_counter() - tic) / (len(tokens) + 1)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8", help="sessions decoded together")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens per session")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps timed")
    parser.add_argument("--block", type=int, default=8, help="steps per timed block")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches must be integers separated by commas (got {args.batches!r})")
    if args.quick:
        batches, args.context, args.tokens = [1, 2], 40, 8
    model, tokenizer, weights = common.load_model(args.model, args.dtype)
    records, ratios, medians = [], {}, {}
    for B in batches:
        tokens = common.book_tokens(tokenizer, args.context * B)
        prompts = [tokens[i * args.context : (i + 1) * args.context] for i in range(B)]
        times, sample = run(model, tokenizer, prompts, args)
        mask_ms = mask_cost(tokenizer, sample, len(tokenizer.get_vocab()))
        rate = {m: B * len(t) / sum(t) for m, t in times.items()}
        ratios[B] = round(rate["schema"] / rate["plain"], 3)
        p50 = {m: common.percentile(t, 50) for m, t in times.items()}
        medians[B] = round(p50["plain"] / p50["schema"], 3)  # speed ratio of the median steps
        for mode, t in times.items():
            record = common.base_record(
                "structured", args.model, weights, mode=mode, sessions=B,
                context=args.context, window=args.window, tokens=args.tokens,
                tok_s=round(rate[mode], 2),
                p50_ms=round(1e3 * common.percentile(t, 50), 2),
                **({"mask_ms_per_row": round(mask_ms, 3),
                    "sample": tokenizer.decode(sample)[:80]} if mode == "schema" else {}),
            )  # fmt: skip
            records.append(common.emit(record, args.out))
    summary = {"bench": "structured", "summary": True, "schema_over_plain": ratios,
               "schema_over_plain_p50": medians, "target": 0.9}  # fmt: skip
    records.append(common.emit(summary, args.out))
    return records


if __name__ == "__main__":
    common.main_guard(main)
