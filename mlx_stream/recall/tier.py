"""The recall tier's runtime (one ``Recall`` per model cache, shared by its SinkCache
layers): evicted blocks stored, selected by the queries at block boundaries and at a
prompt's end, attended again from a fixed device region; exact under rollback, save
and load. Supported: batch 1, ``positions="cache"``, keys roped on all dims.
Design: docs/recall.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

import mlx_stream.recall.reuse as reuse
import mlx_stream.recall.score as score
import mlx_stream.recall.select as select
from mlx_stream.cache import storage as kvstore
from mlx_stream.cache.hooks import Hooks
from mlx_stream.errors import RuntimeFailure, Unsupported, UserError
from mlx_stream.recall.region import Regions
from mlx_stream.recall.spec import (
    PLACEMENT,
    PLACEMENT_AT_PROMPT_END,
    PROMPT_SELECTOR,
    REFEED,
    SELECTOR,
    RecallSpec,
)
from mlx_stream.recall.store import BlockStore, load_queries, save_queries

HISTORY = 16  # selections kept for rollback (a rollback reaches slack + 1 tokens back)


@dataclass(frozen=True)
class Mark:
    """What a checkpoint of a tier's caches keeps of the tier (:meth:`Recall.mark`):
    the selection history, the blocks stored per layer and the queries the next
    refresh reads. Never the store itself (GBs on disk): blocks before the checkpoint
    are the same tokens in every timeline that branches from it."""

    history: tuple
    blocks: tuple[int, ...]
    queries: tuple
    shortlist: reuse.State | None = None


class Recall(Hooks):
    """The recall tier of one model cache (see the module docstring): the client
    (``mlx_stream.cache.hooks``) of its SinkCache layers.

    Args:
        spec (RecallSpec): The policy.
        caches (list): The model's prompt cache; its SinkCache layers get this tier.
    """

    what = "a recall tier"
    attends = True  # it attends over the retrieved region and the window together

    def __init__(self, spec: RecallSpec, caches: list):
        from mlx_stream.cache.sink import SinkCache

        self.spec, self.block = spec, spec.block
        self.layers = [c for c in caches if isinstance(c, SinkCache)]
        if any(c.channel_keys for c in self.layers):  # its blocks cannot be cut out of them
            raise Unsupported(
                "recall does not serve 4-bit keys (kept per channel): use 8-bit keys "
                "(--kv-key-bits 8) or a float cache"
            )
        for i, c in enumerate(self.layers):
            c.attach(self, i)
            c.rolls_back = True  # a prompt's end rolls back: keep what a rebase moved
        L = len(self.layers)
        # One RAM budget: the index (block summaries, read at every refresh) takes up to
        # its share, the blocks the rest; past its part each spills to files
        kinds = select.kinds_for(SELECTOR, PROMPT_SELECTOR)
        index_ram = int(spec.ram_bytes * select.INDEX_SHARE) if kinds else 0
        self.store = BlockStore(L, spec.block, spec.bits, spec.group_size,
                                spec.ram_bytes - index_ram, spec.folder)  # fmt: skip
        self.summaries = select.Summaries(L, kinds, index_ram, spec.folder)
        self.shortlist = reuse.Shortlist.of(spec.blocks)  # None: every refresh scans all
        self.first = []  # per block: its first token that belongs to it (sinks excluded)
        # (refresh point, selection, hold): the last one is current; no boundary
        # refresh replaces it at a boundary <= hold (a prompt's end fed again)
        self.history = [(0, (), 0)]
        self.queries = [[] for _ in range(L)]  # per layer: (first token, queries, anchor)
        self.region = Regions(self)  # per layer: the selected blocks, on the device
        self.region.reserve(self.layers)
        self.scale = None
        self.refreshes, self.scored_blocks, self.refresh_seconds = 0, 0, 0.0
        self.on_prompt_end = None  # called with (tier, token) after a prompt-end refresh
        self.closed = False  # its store freed (close): its caches cannot be restored

    # ----- numbers ------------------------------------------------------------------

    @property
    def selection(self) -> tuple[int, ...]:
        return self.history[-1][1]

    @property
    def refreshed_at(self) -> int:
        return self.history[-1][0]

    @property
    def region_slots(self) -> int:
        return self.spec.blocks * self.block

    @property
    def device_nbytes(self) -> int:
        """Bytes of the retrieval regions (device memory, fixed once allocated)."""
        return self.region.nbytes

    @property
    def store_nbytes(self) -> int:
        """Bytes of the store and its index (host memory and files), reserved."""
        return self.store.nbytes + self.summaries.nbytes

    def usage(self) -> dict[str, int]:
        """The tier's counters in the CLI's vocabulary: blocks ``stored`` and
        ``recalled`` (in attention now); the bytes used by the stored blocks
        (``block_bytes``) and by their index (the block summaries: ``index_bytes``),
        split by place: host memory (``ram_bytes``, at most the spec's ``ram_bytes``)
        and files (``disk_bytes``; ``ram_bytes + disk_bytes == block_bytes +
        index_bytes``); the room reserved for both, a segment at a time
        (``reserved_bytes`` = ``ram_reserved_bytes`` + ``disk_reserved_bytes``); the
        device region (``region_bytes``: reserved once, fixed); the blocks the last
        refresh scored (``scored_blocks``) and the seconds every refresh took
        together (``refresh_seconds``); the refreshes that scanned every block and
        those that read the shortlist (``index_scans``, ``index_reuses``)."""
        store, summaries = self.store, self.summaries
        (ram, disk), (iram, idisk) = store.used(), summaries.used()
        if self.shortlist is not None:
            counters = {"index_scans": self.shortlist.scans, "index_reuses": self.shortlist.reuses}
        else:
            counters = {}
        return {
            "stored_blocks": self.stored,
            "recalled_blocks": len(self.selection),
            "scored_blocks": self.scored_blocks,
            "ram_bytes": ram + iram,
            "disk_bytes": disk + idisk,
            "block_bytes": ram + disk,
            "index_bytes": iram + idisk,
            "reserved_bytes": self.store_nbytes,
            "ram_reserved_bytes": store.host_bytes + summaries.host_bytes,
            "disk_reserved_bytes": store.disk_bytes + summaries.disk_bytes,
            "region_bytes": self.device_nbytes,
            "refresh_seconds": round(self.refresh_seconds, 3),
            **counters,
        }

    @staticmethod
    def anchor(cache, n: int) -> int:
        """Position of the first sink for a call at token ``n`` (the region ends there)."""
        base, sink_start = cache.ring.layout(n)
        return sink_start - base

    # ----- the cache's hooks ----------------------------------------------------------

    def before_write(self, cache, n: int, N: int) -> None:
        """At the start of a call of ``N`` tokens at ``n``, after the cache's layout
        is applied and before anything is written."""
        if cache.hook_index == 0:  # before anything changes: a full disk stops here
            self.reserve(cache, n)
        if (cache.hook_index == 0 and n % self.block == 0 and n != self.refreshed_at
                and n > self.history[-1][2]):  # fmt: skip
            self.refresh(n)  # from blocks every layer stored at earlier boundaries
        self._capture(cache, n)
        self.build_region(cache, n)

    def trimmed(self, cache, keep: int) -> None:
        """The cache forgot every token from ``keep`` on."""
        i = cache.hook_index
        kept = []
        for t0, q, a in self.queries[i]:
            if t0 < keep:
                kept.append((t0, q[:, :, : keep - t0, :] if t0 + q.shape[2] > keep else q, a))
        self.queries[i] = kept
        self.store.forget(i, keep // self.block)  # blocks wholly before keep stay true
        self.summaries.forget(i, keep // self.block)
        if i == 0:
            while len(self.history) > 1 and self.history[-1][0] > keep:
                self.history.pop()
            if self.shortlist is not None:  # blocks it scanned were forgotten: scan again
                self.shortlist.forget(keep // self.block)

    def mark(self) -> Mark:
        """What :meth:`rewind` needs to bring the tier back to its caches as they are
        now (take it with a copy of them: a SinkCache's deep copy shares its tier)."""
        return Mark(tuple(self.history), tuple(self.store.count),
                    tuple(tuple(q) for q in self.queries),
                    self.shortlist.state if self.shortlist else None)  # fmt: skip

    def rewind(self, caches: list, mark: Mark | None = None) -> None:
        """Bring the tier back to ``caches``: copies of its caches that were restored,
        or that ran on while these did not. With the ``mark`` taken with them, the
        tier is as it was then (its store back to that many blocks, its selections
        and queries back); without, its own rollback to their token count (queries,
        stored blocks and selections past it). Regions are rebuilt from the store at
        the next call."""
        from mlx_stream.cache.sink import SinkCache

        self.layers = [c for c in caches if isinstance(c, SinkCache)]
        if mark is not None:
            self.history = list(mark.history)
            self.queries = [list(q) for q in mark.queries]
            if self.shortlist is not None:
                self.shortlist.state = mark.shortlist
            for i, blocks in enumerate(mark.blocks):
                self.store.forget(i, blocks)
                self.summaries.forget(i, blocks)
        for c in self.layers:
            self.trimmed(c, c.tokens_seen)
        self.region.reset()

    # ----- store ----------------------------------------------------------------------

    @property
    def stored(self) -> int:
        """Blocks stored in every layer."""
        return self.store.blocks()

    def reserve(self, cache, n: int) -> None:
        """Allocate the store segments the call at token ``n`` fills in any layer (the
        first layer's ``cache`` gives the shapes before the first block), so a store
        that cannot grow fails before a layer of the call has stored anything.

        Raises:
            RuntimeFailure: The store folder cannot be written (a full disk).
        """
        count = self.evicted_blocks(n // self.block * self.block)
        if count <= min(self.store.count, default=0) or cache.keys is None:
            return
        if self.store.shapes is None:  # what _gather hands the store: float, this dtype
            g = cache.kv_group_size
            one = [kvstore.unpack(kvstore.get(b, 0, 1), bits, g)
                   for b, bits in ((cache.keys, cache.key_bits), (cache.values, cache.value_bits))]  # fmt: skip
            self.store.shapes = tuple((x.shape[1], x.shape[-1], x.dtype) for x in one)
        self.store.reserve(count)
        self.summaries.setup(*self.store.shapes[0])  # the keys it summarises
        self.summaries.reserve(count)

    def evicted_blocks(self, n: int) -> int:
        """Blocks no row of a call at ``n`` can see (each wholly before its window)."""
        return max(0, (n - self.layers[0].window + 1) // self.block)

    def _capture(self, cache, n: int) -> None:
        """Store this layer's blocks that were wholly past the window at the last
        block boundary ``<= n``. Only at boundaries, each layer in its own layout of
        that call: what is stored never depends on how calls split the stream (a
        quantized ring re-quantizes what a rebase moves)."""
        i, bs, S = cache.hook_index, self.block, cache.sinks
        count = self.evicted_blocks(n // bs * bs)
        for j in range(self.store.count[i], count):
            lo, hi = max(j * bs, S), (j + 1) * bs
            first = min(lo - j * bs, bs)
            keys, values = self._gather(cache, lo, hi)
            if cache.moving and cache.move is not None:
                keys = cache.move(keys, cache.layout.base - j * bs)  # block-relative
            if first:
                keys, values = (_pad_front(x, first, bs) for x in (keys, values))
            self.store.put(i, j, keys, values, first)
            valid = keys[0, :, first:, :]
            self.summaries.add(i, j, valid if valid.shape[1] else mx.zeros_like(keys[0, :, :1, :]))
            if j == len(self.first):
                self.first.append(first)

    def _gather(self, c, lo: int, hi: int) -> tuple[mx.array, mx.array]:
        """Tokens ``lo:hi`` of layer cache ``c`` as float keys and values (zeros of
        one slot when the block is all sinks)."""
        got = c.tokens(lo, hi)
        if got is None:
            raise RuntimeFailure(
                f"recall: tokens {lo}-{hi - 1} were overwritten before they were stored "
                "(a call crossed too many tokens at once; feed at most max_call_tokens())"
            )
        return got

    # ----- selection --------------------------------------------------------------------

    def refresh_now(self, candidates_at: int | None = None) -> None:
        """Refresh the selection at the current token (the end of a prompt); with
        ``candidates_at``, only from blocks no row from that token on can see."""
        n = self.layers[0].tokens_seen
        if n != self.refreshed_at:
            self.refresh(n, candidates_at, PROMPT_SELECTOR, True)
            if self.on_prompt_end is not None:
                self.on_prompt_end(self, n)

    def prompt_end(self, model, caches: list, fed) -> None:
        """At the end of a prompt (``fed``: its tokens fed so far, all but the last):
        refresh the selection from the prompt's last queries, then roll ``caches``
        back to the start of the prompt's last ``REFEED`` blocks and feed those
        tokens again, attending to what the prompt chose (the question's own tokens
        then see the blocks it recalls; a boundary refresh does not replace that
        selection before the prompt's end). The candidates are then the blocks no
        re-fed row can see in its window (none is attended twice)."""
        from mlx_stream.cache.sink import max_call_tokens

        n = self.layers[0].tokens_seen
        if n == self.refreshed_at:
            return
        bs = self.block
        start = max((n - 1) // bs * bs - (REFEED - 1) * bs, n - len(fed), 0)
        refeed = start < n and all(c.is_trimmable() for c in caches)
        self.refresh_now(start if refeed else None)
        if self.refreshed_at != n:
            return  # nothing to choose from yet
        sel = self.selection
        if not sel or not refeed:
            return
        for c in caches:
            c.trim(n - start)
        self.history.append((start, sel, n))
        tokens = fed[len(fed) - (n - start) :]
        while tokens.size:
            k = min(max_call_tokens(caches) or tokens.size, tokens.size)
            model(tokens[None, :k], cache=caches)
            mx.eval([c.state for c in caches])
            tokens = tokens[k:]

    def recent_queries(self, point: int) -> list[np.ndarray | None]:
        """Every layer's queries of the ``block`` tokens before ``point``, moved so a
        block-relative key ``t`` sits at position ``t`` right before the sinks. One
        rope call per run of calls with the same anchor and one evaluation for all
        layers: a decode block holds ``block`` one-token calls, and a call each and a
        sync per layer cost more than the scoring."""
        out = []
        for i, c in enumerate(self.layers):
            runs = []  # [anchor, rows...] of consecutive calls with the same anchor
            for t0, q, anchor in self.queries[i]:
                a, b = max(t0, point - self.block), min(t0 + q.shape[2], point)
                if a >= b:
                    continue
                if not runs or runs[-1][0] != anchor:
                    runs.append([anchor])
                runs[-1].append(q[:, :, a - t0 : b - t0, :])
            parts = []
            for anchor, *rows in runs:
                x = mx.concatenate(rows, axis=2) if len(rows) > 1 else rows[0]
                if c.moving and c.move is not None:
                    x = c.move(x, self.block - anchor)
                parts.append(x)
            out.append(mx.concatenate(parts, axis=2)[0].astype(mx.float32) if parts else None)
        mx.eval([x for x in out if x is not None])
        return [None if x is None else np.asarray(x) for x in out]

    def candidates(self, point: int, candidates_at: int | None = None) -> int:
        """Blocks a refresh for the calls from ``point`` (or ``candidates_at``) on
        chooses from: the stored ones no row of those calls can still see."""
        at = point if candidates_at is None else min(point, candidates_at)
        return min(self.stored, self.evicted_blocks(at))

    def scores(self, point: int, selector: str | None = None, candidates_at: int | None = None,
               only: np.ndarray | None = None) -> np.ndarray | None:  # fmt: skip
        """Every candidate block's score for the calls from ``point`` (or
        ``candidates_at``) on, from the queries before ``point`` (``selector``: a
        boundary's unless named; ``only``: those blocks, the rest ``-inf``: see
        ``score.block_scores``); ``None`` when there is no candidate or no query yet."""
        selector = selector or SELECTOR
        nb = self.candidates(point, candidates_at)
        recent = self.recent_queries(point) if nb and self.scale is not None else [None]
        if any(q is None for q in recent):
            return None
        return score.block_scores(selector, recent, self.store, self.summaries, self.first[:nb],
                                  self.block, self.scale, only)  # fmt: skip

    def refresh(self, point: int, candidates_at: int | None = None,
                selector: str | None = None, neighbours: bool = False) -> None:  # fmt: skip
        """Choose the blocks for the calls from ``point`` (or ``candidates_at``) on,
        from the queries before ``point`` (with ``neighbours``, in pairs:
        ``select.with_neighbours``); count the blocks scored and the time. A ``quest``
        or ``mean`` refresh scores the shortlist, or every block when its turn to scan
        has come (``mlx_stream.recall.reuse``)."""
        tic = time.perf_counter()
        selector = selector or SELECTOR
        short = self.shortlist if selector in ("quest", "mean") else None
        only = short.candidates(self.candidates(point, candidates_at)) if short else None
        total = self.scores(point, selector, candidates_at, only)
        if total is not None and short is not None:
            short.scored(total, full=only is None)
        self.refresh_seconds += time.perf_counter() - tic
        if total is None:
            return
        self.scored_blocks = int(np.isfinite(total).sum())
        pick = select.with_neighbours if neighbours else select.top_k
        chosen = pick(total, self.spec.blocks)
        if self.shortlist is not None and short is None:
            self.shortlist.include(chosen)
        self.history = [*self.history[-HISTORY:], (point, chosen, point)]
        self.refreshes += 1

    # ----- region and attention ---------------------------------------------------------

    def region_anchor(self, cache, n: int) -> int:
        """Position the region ends at for a call at token ``n``: the first sink's
        (``stream``), or for ``near`` the position of the token the
        selection was refreshed at (the blocks end right before it, so the queries of the
        block after a refresh see them as their most recent context)."""
        if not cache.moving:
            return 0
        if self.placement == "near":
            base, _ = cache.ring.layout(n)
            return self.refreshed_at - base
        return self.anchor(cache, n)

    @property
    def placement(self) -> str:
        """Where the current selection goes: ``near`` for one a prompt's end chose
        (and fed its tail again under), else ``stream``."""
        point, _, hold = self.history[-1]
        return PLACEMENT_AT_PROMPT_END if hold > point else PLACEMENT

    def lead_slots(self, cache) -> int:
        """Region slots before the blocks: a moved copy of the sinks for ``stream``."""
        return cache.sinks if self.placement == "stream" else 0

    def lead_max(self, cache) -> int:
        """Slots the region keeps before its blocks (for the copy of the sinks)."""
        return cache.sinks if self.spec.copies_sinks else 0

    def build_region(self, cache, n: int) -> None:
        """Lay the selected blocks into this layer's region for a call at ``n``."""
        self.region.build(cache, n)

    def attend(self, cache, queries, keys, values, scale, mask, sinks, original):
        """Attention of one layer over the ring and the region (the hook calls it)."""
        i, N = cache.hook_index, queries.shape[2]
        n0 = cache.tokens_seen - N
        anchor = self.anchor(cache, n0) if cache.moving else 0
        entries, cut = self.queries[i], 0  # in stream order: the stale ones lead
        while cut < len(entries) and _end(entries[cut]) <= n0 - 2 * self.block:
            cut += 1
        del entries[:cut]  # a decode step drops one at most (a filter: 40 us a layer)
        entries.append((n0, queries, anchor))
        self.scale = scale
        sel = self.selection
        if not sel or self.region.applied[i] != (sel, self.region_anchor(cache, n0),
                                                 self.placement):  # fmt: skip
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                            sinks=sinks)  # fmt: skip
        return self.region.attend(cache, queries, keys, values, scale, mask, sinks, original)

    # ----- saving and restoring (mlx_stream.recall.persist) -----------------------------

    def export(self, writer) -> dict:
        """Write the tier's arrays through ``writer`` (a ``persist.Writer``) and return
        its numbers: the store, the summaries, ``first``, the selection history, the
        recent queries the next refresh reads, ``scale``. The regions are not saved:
        they are rebuilt from the store."""
        queries = [save_queries(writer, i, entries) for i, entries in enumerate(self.queries)]
        return {
            "layers": len(self.layers), "first": [int(f) for f in self.first],
            "history": [[int(p), [int(j) for j in sel], int(hold)] for p, sel, hold in self.history],
            "scale": None if self.scale is None else float(self.scale),
            "refreshes": self.refreshes, "queries": queries,
            "shortlist": self.shortlist.export() if self.shortlist else None,
            "index": self.summaries.export(writer),
            "store": self.store.export(writer),
        }  # fmt: skip

    def restore(self, reader, data: dict) -> None:
        """Take the state :meth:`export` saved (``reader``: a ``persist.Reader``); the
        regions are rebuilt from the store at the next call."""
        L = len(self.layers)
        if data["layers"] != L or len(data["queries"]) != L:
            raise UserError(f"{reader.folder}: a recall store of {data['layers']} layers, not {L}")
        self.store.restore(reader, data["store"])
        if "index" in data:
            self.summaries.restore(reader, data["index"])
        elif self.store.shapes is not None:  # saved before the index was segmented
            self.summaries.upgrade(reader, data["summaries"], self.store.count,
                                   self.store.shapes[0])  # fmt: skip
        self.first = [int(f) for f in data["first"]]
        self.history = [(int(p), tuple(int(j) for j in sel), int(hold))
                        for p, sel, hold in data["history"]]  # fmt: skip
        if not self.history:
            raise ValueError("history")
        self.scale = data["scale"]
        self.refreshes = int(data["refreshes"])
        if self.shortlist is not None:  # saved without one: the next refresh scans
            self.shortlist.restore(data.get("shortlist"))
        self.queries = [load_queries(reader, row) for row in data["queries"]]
        self.region.reset()

    def close(self, remove_files: bool = False) -> None:
        """Free the store (its temporary files too; its files in a given folder with
        ``remove_files``)."""
        self.store.close(remove_files)
        self.summaries.close(remove_files)
        self.closed = True


def _end(entry) -> int:
    """The token after the last of a ``queries`` entry ``(first token, queries, anchor)``."""
    return entry[0] + entry[1].shape[2]


def _pad_front(x: mx.array, first: int, block: int) -> mx.array:
    pad = mx.zeros((*x.shape[:2], block - x.shape[2], x.shape[3]), x.dtype)
    return mx.concatenate([pad, x], axis=2)


def attach(spec: RecallSpec, caches: list) -> Recall:
    """Give the SinkCache layers of ``caches`` one recall tier."""
    return Recall(spec, caches)
