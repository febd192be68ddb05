"""Rank the needle's blocks in saved prompt ends under several selectors, offline.

``recall.py --dump DIR`` saves what a prompt's end reads (every layer's queries of
the prompt's last block, every candidate block's stored keys, the needle's place);
prefilling a 16k-token book takes minutes here, scoring it again takes a second, so
selectors are compared on the same dumps without feeding anything again. Per dump
and selector: the rank of the needle's best block (0: the best block) and whether
the top ``k`` holds one of its blocks. Selectors: ``quest`` (each block's per-channel
bound, the boundary refreshes' selector), ``token`` and ``exact`` (every stored key:
a block's largest single-token probability, its softmax mass;
``mlx_stream.recall.score``). And per selector, whether every block of the needle is
chosen: with the ``k`` best, and in pairs (each block with its better neighbour: a
prompt's end, ``select.with_neighbours``). ``--balls``: a first pass that reads a fixed
number of keys, chosen by k-means balls' bounds (:func:`balls`), and what it costs.
``seconds``: each selector's wall time on the dump (its keys read from memory).

    python benchmarks/recall.py --haystack alice_in_wonderland --length 16384 \\
        --kinds passkey --questions q0,q1,q2 --caches recall --dump dumps/
    python benchmarks/recall_offline.py dumps/ --balls 4:64:64:1024:24

The two-pass ``token`` scans (``--stages``) and the ``tree`` index's searches (``--tree``)
were removed with those options after their comparisons (benchmarks/README.md).
"""

from __future__ import annotations

import time
from pathlib import Path

from common import base_parser, base_record, emit, main_guard  # first: preloads OpenBLAS

SELECTORS = ("quest", "token", "exact")


def load(path: Path) -> dict:
    """A dump's arrays: ``queries`` and ``keys`` per layer (float32), ``first``,
    ``block``, ``scale`` and the needle's blocks."""
    import numpy as np

    d = np.load(path)
    layers = sum(1 for k in d.files if k.startswith("q"))
    block = int(d["block"])
    at, n, _ = (int(x) for x in d["needle"])
    return {"queries": [d[f"q{i}"].astype(np.float32) for i in range(layers)],
            "keys": [d[f"k{i}"].astype(np.float32) for i in range(layers)],
            "first": [int(f) for f in d["first"]], "block": block,
            "scale": float(d["scale"]), "needle": sorted({at // block, (at + n - 1) // block})}  # fmt: skip


def scores(dump: dict, selector: str):
    """Every candidate block's score under ``selector`` (``-inf``: not a candidate), by
    the tier's own ``score.block_scores`` (``quest``: the summaries a store keeps, built
    from the dumped keys), and the seconds ``block_scores`` took (the summaries'
    building left out)."""
    import mlx.core as mx

    from mlx_stream.recall import score, select

    first, bs, keys = dump["first"], dump["block"], dump["keys"]
    summaries = None
    if selector == "quest":
        summaries = select.Summaries(len(keys), select.kinds_for("quest"))
        for layer, k in enumerate(keys):
            for j, f in enumerate(first):
                if f < bs:
                    summaries.add(layer, j, k[j][:, f:])

    class Dumped:  # the dump's keys, read as a BlockStore's
        def get(self, layer: int, j: int):
            return mx.array(keys[layer][j])[None], None

    tic = time.perf_counter()
    total = score.block_scores(selector, dump["queries"], Dumped(), summaries, first, bs,
                               dump["scale"])  # fmt: skip
    return total, round(time.perf_counter() - tic, 3)


def rank(total, needle: list[int]) -> int | None:
    import numpy as np

    order = list(np.argsort(-total, kind="stable"))
    found = [order.index(b) for b in needle if b < len(order) and np.isfinite(total[b])]
    return min(found) if found else None


def kmeans(x, clusters: int, iters: int = 10):
    """Lloyd's k-means of ``x`` ``(N, D)`` from an evenly strided start (by hand: a few
    lines, and no dependency has one): per cluster its centroid and radius (its farthest
    member's distance), and each row's cluster."""
    import numpy as np

    c = x[np.linspace(0, len(x) - 1, clusters).astype(int)].copy()
    for _ in range(iters):
        a = np.argmin((c * c).sum(1)[None] - 2 * x @ c.T, 1)
        for j in range(clusters):
            if (a == j).any():
                c[j] = x[a == j].mean(0)
    a = np.argmin((c * c).sum(1)[None] - 2 * x @ c.T, 1)
    radius = np.zeros(clusters)
    np.maximum.at(radius, a, np.linalg.norm(x - c[a], axis=1))
    return c, radius, a


def balls(dump: dict, stride: int, segment: int, clusters: int, budget: int, keep: int):
    """A first pass that reads a few keys instead of every one: per ``stride``-th layer
    and KV head, each ``segment`` of blocks' keys cut into ``clusters`` balls (k-means:
    a centroid and a radius); a query row's logit with any key of a ball is at most its
    logit with the centroid plus its norm times the radius, so the balls are read best
    bound first until ``budget`` keys per head are read. A block's score in a layer is
    the largest probability one of its read keys gets (the softmax normaliser: the read
    keys exactly, every unread ball as its size times its centroid's probability);
    the ``keep`` best over those layers are ranked with every layer, as ``token-S-M``.
    Returns the scores and what they cost: ``read``, the share of the scanned layers'
    keys read; ``work``, the keys and centroids a query row meets over the flat scan's
    (every key of every layer); ``reranked``, the blocks every layer ranks."""
    import numpy as np

    from mlx_stream.recall import score

    first, bs, scale = dump["first"], dump["block"], dump["scale"]
    nb = len(first)
    valid = (np.arange(bs)[None] >= np.array(first)[:, None]).reshape(-1)
    pre, read, dots = np.zeros(nb), 0, 0
    layers = range(0, len(dump["keys"]), stride)
    for li in layers:
        keys, q = dump["keys"][li], dump["queries"][li]  # keys: (blocks, H, block, D)
        g = q.reshape(keys.shape[1], -1, q.shape[-1])  # each KV head's query heads side by side
        peak = np.zeros(nb)
        for h in range(keys.shape[1]):
            x = keys[:, h].reshape(-1, keys.shape[-1])
            cen, rad, members = [], [], []
            for s0 in range(0, nb, segment):
                tok = np.arange(s0 * bs, min(nb, s0 + segment) * bs)
                tok = tok[valid[tok]]
                if not len(tok):  # a segment of blocks with no token of their own
                    continue
                c, r, a = kmeans(x[tok], min(clusters, len(tok)))
                cen.append(c)
                rad.append(r)
                members += [tok[a == j] for j in range(len(c))]
            cen, rad = np.concatenate(cen), np.concatenate(rad)
            near = g[h] @ cen.T  # (rows, balls)
            bound = (near + np.linalg.norm(g[h], axis=1)[:, None] * rad[None]).max(0)
            order, n, taken = np.argsort(-bound, kind="stable"), 0, 0
            while taken < len(order) and n < budget:
                n += len(members[order[taken]])
                taken += 1
            idx = np.concatenate([members[j] for j in order[:taken]])
            rest = order[taken:]
            logits = g[h] @ x[idx].T * scale
            guess = near[:, rest] * scale + np.log([max(len(members[j]), 1) for j in rest])
            norm = np.logaddexp.reduce(np.concatenate([logits, guess], 1), axis=1, keepdims=True)
            np.maximum.at(peak, idx // bs, np.exp(logits - norm).max(0))
            read += len(idx)
            dots += len(idx) + len(cen)
        pre += peak
    own = {j for j, f in enumerate(first) if f < bs}  # blocks with a token of their own
    best = np.argsort(-pre, kind="stable")[:keep]  # with their neighbours: a fact cut in two
    chosen = sorted({int(j) + d for j in best for d in (-1, 0, 1)} & own)
    out = np.full(nb, -np.inf)
    out[chosen] = score.peak_scores(dump["queries"], lambda i, js: dump["keys"][i][js],
                                    chosen, first, bs, scale)  # fmt: skip
    heads, flat = dump["keys"][0].shape[1], valid.sum() * len(dump["keys"])
    dots += heads * len(dump["keys"]) * valid.reshape(nb, bs)[chosen].sum()
    return out, {"read": read / (valid.sum() * heads * len(layers)),
                 "work": dots / (flat * heads), "reranked": len(chosen)}  # fmt: skip


def whole_needle(total, needle: list[int], k: int) -> dict:
    """Whether every block of the needle is chosen: with the ``k`` best (``top_k``) and
    in pairs (``pairs``: ``mlx_stream.recall.select.with_neighbours``, a prompt's end)."""
    from mlx_stream.recall import select

    picks = {"top_k": select.top_k(total, k), "pairs": select.with_neighbours(total, k)}
    return {name: all(b in chosen for b in needle) for name, chosen in picks.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("dumps", type=Path, help="a folder of recall.py --dump files")
    parser.add_argument("--blocks", type=int, default=8, help="k: the blocks recalled")
    parser.add_argument("--balls", default="",
                        help="ball first passes, STRIDE:SEGMENT:CLUSTERS:BUDGET:KEEP,...")  # fmt: skip
    args = parser.parse_args(argv)

    def specs(flag: str, value: str, least: tuple[int, ...]) -> list[tuple[int, ...]]:
        """``A:B:...,A:B:...`` as tuples of integers, each at least its ``least``; or
        one line naming the bad one."""
        out = []
        for spec in filter(None, value.split(",")):
            parts = spec.split(":")
            if len(parts) != len(least) or not all(
                p.isdigit() and int(p) >= m for p, m in zip(parts, least, strict=True)
            ):
                parser.error(f"{flag} {spec!r}: expected integers at least {least}")
            out.append(tuple(int(p) for p in parts))
        return out

    probes = specs("--balls", args.balls, (1, 1, 1, 1, 1))
    files = sorted(args.dumps.glob("*.npz"))
    if not files:
        raise SystemExit(f"{args.dumps}: no .npz dumps (recall.py --dump)")
    records, ranks, wholes = [], {}, {}
    for path in files:
        dump = load(path)
        timed = {name: scores(dump, name) for name in SELECTORS}
        totals = {name: total for name, (total, _) in timed.items()}
        seconds = {name: s for name, (_, s) in timed.items()}
        costs = {}
        for probe in probes:
            name = "balls-" + "-".join(map(str, probe))
            totals[name], cost = balls(dump, *probe)
            costs[name] = {key: round(float(v), 4) for key, v in cost.items()}
        row = {name: rank(total, dump["needle"]) for name, total in totals.items()}
        whole = {name: whole_needle(total, dump["needle"], args.blocks)
                 for name, total in totals.items()}  # fmt: skip
        for name in totals:
            ranks.setdefault(name, []).append(row[name])
            wholes.setdefault(name, []).append(whole[name])
        records.append(emit(base_record("recall-offline", "dump", "-", dump=path.name,
                                        candidates=len(dump["first"]), ranks=row,
                                        whole=whole, cost=costs,
                                        seconds=seconds),
                               args.out))  # fmt: skip
    summary = {name: {"in_top_k": sum(r is not None and r < args.blocks for r in rs),
                      "dumps": len(rs), "ranks": sorted(r for r in rs if r is not None),
                      "whole_top_k": sum(w["top_k"] for w in wholes[name]),
                      "whole_pairs": sum(w["pairs"] for w in wholes[name])}
               for name, rs in ranks.items()}  # fmt: skip
    records.append(emit(base_record("recall-offline-summary", "dump", "-", k=args.blocks,
                                    selectors=summary), args.out))  # fmt: skip
    return records


if __name__ == "__main__":
    main_guard(main)
