"""The store of evicted blocks: host memory (numpy), optionally quantized, spilling to
files past a RAM budget.

One ``BlockStore`` serves every layer of a model. Block ``j`` holds the keys and values
of tokens ``[j * block, (j + 1) * block)`` of one layer, ``(H, block, D)``, keys at
block-relative positions. Arrays leave the device as raw bits (a float store's round
trip is exact); a quantized store keeps mlx's ``(packed, scales, biases)`` per tensor.
A segment of ``SEGMENT`` blocks that would take the store past ``ram_bytes`` is a
``.npy`` file instead (:class:`FileArray`, a block at a time), allocated when made (a
full disk is a ``RuntimeFailure`` then, never a ``SIGBUS``). Bytes per stored token are
known before the first block (:func:`bytes_per_token`); :meth:`BlockStore.export` and
:meth:`BlockStore.restore` copy spilled segments file to file. In full: docs/recall.md
("The store").
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_stream.cache import storage as kvstore
from mlx_stream.cache.estimate import RECALL_SEGMENT as SEGMENT
from mlx_stream.cache.estimate import bytes_per_token  # noqa: F401  (store.bytes_per_token)
from mlx_stream.errors import RuntimeFailure, UserError

_RAW = {mx.bfloat16: (mx.uint16, np.uint16), mx.float16: (mx.float16, np.float16),
        mx.float32: (mx.float32, np.float32), mx.uint32: (mx.uint32, np.uint32)}  # fmt: skip


def to_host(x: mx.array) -> np.ndarray:
    """The bits of ``x`` as a numpy array (bfloat16 viewed as uint16: numpy has none)."""
    view, _ = _RAW[x.dtype]
    return np.array(x.view(view) if view != x.dtype else x, copy=False)


def host_dtype(dtype):
    """The numpy dtype holding the bits of an mx ``dtype`` the store keeps."""
    return _RAW[dtype][1]


def dtype_name(dtype) -> str:
    """``mx.bfloat16`` -> ``"bfloat16"`` (a dtype the store keeps)."""
    return str(dtype).rsplit(".", 1)[-1]


def dtype_of(name: str):
    """``dtype_name``'s inverse (``ValueError`` for a dtype the store does not keep)."""
    dtype = getattr(mx, str(name), None)
    if dtype not in _RAW:
        raise ValueError(f"dtype {name!r}")
    return dtype


def to_device(x: np.ndarray, dtype) -> mx.array:
    """``to_host``'s inverse."""
    view, _ = _RAW[dtype]
    a = mx.array(x)
    return a.view(dtype) if view != dtype else a


def save_queries(writer, layer: int, entries: list) -> dict | None:
    """A layer's recent queries (``(first token, queries, anchor)`` entries) written
    through ``writer`` (a ``persist.Writer``): one file of every entry's rows, and
    ``[t0, anchor, rows]`` per entry (``None``: no entry)."""
    if not entries:
        return None
    q = mx.concatenate([e[1] for e in entries], axis=2)
    name = writer.array(f"queries.layer{layer}.npy", to_host(q))
    rows = [[int(t0), int(anchor), int(x.shape[2])] for t0, x, anchor in entries]
    return {"file": name, "dtype": dtype_name(q.dtype), "entries": rows}


def load_queries(reader, row: dict | None) -> list:
    """The entries :func:`save_queries` wrote (``reader``: a ``persist.Reader``)."""
    if row is None:
        return []
    q, at, entries = to_device(reader.array(row["file"]), dtype_of(row["dtype"])), 0, []
    for t0, anchor, n in row["entries"]:
        entries.append((int(t0), q[:, :, at : at + int(n), :], int(anchor)))
        at += int(n)
    if at != q.shape[2]:
        raise ValueError("queries")
    return entries


def _parts(H: int, block: int, D: int, dtype, bits: int | None, group: int) -> list:
    """``(shape, mx dtype)`` of each stored array of one block's tensor."""
    if bits is None:
        return [((H, block, D), dtype)]
    return [((H, block, D * bits // 32), mx.uint32), ((H, block, D // group), dtype),
            ((H, block, D // group), dtype)]  # fmt: skip


class FileArray:
    """One part of a spilled segment: a ``.npy`` file read and written a block at a
    time with positioned I/O, opened only for each access. No memory map stays open,
    so a long stream's store grows neither the open files nor the process's resident
    memory (a map's touched pages count in its RSS; reads here go through the OS page
    cache, which the kernel reclaims).

    Args:
        path (Path): A ``.npy`` file whose first axis indexes blocks.
    """

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)  # fmt: skip
            shape, _, dtype = read(f)
            self.offset = f.tell()
        self.filename, self.shape, self.dtype = str(path), tuple(shape), np.dtype(dtype)
        self.row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def __setitem__(self, i: int, value: np.ndarray) -> None:
        data = np.ascontiguousarray(value, dtype=self.dtype).tobytes()
        fd = os.open(self.filename, os.O_WRONLY)
        try:
            os.pwrite(fd, data, self.offset + i * self.row)
        finally:
            os.close(fd)

    def __getitem__(self, i: int) -> np.ndarray:
        fd = os.open(self.filename, os.O_RDONLY)
        try:
            data = os.pread(fd, self.row, self.offset + i * self.row)
        finally:
            os.close(fd)
        return np.frombuffer(data, self.dtype).reshape(self.shape[1:])

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Blocks ``start:stop`` in one read (a refresh reads a segment's summaries)."""
        fd = os.open(self.filename, os.O_RDONLY)
        try:
            data = os.pread(fd, (stop - start) * self.row, self.offset + start * self.row)
        finally:
            os.close(fd)
        return np.frombuffer(data, self.dtype).reshape(stop - start, *self.shape[1:])

    def flush(self) -> None:
        """Nothing is buffered: every write went to the file."""


class Spill:
    """Arrays allocated a segment at a time: in host memory while ``ram_bytes`` holds,
    past it a ``.npy`` file in ``folder`` (:class:`FileArray`), named after this
    object's ``tag`` (several may share a folder). ``host_bytes`` and ``disk_bytes``
    count what was allocated where. Subclasses list their arrays (:meth:`arrays`).

    Args:
        ram_bytes (int): Host bytes before arrays go to files.
        folder (str, optional): Where the files go (made if missing; a temporary
            folder when ``None``).
    """

    def __init__(self, ram_bytes: int, folder: str | None):
        self.ram_bytes = ram_bytes
        self.folder = None if folder is None else Path(folder)
        self._tmp = None
        self.host_bytes = 0
        self.disk_bytes = 0
        self.tag = uuid.uuid4().hex[:12]  # names this object's files
        if self.folder is not None:
            check_folder(self.folder)

    def _folder(self) -> Path:
        if self.folder is None:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="mlx-stream-recall-")
            return Path(self._tmp.name)
        return self.folder

    def _allocate(self, name: str, np_dtype, shape: tuple, source: Any = None):
        """One array of ``shape``: in RAM while the budget holds, else the file
        ``<tag>.<name>.npy``; zeros, or the saved file ``source`` (``(persist.Reader,
        name)``)."""
        size = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        if self.host_bytes + size <= self.ram_bytes:
            self.host_bytes += size
            if source is None:
                return np.zeros(shape, np_dtype)
            return source[0].array(source[1], np_dtype, shape)
        path = self._folder() / f"{self.tag}.{name}.npy"
        if source is None:
            array = self.open_file(path, np_dtype, shape)
        else:
            array = self._restore_file(source[0], source[1], path, np_dtype, shape)
        self.disk_bytes += size
        return array

    def open_file(self, path: Path, np_dtype, shape: tuple) -> FileArray:
        """A new ``.npy`` file, its blocks allocated on the disk now: a full disk is an
        error here, not a failed write mid-stream."""
        try:
            array = np.lib.format.open_memmap(path, "w+", np_dtype, shape)
            del array  # the header and the file's size: unmapped again at once
            with open(path, "r+b") as f:
                os.posix_fallocate(f.fileno(), 0, os.path.getsize(path))
            return FileArray(path)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise self.failure(e) from None

    def failure(self, e: OSError) -> RuntimeFailure:
        """The one-line failure of a store that cannot write its folder mid-stream."""
        why = e.strerror or type(e).__name__
        return RuntimeFailure(f"cannot write the recall store in {self._folder()} ({why})")

    def _restore_file(self, reader: Any, name: str, path: Path, np_dtype, shape: tuple):
        try:
            return reader.copy(name, path, np_dtype, shape)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise self.failure(e) from None
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    @staticmethod
    def _export(writer: Any, name: str, array: Any) -> str:
        """Write one array through ``writer`` (a ``persist.Writer``): a file is copied,
        never read into memory whole."""
        if isinstance(array, FileArray):
            array.flush()
            return writer.copy(name, Path(array.filename))
        return writer.array(name, array)

    def arrays(self):
        """Every array allocated (in RAM or a ``FileArray``)."""
        raise NotImplementedError

    @staticmethod
    def split(parts) -> tuple[int, int]:
        """``(ram, disk)``: the bytes of ``parts``, ``(array, rows filled)`` pairs."""
        ram = disk = 0
        for array, filled in parts:
            size = filled * int(np.prod(array.shape[1:])) * np.dtype(array.dtype).itemsize
            if isinstance(array, FileArray):
                disk += size
            else:
                ram += size
        return ram, disk

    @property
    def nbytes(self) -> int:
        """Bytes allocated (host and disk): reserved, not necessarily filled."""
        return self.host_bytes + self.disk_bytes

    def close(self, remove_files: bool = False) -> None:
        """Drop the arrays (and remove a temporary folder; files in a given folder
        stay, e.g. for a soak to measure, unless ``remove_files``: this object's own)."""
        if remove_files:
            for array in self.arrays():
                if isinstance(array, FileArray):
                    Path(array.filename).unlink(missing_ok=True)
        self.forget_arrays()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def forget_arrays(self) -> None:
        raise NotImplementedError


class BlockStore(Spill):
    """Evicted blocks of every layer.

    Args:
        layers (int): Layers stored.
        block (int): Tokens per block.
        bits (int, optional): 4 or 8 to quantize; ``None`` keeps the model's dtype.
        group_size (int): Quantization group size.
        ram_bytes (int): Host bytes before segments go to files.
        folder (str, optional): Where the files go (made if missing; a temporary
            folder when ``None``).
    """

    def __init__(self, layers: int, block: int, bits: int | None = None, group_size: int = 64,
                 ram_bytes: int = 1 << 30, folder: str | None = None):  # fmt: skip
        super().__init__(ram_bytes, folder)
        self.layers, self.block, self.bits, self.group = layers, block, bits, group_size
        self.count = [0] * layers  # blocks stored per layer
        self.first = {}  # block -> first valid token index inside it (block 0: the sinks)
        self.segments = [[] for _ in range(layers)]  # per layer: [(keys parts, values parts)]
        self.shapes = None  # ((H, D, dtype) of keys, of values)

    # ----- writing -------------------------------------------------------------------

    def _segment(self, layer: int, index: int) -> tuple:
        segs = self.segments[layer]
        while len(segs) <= index:
            segs.append(self._new_segment(layer, len(segs)))
        return segs[index]

    def _new_segment(self, layer: int, index: int, source: Any = None) -> tuple:
        """Segment ``index`` of ``layer``: in RAM while the budget holds, else a file;
        zeros, or the parts ``source`` (``(persist.Reader, names)``) saved."""
        out, names = [], None if source is None else iter(source[1])
        for t, (H, D, dtype) in enumerate(self.shapes):
            parts = []
            for p, (shape, kind) in enumerate(_parts(H, self.block, D, dtype, self.bits,
                                                     self.group)):  # fmt: skip
                saved = None if names is None else (source[0], next(names))
                name = f"layer{layer}.seg{index}.{'kv'[t]}{p}"
                parts.append(self._allocate(name, _RAW[kind][1], (SEGMENT, *shape), saved))
            out.append(parts)
        return tuple(out)

    def reserve(self, blocks: int) -> None:
        """Allocate now every segment that blocks ``< blocks`` of every layer need
        (``shapes`` known), so that storing them cannot fail for want of space.

        Raises:
            RuntimeFailure: A segment file cannot be written (a full disk).
        """
        if self.shapes is None or blocks <= 0:
            return
        for layer in range(self.layers):
            self._segment(layer, (blocks - 1) // SEGMENT)

    def put(self, layer: int, j: int, keys: mx.array, values: mx.array, first: int = 0) -> None:
        """Store block ``j`` of ``layer`` (``keys``/``values``: ``(1, H, block, D)``,
        float; tokens before ``first`` are not part of it)."""
        if self.shapes is None:
            self.shapes = ((keys.shape[1], keys.shape[-1], keys.dtype),
                           (values.shape[1], values.shape[-1], values.dtype))  # fmt: skip
        seg = self._segment(layer, j // SEGMENT)
        for t, x in enumerate((keys, values)):
            packed = kvstore.pack(x[0], self.bits, self.group)
            packed = packed if isinstance(packed, tuple) else (packed,)
            for dst, src in zip(seg[t], packed):
                dst[j % SEGMENT] = to_host(src)
        self.count[layer] = max(self.count[layer], j + 1)
        if first:
            self.first[j] = first

    def forget(self, layer: int, blocks: int) -> None:
        """Keep only ``layer``'s blocks ``< blocks`` (a rollback removed tokens of the
        later ones)."""
        self.count[layer] = min(self.count[layer], blocks)

    # ----- saving and restoring (mlx_stream.recall.persist) -----------------------------

    def export(self, writer: Any) -> dict:
        """Write the segments that hold stored blocks through ``writer`` (a
        ``persist.Writer``; a spilled segment's file is copied, not read into memory)
        and return what :meth:`restore` needs besides them."""
        segments = []
        for layer in range(self.layers):
            names = []
            for index in range(-(-self.count[layer] // SEGMENT)):
                parts = [x for tensor in self.segments[layer][index] for x in tensor]
                seg = []
                for p, part in enumerate(parts):
                    seg.append(self._export(writer, f"store.layer{layer}.seg{index}.{p}.npy", part))
                names.append(seg)
            segments.append(names)
        shapes = None if self.shapes is None else [[H, D, dtype_name(t)] for H, D, t in self.shapes]
        return {"layers": self.layers, "block": self.block, "bits": self.bits,
                "group": self.group, "count": list(self.count), "shapes": shapes,
                "first": {str(j): f for j, f in self.first.items()}, "segments": segments}  # fmt: skip

    def restore(self, reader: Any, data: dict) -> None:
        """Fill this empty store from what :meth:`export` saved (``reader``: a
        ``persist.Reader``); segments go to RAM while its budget holds, to files in
        this store's folder past it.

        Raises:
            UserError: The saved store has another shape or a file is not intact.
        """
        saved = (data["layers"], data["block"], data["bits"], data["group"])
        if saved != (self.layers, self.block, self.bits, self.group):
            raise UserError(
                f"{reader.folder}: a store of {saved[0]} layers, blocks of {saved[1]}, "
                f"{saved[2]} bits; this cache needs {self.layers}, {self.block}, {self.bits}"
            )
        count, segments = [int(c) for c in data["count"]], data["segments"]
        if len(count) != self.layers or len(segments) != self.layers:
            raise ValueError("layers")
        if data["shapes"] is not None:
            self.shapes = tuple((int(H), int(D), dtype_of(t)) for H, D, t in data["shapes"])
        for index in range(max((len(s) for s in segments), default=0)):  # the order of puts
            for layer in range(self.layers):
                if index < len(segments[layer]):
                    seg = self._new_segment(layer, index, (reader, segments[layer][index]))
                    self.segments[layer].append(seg)
        for layer in range(self.layers):
            if len(self.segments[layer]) * SEGMENT < count[layer]:
                raise ValueError("segments")
        self.count = count
        self.first = {int(j): int(f) for j, f in data["first"].items()}

    # ----- reading -------------------------------------------------------------------

    def get(self, layer: int, j: int) -> tuple[mx.array, mx.array]:
        """Block ``j`` of ``layer`` as float ``(1, H, block, D)`` keys and values."""
        seg = self._segment(layer, j // SEGMENT)
        out = []
        for t, (_, _, dtype) in enumerate(self.shapes):
            parts = [to_device(np.asarray(p[j % SEGMENT]), kind) for p, (_, kind) in zip(
                seg[t], _parts(1, 1, 64, dtype, self.bits, self.group))]  # fmt: skip
            x = parts[0] if self.bits is None else tuple(parts)
            out.append(kvstore.unpack(x, self.bits, self.group)[None])
        return out[0], out[1]

    def blocks(self) -> int:
        """Blocks stored in every layer."""
        return min(self.count) if self.count else 0

    def arrays(self):
        return (p for segs in self.segments for seg in segs for t in seg for p in t)

    def forget_arrays(self) -> None:
        self.segments = [[] for _ in range(self.layers)]

    def used(self) -> tuple[int, int]:
        """``(ram, disk)``: bytes of the blocks stored, in host memory and in files
        (segments are allocated ``SEGMENT`` blocks at a time: ``host_bytes`` and
        ``disk_bytes`` are the room reserved, these its filled part)."""
        return self.split(
            (part, min(SEGMENT, max(0, self.count[layer] - index * SEGMENT)))
            for layer, segs in enumerate(self.segments)
            for index, seg in enumerate(segs)
            for part in (p for tensor in seg for p in tensor)
        )


def check_folder(folder: Path) -> None:
    """A ``UserError`` (one line) unless ``folder`` exists or can be made, and is writable."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-", delete=True)
        probe.close()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise UserError(f"cannot write the recall store in {folder} ({why})") from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"cannot write the recall store in {folder} (not writable)")
