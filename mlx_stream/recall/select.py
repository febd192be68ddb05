"""Which stored blocks come back: block summaries and query-driven scoring (numpy).

For each layer, each query head and each query token, the softmax mass every block
would receive; a layer's score of a block is its largest mass over heads and tokens;
the selection is the ``k`` blocks with the highest sum over layers, shared by all
layers, ties to the earlier block (a pure function of the queries and the store). A
block's logits come from its selector: ``exact`` (every stored key, summed per block),
``token`` (every stored key, a block's largest single-token probability; both in
``mlx_stream.recall.score``), ``quest`` (Quest's per-channel bound of its keys) or
``mean`` (its mean key). Queries arrive in the frame where a block's key ``i`` sits at
position ``i``. In full, and why a vote across layers: docs/recall.md ("Scoring").
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_stream.errors import UserError
from mlx_stream.recall.store import FileArray, Spill, dtype_name, dtype_of, host_dtype, to_host

#: The three summaries of a block, per KV head and channel: the mean of its keys
#: (float32), their minimum and their maximum (the keys' own dtype: exact).
KINDS = ("mean", "lo", "hi")
NEEDS = {"mean": ("mean",), "quest": ("lo", "hi")}  # what each selector reads
INDEX_SEGMENT = 256  # blocks per segment of a summary table (one allocation or file a layer)
#: The part of the RAM budget (``RecallSpec.ram_bytes``) the summaries may take: they
#: are read at every refresh, the blocks only when chosen; the blocks take the rest.
INDEX_SHARE = 0.25


def kinds_for(*selectors: str | None) -> tuple[str, ...]:
    """The summaries ``selectors`` read (``exact`` and ``token`` read the stored keys)."""
    need = {k for s in selectors for k in NEEDS.get(s, ())}
    return tuple(k for k in KINDS if k in need)


class Summaries(Spill):
    """The index of a store: per layer and block, the summaries its selectors read
    (``kinds``, of :data:`KINDS`), ``H * D`` numbers each. The mean is float32; the
    minimum and maximum are kept in the keys' dtype (a bfloat16 key's extremes are
    bfloat16 values: exact, so scores and selections are those of float32 tables).
    Tables are kept in segments of :data:`INDEX_SEGMENT` blocks per layer, in host
    memory while ``ram_bytes`` holds and past it ``.npy`` files in ``folder``
    (:class:`~mlx_stream.recall.store.FileArray`: written a block at a time, read a
    segment at a time by each refresh).

    Args:
        layers (int): Layers summarised.
        kinds (tuple): The summaries kept.
        ram_bytes (int): Host bytes before segments go to files (default: no limit).
        folder (str, optional): Where the files go (a temporary folder when ``None``).
    """

    def __init__(self, layers: int, kinds: tuple[str, ...] = KINDS, ram_bytes: int = 1 << 62,
                 folder: str | None = None):  # fmt: skip
        super().__init__(ram_bytes, folder)
        self.layers, self.kinds = layers, tuple(kinds)
        self.shape = None  # (H, D, keys' mx dtype)
        self.count = [0] * layers  # blocks summarised per layer
        self.segments = {k: [[] for _ in range(layers)] for k in self.kinds}

    def _dtype(self, kind: str):
        """The numpy dtype a table holds (the keys' raw bits for ``lo`` and ``hi``)."""
        return np.float32 if kind == "mean" else host_dtype(self.shape[2])

    def _segment(self, kind: str, layer: int, index: int, source=None):
        segs = self.segments[kind][layer]
        while len(segs) <= index:
            H, D, _ = self.shape
            saved = None if source is None else (source[0], source[1][len(segs)])
            name = f"index.{kind}.layer{layer}.seg{len(segs)}"
            segs.append(self._allocate(name, self._dtype(kind), (INDEX_SEGMENT, H, D), saved))
        return segs[index]

    def setup(self, heads: int, dim: int, dtype) -> None:
        """The keys' shape per block (``heads``, ``dim``) and mx ``dtype``."""
        if self.shape is None:
            self.shape = (int(heads), int(dim), dtype)

    def reserve(self, blocks: int) -> None:
        """Allocate every segment blocks ``< blocks`` of every layer need (``setup``
        done), so that summarising them cannot fail for want of space.

        Raises:
            RuntimeFailure: A segment file cannot be written (a full disk).
        """
        if self.shape is None or blocks <= 0:
            return
        for kind in self.kinds:
            for layer in range(self.layers):
                self._segment(kind, layer, (blocks - 1) // INDEX_SEGMENT)

    def add(self, layer: int, j: int, keys) -> None:
        """Summarise block ``j`` of ``layer`` from its valid keys ``(H, tokens, D)``: an
        ``mx.array`` in its own dtype, or a numpy array (float32 tables)."""
        if isinstance(keys, np.ndarray):
            dtype, keys = mx.float32, keys.astype(np.float32)
        else:
            dtype, keys = keys.dtype, np.asarray(keys.astype(mx.float32))
        self.setup(keys.shape[0], keys.shape[2], dtype)
        for kind in self.kinds:
            if kind == "mean":
                value = keys.mean(1)
            else:  # an extreme of values of the keys' dtype: one of them, cast back exactly
                value = keys.min(1) if kind == "lo" else keys.max(1)
                value = value if self.shape[2] == mx.float32 else to_host(
                    mx.array(value).astype(self.shape[2]))  # fmt: skip
            self._segment(kind, layer, j // INDEX_SEGMENT)[j % INDEX_SEGMENT] = value
        self.count[layer] = max(self.count[layer], j + 1)

    def forget(self, layer: int, blocks: int) -> None:
        """Keep only ``layer``'s blocks ``< blocks``."""
        self.count[layer] = min(self.count[layer], blocks)

    def table(self, kind: str, layer: int, blocks: int, start: int = 0) -> np.ndarray:
        """``kind`` of blocks ``start .. blocks - 1`` of ``layer``, float32
        ``(blocks - start, H, D)`` (spilled segments read a segment at a time).

        Raises:
            ValueError: A summary this index does not keep (its selectors read none).
        """
        if kind not in self.kinds:
            raise ValueError(f"the recall index keeps no {kind!r} summaries (kept: "
                             f"{', '.join(self.kinds) or 'none'})")  # fmt: skip
        parts = []
        for index in range(start // INDEX_SEGMENT, -(-blocks // INDEX_SEGMENT)):
            seg = self.segments[kind][layer][index]
            a = max(0, start - index * INDEX_SEGMENT)
            n = min(INDEX_SEGMENT, blocks - index * INDEX_SEGMENT)
            parts.append(seg.rows(a, n) if isinstance(seg, FileArray) else seg[a:n])
        return self._joined(kind, parts)

    def rows(self, kind: str, layer: int, ids: np.ndarray) -> np.ndarray:
        """``kind`` of blocks ``ids`` (ascending) of ``layer``, float32 ``(len(ids), H,
        D)``: a segment in memory indexed once, a spilled one read a run of consecutive
        blocks at a time."""
        if kind not in self.kinds or len(ids) == 0:
            return self.table(kind, layer, 0)
        parts, where = [], ids // INDEX_SEGMENT
        for index in np.unique(where):
            seg = self.segments[kind][layer][index]
            local = ids[where == index] - index * INDEX_SEGMENT
            if not isinstance(seg, FileArray):
                parts.append(seg[local])
                continue
            for run in np.split(local, np.flatnonzero(np.diff(local) != 1) + 1):
                parts.append(seg.rows(int(run[0]), int(run[-1]) + 1))
        return self._joined(kind, parts)

    def _joined(self, kind: str, parts: list) -> np.ndarray:
        """Rows read from segments, as one float32 ``(rows, H, D)`` array."""
        if not parts:
            return np.zeros((0, *self.shape[:2]), np.float32)
        raw = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return _float32(raw, mx.float32 if kind == "mean" else self.shape[2])

    # ----- bytes ----------------------------------------------------------------------

    def arrays(self):
        return (a for kind in self.kinds for segs in self.segments[kind] for a in segs)

    def forget_arrays(self) -> None:
        self.segments = {k: [[] for _ in range(self.layers)] for k in self.kinds}

    def used(self) -> tuple[int, int]:
        """``(ram, disk)``: bytes of the blocks summarised, in host memory and in files
        (``host_bytes`` and ``disk_bytes``: the room reserved, a segment at a time)."""
        return self.split(
            (seg, min(INDEX_SEGMENT, max(0, self.count[layer] - index * INDEX_SEGMENT)))
            for kind in self.kinds
            for layer, segs in enumerate(self.segments[kind])
            for index, seg in enumerate(segs)
        )

    # ----- saving and restoring (mlx_stream.recall.persist) -----------------------------

    def export(self, writer) -> dict:
        """Write the segments that hold summaries through ``writer`` (a spilled
        segment's file is copied) and return what :meth:`restore` needs besides."""
        segments = {}
        for kind in self.kinds:
            segments[kind] = [
                [self._export(writer, f"index.{kind}.layer{layer}.seg{index}.npy", seg)
                 for index, seg in enumerate(segs[: -(-self.count[layer] // INDEX_SEGMENT)])]
                for layer, segs in enumerate(self.segments[kind])
            ]  # fmt: skip
        shape = None if self.shape is None else [*self.shape[:2], dtype_name(self.shape[2])]
        return {"kinds": list(self.kinds), "segment": INDEX_SEGMENT, "shape": shape,
                "count": list(self.count), "segments": segments}  # fmt: skip

    def restore(self, reader, data: dict) -> None:
        """Fill this empty index from what :meth:`export` saved; segments go to RAM
        while its budget holds, to files in its folder past it.

        Raises:
            UserError: Other summaries or segments than this run keeps.
        """
        saved = (list(data["kinds"]), int(data["segment"]))
        if saved != (list(self.kinds), INDEX_SEGMENT):
            raise UserError(
                f"{reader.folder}: an index of {', '.join(saved[0]) or 'no'} summaries in "
                f"segments of {saved[1]} blocks; this run keeps "
                f"{', '.join(self.kinds) or 'none'} in segments of {INDEX_SEGMENT}"
            )
        count, segments = [int(c) for c in data["count"]], data["segments"]
        if len(count) != self.layers:
            raise ValueError("layers")
        if data["shape"] is not None:
            H, D, dtype = data["shape"]
            self.setup(H, D, dtype_of(dtype))
        for kind in self.kinds:
            if len(segments[kind]) != self.layers:
                raise ValueError(kind)
            for layer, names in enumerate(segments[kind]):
                if len(names) * INDEX_SEGMENT < count[layer]:
                    raise ValueError("segments")
        longest = max((len(n) for kind in self.kinds for n in segments[kind]), default=0)
        for index in range(longest):  # the order they were allocated in
            for kind in self.kinds:
                for layer, names in enumerate(segments[kind]):
                    if index < len(names):
                        self._segment(kind, layer, index, (reader, names))
        self.count = count

    def upgrade(self, reader, data: dict, count: list[int], keys: tuple) -> None:
        """Fill this empty index from the whole float32 tables a store saved before
        the index was segmented (``data``: its ``summaries`` entry; ``count``: the
        blocks stored per layer; ``keys``: ``(H, D, dtype)`` of the stored keys).

        Raises:
            UserError: A saved extreme that is not a value of the keys' dtype.
        """
        self.setup(*keys)
        for kind in self.kinds:
            names = data[kind]
            if len(names) != self.layers:
                raise ValueError(kind)
            for layer, name in enumerate(names):
                if not count[layer]:
                    continue
                old = reader.array(name, np.float32)[: count[layer]]
                if len(old) < count[layer] or old.shape[1:] != self.shape[:2]:
                    raise ValueError(kind)
                if kind != "mean" and self.shape[2] != mx.float32:
                    value = to_host(mx.array(old).astype(self.shape[2]))
                    if not np.array_equal(_float32(value, self.shape[2]), old):
                        raise UserError(
                            f"{reader.folder}: its block summaries are not "
                            f"{dtype_name(self.shape[2])} values; it cannot be read here"
                        )
                    old = value
                for j, row in enumerate(old):
                    self._segment(kind, layer, j // INDEX_SEGMENT)[j % INDEX_SEGMENT] = row
                self.count[layer] = count[layer]


def _float32(raw: np.ndarray, dtype) -> np.ndarray:
    """The float32 values of ``raw``, the bits of an ``mx`` array of ``dtype``."""
    if dtype == mx.float32:
        return np.ascontiguousarray(raw)
    if dtype == mx.bfloat16:  # the upper half of a float32's bits
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def group_queries(q: np.ndarray, kv_heads: int) -> np.ndarray:
    """Queries ``(Hq, L, D)`` as ``(kv_heads, Hq // kv_heads * L, D)``: each KV head's
    query heads side by side (mlx-lm's grouping: query head ``h`` reads KV head
    ``h // (Hq // kv_heads)``)."""
    Hq, L, D = q.shape
    return q.reshape(kv_heads, (Hq // kv_heads) * L, D)


def layer_scores_summary(q: np.ndarray, summaries: Summaries, layer: int, blocks,
                         selector: str, scale: float, empty: np.ndarray) -> np.ndarray:  # fmt: skip
    """Per block: the largest softmax mass over heads and tokens, from summaries."""
    return head_scores_summary(q, summaries, layer, blocks, selector, scale, empty).max(0)


def head_scores_summary(q: np.ndarray, summaries: Summaries, layer: int, blocks,
                        selector: str, scale: float, empty: np.ndarray) -> np.ndarray:  # fmt: skip
    """Per KV head and block ``(H, blocks)``: the largest softmax mass over the head's
    query heads and tokens, from summaries; ``blocks``: an ``int`` (blocks ``0 ..
    blocks - 1``) or block numbers, ascending (the softmax over those alone; ``empty``
    is then theirs)."""
    g = group_queries(q.astype(np.float32), summaries.shape[0])  # (H, R, D)

    def read(kind):
        if isinstance(blocks, (int, np.integer)):
            return summaries.table(kind, layer, int(blocks))
        return summaries.rows(kind, layer, blocks)

    if selector == "mean":
        logits = matmul(g, read("mean").transpose(1, 2, 0))
    else:
        logits = quest_logits(g, read("lo"), read("hi"))
    return mass(logits, scale, empty)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` (float32) through MLX, so on the model's own BLAS threads: numpy's
    ``einsum`` loops far slower, and numpy's ``@`` wakes a second BLAS thread pool
    that spins after each call, taking a core from the model on a small machine."""
    return np.asarray(mx.array(a) @ mx.array(b))


def quest_logits(g: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Quest's bound of ``q . k`` over a block's keys, channel by channel: ``(H, R,
    blocks)`` for grouped queries ``g`` ``(H, R, D)`` and the blocks' key minima and
    maxima ``lo``, ``hi`` ``(blocks, H, D)`` (unscaled)."""
    signed = np.concatenate([np.maximum(g, 0), np.minimum(g, 0)], axis=-1)  # (H, R, 2D)
    bounds = np.concatenate([hi, lo], axis=-1).transpose(1, 2, 0)  # (H, 2D, blocks)
    return matmul(signed, bounds)


def mass(logits: np.ndarray, scale: float, empty: np.ndarray) -> np.ndarray:
    """``(H, blocks)``: per KV head, the largest softmax mass over blocks of unscaled
    ``logits`` ``(H, R, blocks)`` over its query rows (``empty`` blocks get none);
    ``logits`` is overwritten."""
    logits *= scale  # in place (the caller's fresh array): the same numbers, sooner
    if empty.any():
        logits[..., empty] = -np.inf
    logits -= logits.max(-1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(-1, keepdims=True)
    return logits.max(axis=1)


def top_k(scores: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[int, ...]:
    """The ``k`` best blocks in stream order (ties: the earlier block wins)."""
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    order = np.argsort(-scores, kind="stable")[:k]
    order = [int(b) for b in order if np.isfinite(scores[b])]
    return tuple(sorted(order))


def with_neighbours(scores: np.ndarray, k: int) -> tuple[int, ...]:
    """The ``k`` blocks chosen in pairs, in stream order: down the ranking, each block not
    yet chosen comes with the better-scoring of its two neighbours in the stream (ties:
    the earlier; only candidates: finite scores). A sentence cut by a block boundary
    keeps both halves: the question's words rank one half, the fact may sit in the
    other (docs/recall.md, "The tier")."""
    order = [int(b) for b in np.argsort(-scores, kind="stable") if np.isfinite(scores[b])]
    chosen: list[int] = []
    for b in order:
        if len(chosen) >= k:
            break
        if b in chosen:
            continue
        chosen.append(b)
        near = [c for c in (b - 1, b + 1)
                if 0 <= c < len(scores) and np.isfinite(scores[c]) and c not in chosen]  # fmt: skip
        if near and len(chosen) < k:
            chosen.append(max(near, key=lambda c: (scores[c], -c)))
    return tuple(sorted(chosen))
