"""Needles past the window: the window alone, the window with recall, the full cache.

One JSON line per prompt and cache (``recall-needle``): a pass key (or a word fact) at
a depth of a long prompt, the greedy answer, whether it holds the needle, the store's
and the region's bytes and the seconds it took. ``--table FILE`` renders saved lines.

    python benchmarks/recall.py --length 16384,32768 --depths 0.1,0.3,0.5,0.7,0.9 \\
        --caches recall --out benchmarks/results/recall/recall.jsonl
    python benchmarks/recall.py --length 4096 --caches recall,full,window --out ...
    python benchmarks/recall.py --table benchmarks/results/recall/recall.jsonl
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from common import (  # first: it preloads OpenBLAS before mlx.core
    base_parser,
    base_record,
    book_tokens,
    emit,
    load_model,
    main_guard,
)

from mlx_stream.eval.needle import filler_tokens, filler_unit, needle_eval
from mlx_stream.recall import RecallSpec
from mlx_stream.recall.spec import PLACEMENT, SELECTOR


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def words(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--length", type=ints, default=[16384, 32768])
    parser.add_argument("--depths", type=floats, default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--kinds", type=words, default=["passkey"])
    parser.add_argument("--caches", type=words, default=["recall", "window"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8, help="recall blocks (k)")
    parser.add_argument("--bits", type=int, default=None, help="store bits (4, 8)")
    parser.add_argument("--haystack", default="filler", help="filler, or a book in the data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", action="store_true",
                        help="also rank the needle's blocks under every selector at the "
                        "prompt's end (the exact one costs O(stored tokens))")  # fmt: skip
    parser.add_argument(
        "--questions",
        type=words,
        default=["primed"],
        help="primed (ends with the needle's words) or plain phrasings q0,q1,q2",
    )
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument(
        "--dump",
        type=Path,
        help="save each recall prompt's end (queries, "
        "stored keys) to an .npz in this folder, for offline scoring",
    )
    parser.add_argument("--table", type=Path, help="render saved JSON lines and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        lines = [json.loads(x) for x in args.table.read_text().splitlines() if x.strip()]
        print(render_questions(lines) if any("question" in r for r in lines) else render(lines))
        return []
    if args.quick:  # the tiny model: short prompts
        args.length, args.depths, args.window, args.blocks = [400], [0.2], 32, 2
    model, tokenizer, weights = load_model(args.model, args.dtype)
    need = max(args.length) + 256
    align = 1
    if args.haystack == "filler":
        hay, align = filler_tokens(tokenizer, need), filler_unit(tokenizer)
    else:
        hay = book_tokens(tokenizer, need, args.haystack)
    spec = RecallSpec(blocks=args.blocks, bits=args.bits)
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    records = []

    def row(r: dict) -> None:
        records.append(emit(base_record(
            "recall-needle", args.model, weights, window=args.window, sinks=args.sinks,
            blocks=args.blocks, selector=SELECTOR, placement=PLACEMENT,
            store_bits=args.bits, index="reuse", haystack=args.haystack, **r),
            args.out))  # fmt: skip

    tic = time.perf_counter()
    needle_eval(model, tokenizer, hay, args.length, args.depths, args.kinds, args.caches,
                args.sinks, args.window, spec, context, args.answer_tokens, args.seed, row,
                inspect=inspector(args), align=align, questions=args.questions)  # fmt: skip
    print(f"# {time.perf_counter() - tic:.0f} s", flush=True)
    return records


def inspector(args):
    """The prompt-end inspection ``--ranks`` and ``--dump`` ask for, or ``None``."""
    if not (args.ranks or args.dump):
        return None

    def inspect(tier, prompt, row: dict) -> None:
        if args.ranks:
            ranks(tier, prompt, row)
        if args.dump:
            measure = tier.on_prompt_end

            def both(t, point):
                if measure is not None:
                    measure(t, point)
                row["dump"] = str(dump(t, point, prompt, args.dump, args.haystack))

            tier.on_prompt_end = both

    return inspect


def dump(tier, point: int, prompt, folder: Path, haystack: str = "filler") -> Path:
    """Save what a selection at ``point`` reads: every layer's recent queries and the
    stored keys of the candidate blocks (float16), the needle's place, the scale."""
    import mlx.core as mx
    import numpy as np

    nb = min(tier.stored, tier.evicted_blocks(point))
    arrays = {}
    for i, q in enumerate(tier.recent_queries(point)):
        arrays[f"q{i}"] = q.astype(np.float16)
        arrays[f"k{i}"] = np.stack([np.asarray(tier.store.get(i, j)[0][0].astype(mx.float32))
                                    for j in range(nb)]).astype(np.float16)  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{haystack}_{prompt.value}_{prompt.needle_at}_{point}.npz"
    np.savez(path, first=np.array(tier.first[:nb]), point=point, scale=tier.scale,
             needle=np.array([prompt.needle_at, prompt.needle_len, prompt.asked_at]),
             block=tier.block, **arrays)  # fmt: skip
    return path


def ranks(tier, prompt, row: dict) -> None:
    """At the prompt's end: the rank of each of the needle's blocks under every
    selector (0: the best block), from the same queries."""
    import numpy as np

    from mlx_stream.recall.select import kinds_for

    bs = tier.block
    blocks = sorted({prompt.needle_at // bs, (prompt.needle_at + prompt.needle_len - 1) // bs})

    def measure(t, point):
        out = {}
        for selector in ("exact", "quest", "mean", "token"):  # score.block_scores's
            if not set(kinds_for(selector)) <= set(t.summaries.kinds):
                continue  # the tier keeps only the summaries its own selectors read
            scores = t.scores(point, selector)
            if scores is None:
                continue
            order = list(np.argsort(-scores, kind="stable"))
            out[selector] = [order.index(b) if b < len(order) else None for b in blocks]
        row["own_topk"] = own_topk(t, point, blocks)
        row["ranks"] = out
        row["candidate_blocks"] = int(len(scores)) if scores is not None else 0

    tier.on_prompt_end = measure


def own_topk(tier, point: int, blocks: list[int]) -> dict:
    """How often the needle's blocks would be in a layer's own top-k, or a KV head's
    own top-k (quest scores), against the one selection all layers share: the
    fraction of layers (and of layer x head pairs) whose own choice holds them all."""
    import numpy as np

    from mlx_stream.recall import select

    nb = min(tier.stored, tier.evicted_blocks(point))
    empty = np.array([f >= tier.block for f in tier.first[:nb]])
    k, layer_hits, head_hits, heads = tier.spec.blocks, 0, 0, 0
    for i, q in enumerate(tier.recent_queries(point)):
        per_head = select.head_scores_summary(q, tier.summaries, i, nb, "quest", tier.scale,
                                              empty)  # fmt: skip
        chosen = set(select.top_k(per_head.max(0), k))
        layer_hits += all(b in chosen for b in blocks)
        for h in range(per_head.shape[0]):
            head_hits += all(b in set(select.top_k(per_head[h], k)) for b in blocks)
            heads += 1
    return {"layers": round(layer_hits / len(tier.layers), 3), "heads": round(head_hits / heads, 3)}


def render_questions(records: list[dict]) -> str:
    """Markdown: per haystack, needle and question, found / trials of the full cache
    (at the length it fits) and of recall under each prompt selector, with how often
    the prompt's end selected the needle's blocks."""
    rows = [r for r in records if r.get("bench") == "recall-needle"]
    selectors = sorted({r["prompt_selector"] for r in rows if r["cache"] == "recall"})
    cells: dict = {}
    for r in rows:
        key = (r["haystack"], r["kind"], r["question"])
        col = r["cache"] if r["cache"] != "recall" else f"recall:{r['prompt_selector']}"
        cells.setdefault(key, {}).setdefault(col, []).append(r)
    lengths = {c: sorted({r["length_asked"] for r in rows if r["cache"] == c}) for c in
               ("full", "recall")}  # fmt: skip
    head = [f"full cache, {'/'.join(map(str, lengths['full']))}"] + [
        f"recall {'/'.join(map(str, lengths['recall']))}, {s}: found, selected"
        for s in selectors]  # fmt: skip
    out = ["| haystack | needle | question | " + " | ".join(head) + " |",
           "|---|---|---|" + "---|" * len(head)]  # fmt: skip
    total: dict = {}
    for key in sorted(cells) + [None]:
        got = cells[key] if key is not None else total
        row = []
        for col in ["full"] + [f"recall:{s}" for s in selectors]:
            rs = got.get(col, [])
            if key is not None:
                total.setdefault(col, []).extend(rs)
            cell = f"{sum(r['found'] for r in rs)}/{len(rs)}" if rs else "—"
            if rs and col != "full":
                cell += f", {sum(r['needle_selected'] for r in rs)}/{len(rs)}"
            row.append(cell)
        name = " | ".join(key) if key is not None else "**all** | | "
        out.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(out)


def render(records: list[dict]) -> str:
    """Markdown: found / trials per length, needle and cache (with how often the
    needle's blocks were among those recalled), then the needle's rank per selector."""
    cells: dict = {}
    picked: dict = {}
    for r in records:
        if r.get("bench") != "recall-needle":
            continue
        key = (r.get("length_asked", r["length"]), r["kind"], r.get("haystack", "filler"))
        cells.setdefault(key, {}).setdefault(r["cache"], []).append(r["found"])
        if r["cache"] == "recall" and "needle_selected" in r:
            picked.setdefault(key, []).append(r["needle_selected"])
    out = ["| prompt tokens | needle | haystack | window alone | window + recall | full cache "
           "| needle's blocks recalled |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for key in sorted(cells):
        got = cells[key]
        row = [f"{sum(got[c])}/{len(got[c])}" if c in got else "—"
               for c in ("window", "recall", "full")]  # fmt: skip
        sel = picked.get(key)
        row.append(f"{sum(sel)}/{len(sel)}" if sel else "—")
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(row) + " |")
    ranked = [r for r in records if r.get("bench") == "recall-needle" and r.get("ranks")]
    if ranked:
        names = sorted({s for r in ranked for s in r["ranks"]})
        out += ["", "| prompt tokens | depth | candidate blocks | blocks k | "
                + " | ".join(f"rank, {n}" for n in names)
                + " | layers / KV heads whose own top-k holds it |",
                "|---|---|---|---|" + "---|" * len(names) + "---|"]  # fmt: skip
        for r in ranked:
            ranks = [",".join(str(x) for x in r["ranks"].get(n, [])) or "—" for n in names]
            own = r.get("own_topk")
            own = f"{own['layers']:.0%} / {own['heads']:.0%}" if own else "—"
            out.append(f"| {r['length']} | {r['depth']} | {r['candidate_blocks']} | "
                       f"{r['blocks']} | " + " | ".join(ranks) + f" | {own} |")  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    main_guard(main)
