"""A sublinear index over the block summaries (``RecallSpec.index="tree"``, numpy).

Every :data:`FANOUT` consecutive blocks of a layer form a *superblock* whose key minimum
and maximum are the elementwise minimum and maximum of its children's (host memory,
O(1) per block summarised, rebuilt when a store is loaded), so its Quest bound is at
least every child's. A refresh (the ``quest`` selector) scores the superblocks, expands
them best first by branch and bound until the ``shortlist`` best blocks under the
aggregate ``S`` are found exactly (or ``cap`` superblocks were expanded: counted in
``capped``), then reranks the expanded blocks with the flat scan's vote. ``S`` ranks
blocks only roughly as the vote does; blocks left out get ``-inf``, and the tier takes
the top ``k`` as for the flat scan. In full: docs/recall.md ("The tree index").
"""

from __future__ import annotations

import numpy as np

from mlx_stream.recall.select import KINDS, Summaries, group_queries, quest_logits

FANOUT = 64  # blocks per superblock


class Indexed(Summaries):
    """:class:`~mlx_stream.recall.select.Summaries` with superblocks (see the module
    docstring); the superblock tables count in host memory (``host_bytes``, ``used``).

    Args:
        layers, kinds, ram_bytes, folder: As for ``Summaries``.
        shortlist (int): Blocks the tree search keeps for the rerank.
        cap (int): Superblocks one search expands at most (``0``: no cap).
        fanout (int): Blocks per superblock. Default: :data:`FANOUT`.
    """

    def __init__(self, layers: int, kinds: tuple[str, ...] = KINDS, ram_bytes: int = 1 << 62,
                 folder: str | None = None, shortlist: int = 64, cap: int = 0,
                 fanout: int = FANOUT):  # fmt: skip
        super().__init__(layers, kinds, ram_bytes, folder)
        self.fanout = int(fanout)
        self.shortlist, self.cap = int(shortlist), int(cap)
        self.bounds = [np.zeros((0, 2, 0, 0), np.float32) for _ in range(layers)]
        self.scored = None  # what the last search scored (superblocks + blocks)
        self.found = None  # the last search's top ``shortlist`` blocks by S
        self.searches, self.capped = 0, 0  # searches, and those the cap stopped
        self.searching = True  # False: refreshes scan every block (a measurement's flat)

    @property
    def has_tree(self) -> bool:
        """Whether the selectors read the minima and maxima the superblocks bound."""
        return "lo" in self.kinds and "hi" in self.kinds

    @property
    def searches_quest(self) -> bool:
        """Whether a ``quest`` refresh searches the tree (else it scans every block)."""
        return self.searching and self.has_tree

    # ----- superblocks ----------------------------------------------------------------

    def _merge(self, layer: int, start: int, stop: int) -> None:
        """Fold blocks ``start .. stop - 1`` (one superblock's) into their superblock;
        a superblock's first block starts it afresh."""
        s = start // self.fanout
        bounds = self.bounds[layer]
        if s >= len(bounds):  # grow (doubling): the new room counts as host memory
            H, D, _ = self.shape
            grown = np.zeros((max(4, 2 * len(bounds), s + 1), 2, H, D), np.float32)
            if len(bounds):
                grown[: len(bounds)] = bounds
            self.host_bytes += grown.nbytes - bounds.nbytes
            bounds = self.bounds[layer] = grown
        lo = self.table("lo", layer, stop, start).min(0)
        hi = self.table("hi", layer, stop, start).max(0)
        if start % self.fanout:
            lo, hi = np.minimum(lo, bounds[s, 0]), np.maximum(hi, bounds[s, 1])
        bounds[s, 0], bounds[s, 1] = lo, hi

    def _rebuild(self, layer: int) -> None:
        count = self.count[layer]
        for start in range(0, count, self.fanout):
            self._merge(layer, start, min(count, start + self.fanout))

    def add(self, layer: int, j: int, keys) -> None:
        super().add(layer, j, keys)
        if self.has_tree:
            self._merge(layer, j, j + 1)

    def forget(self, layer: int, blocks: int) -> None:
        cut = blocks < self.count[layer] and blocks % self.fanout
        super().forget(layer, blocks)
        if self.has_tree and cut:
            start = blocks // self.fanout * self.fanout
            self._merge(layer, start, blocks)

    def restore(self, reader, data: dict) -> None:
        super().restore(reader, data)
        for layer in range(self.layers if self.has_tree else 0):
            self._rebuild(layer)

    def upgrade(self, reader, data: dict, count: list[int], keys: tuple) -> None:
        super().upgrade(reader, data, count, keys)
        for layer in range(self.layers if self.has_tree else 0):
            self._rebuild(layer)

    def forget_arrays(self) -> None:
        super().forget_arrays()
        self.host_bytes -= sum(b.nbytes for b in self.bounds)
        self.bounds = [np.zeros((0, 2, 0, 0), np.float32) for _ in range(self.layers)]

    def used(self) -> tuple[int, int]:
        """``(ram, disk)`` of ``Summaries.used`` plus the superblocks that hold blocks."""
        ram, disk = super().used()
        if self.shape is not None and self.has_tree:
            H, D, _ = self.shape
            ram += sum(-(-c // self.fanout) for c in self.count) * 2 * H * D * 4
        return ram, disk

    # ----- the search -------------------------------------------------------------------

    def _logits(self, g: np.ndarray, scale: float, layer: int, start: int, stop: int):
        """Scaled quest bounds ``(H, R, stop - start)`` of blocks ``start .. stop - 1``."""
        lo, hi = self.table("lo", layer, stop, start), self.table("hi", layer, stop, start)
        return quest_logits(g, lo, hi) * np.float32(scale)

    def upper(self, grouped: list[np.ndarray], scale: float, supers: int):
        """``(U, offsets)``: ``U`` of superblocks ``0 .. supers - 1`` (:meth:`key` of
        their bounds: at least every child's) and every layer's ``offsets`` ``(H, R)``:
        per (KV head, query row) the log-sum-exp of the superblocks' bounds (at least
        the log of the row's softmax denominator over all blocks)."""
        logits = []
        for layer, g in enumerate(grouped):
            b = self.bounds[layer][:supers]
            logits.append(quest_logits(g, b[:, 0], b[:, 1]) * np.float32(scale))
        offsets = [
            np.logaddexp.reduce(x, axis=-1) + np.float32(np.log(self.fanout)) for x in logits
        ]
        return self.key(logits, offsets), offsets

    @staticmethod
    def key(logits: list[np.ndarray], offsets: list[np.ndarray]) -> np.ndarray:
        """The vote with fixed denominators: the sum over layers of the largest
        ``exp(logit - offset)`` over (KV head, query row); monotone in every logit."""
        total = np.zeros(logits[0].shape[-1], np.float32)
        for x, off in zip(logits, offsets):
            total += np.exp((x - off[..., None]).max(axis=(0, 1)))
        return total

    def raw(self, grouped: list[np.ndarray], scale: float, start: int, stop: int,
            offsets: list[np.ndarray]):  # fmt: skip
        """``(S, logits)`` of blocks ``start .. stop - 1``: their :meth:`key` and every
        layer's scaled bounds (``grouped``: every layer's queries as
        :func:`~mlx_stream.recall.select.group_queries` groups them)."""
        logits = [self._logits(g, scale, i, start, stop) for i, g in enumerate(grouped)]
        return self.key(logits, offsets), logits

    def search(self, queries: list[np.ndarray], nb: int, empty: np.ndarray,
               scale: float) -> np.ndarray:  # fmt: skip
        """Blocks ``0 .. nb - 1``'s scores: the expanded blocks' vote, ``-inf`` for the
        rest (``queries[i]``: layer ``i``'s ``(Hq, L, D)``; ``empty``: blocks with no
        token of their own). Sets ``scored``; counts ``searches`` and ``capped``."""
        H = self.shape[0]
        grouped = [group_queries(q.astype(np.float32), H) for q in queries]
        supers = -(-nb // self.fanout)
        U, offsets = self.upper(grouped, scale, supers)
        found, values, expanded, threshold = [], [], 0, -np.inf
        # per layer and (KV head, query row): the largest logit and the softmax's sum
        # under it, over the blocks scored (the flat scan's arithmetic: ties agree)
        z = [(np.full(off.shape, -np.inf, np.float32), np.zeros(off.shape, np.float32))
             for off in offsets]  # fmt: skip
        M = self.shortlist
        for s in np.argsort(-U, kind="stable"):
            # every block of s has S <= U[s] (a margin for rounding)
            if U[s] * (1 + 1e-4) < threshold:  # -inf until M blocks were found
                break
            if self.cap and expanded >= self.cap:
                self.capped += 1
                break
            start, stop = s * self.fanout, min(nb, (s + 1) * self.fanout)
            S, logits = self.raw(grouped, scale, start, stop, offsets)
            keep = ~empty[start:stop]
            for i, x in enumerate(logits):
                if keep.any():
                    z[i] = _fold(*z[i], x[..., keep])
            found.append(np.arange(start, stop)[keep])
            values.append(S[keep])
            expanded += 1
            if sum(len(f) for f in found) >= M:
                threshold = np.partition(np.concatenate(values), -M)[-M]
        self.searches += 1
        blocks, S = np.concatenate(found or [[]]).astype(int), np.concatenate(values or [[]])
        self.scored = supers + len(blocks)
        order = np.lexsort((blocks, -S))[:M]  # by S, ties to the earlier block
        self.found = np.sort(blocks[order])  # the top M by S (a flat scan's: tests)
        return self._rerank(grouped, scale, nb, np.sort(blocks), z)

    def top(self, queries: list[np.ndarray], nb: int, empty: np.ndarray,
            scale: float) -> np.ndarray:  # fmt: skip
        """The shortlist :meth:`search` reranks, as a flat scan of ``S`` would find it
        (for tests and measurements: every block scored)."""
        grouped = [group_queries(q.astype(np.float32), self.shape[0]) for q in queries]
        _, offsets = self.upper(grouped, scale, -(-nb // self.fanout))
        S = np.concatenate([self.raw(grouped, scale, a, min(nb, a + self.fanout), offsets)[0]
                            for a in range(0, nb, self.fanout)] or [[]])  # fmt: skip
        S = np.where(empty, -np.inf, S)
        order = np.lexsort((np.arange(nb), -S))[: self.shortlist]
        return np.sort(order[np.isfinite(S[order])])

    def _rerank(self, grouped: list[np.ndarray], scale: float, nb: int, short: np.ndarray,
                z: list[np.ndarray]) -> np.ndarray:  # fmt: skip
        """The flat scan's vote of the ``short`` blocks, each row's softmax denominator
        ``z`` (:func:`_fold`) summed over the blocks the search scored (all blocks:
        the flat's)."""
        out = np.full(nb, -np.inf)
        if not len(short):
            return out
        runs = {}  # superblock -> its shortlisted blocks
        for j in short:
            runs.setdefault(int(j) // self.fanout, []).append(int(j))
        total = np.zeros(len(short))
        for layer, g in enumerate(grouped):
            x = np.concatenate([self._logits(g, scale, layer, js[0], js[-1] + 1)[..., np.array(js) - js[0]]
                                for js in runs.values()], axis=-1)  # fmt: skip
            top, sums = z[layer]
            total += (np.exp(x - top[..., None]) / sums[..., None]).max(axis=(0, 1))
        out[short] = total
        return out


def _fold(top: np.ndarray, sums: np.ndarray, x: np.ndarray):
    """``(top, sums)`` with the logits ``x`` ``(..., blocks)`` folded in: the largest
    logit and the sum of ``exp(logit - top)`` (an online softmax denominator)."""
    new = np.maximum(top, x.max(-1))
    rescale = np.where(np.isfinite(top), np.exp(top - new), 0).astype(np.float32)
    return new, sums * rescale + np.exp(x - new[..., None]).sum(-1)


def summaries_for(spec, layers: int, kinds: tuple[str, ...], ram_bytes: int) -> Summaries:
    """The tier's index of ``spec`` (a ``RecallSpec``): superblocks for ``"tree"``."""
    if spec.index == "tree":
        return Indexed(layers, kinds, ram_bytes, spec.folder, spec.shortlist_blocks, spec.expand)
    return Summaries(layers, kinds, ram_bytes, spec.folder)


def scored(summaries: Summaries, total: np.ndarray) -> int:
    """Blocks (and superblocks) the refresh that gave ``total`` scored."""
    n = getattr(summaries, "scored", None)
    if n is None:
        return int(np.isfinite(total).sum())
    summaries.scored = None
    return n
