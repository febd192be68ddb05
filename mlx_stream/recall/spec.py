"""The recall policy as one small frozen value (no mlx import: the CLI may read it).

``RecallSpec`` says how many evicted blocks come back into attention and where the
store of evicted blocks lives. A cache policy value carries it as one field;
``make_sink_cache(model, ..., recall=RecallSpec())`` takes it. How blocks are chosen
and placed is fixed (the constants below; docs/recall.md has the measurements that
chose them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlx_stream.defaults import DEFAULT_RECALL_BLOCKS, DEFAULT_RECALL_RAM_MB, DEFAULT_STRIDE
from mlx_stream.errors import Unsupported

DEFAULT_BLOCKS = DEFAULT_RECALL_BLOCKS
DEFAULT_BLOCK = DEFAULT_STRIDE
DEFAULT_RAM = DEFAULT_RECALL_RAM_MB * 1_000_000  # host bytes before spilling to disk

#: How a block boundary scores the blocks: Quest's per-channel min/max bound of a
#: block's keys (``mlx_stream.recall.select``).
SELECTOR = "quest"
#: How a prompt's end scores them: the largest probability one of a block's stored keys
#: gets (``mlx_stream.recall.score``), chosen in pairs (``select.with_neighbours``).
PROMPT_SELECTOR = "token"
#: Where a boundary's blocks go: sinks, blocks, window, in stream order.
PLACEMENT = "stream"
#: Where a prompt's end puts its blocks: right before the token it chose them at.
PLACEMENT_AT_PROMPT_END = "near"
#: At a prompt's end, its last tokens back to the start of this many blocks are fed
#: again under the blocks it chose.
REFEED = 2
#: What a saved store and a checkpoint record of these (their names before they were
#: fixed), so files written since read as before.
FIXED = {
    "selector": SELECTOR,
    "placement": PLACEMENT,
    "prompt_selector": PROMPT_SELECTOR,
    "prompt_neighbours": True,
    "prompt_placement": PLACEMENT_AT_PROMPT_END,
    "refeed": REFEED,
    "index": "reuse",
    "scan_stride": 1,
    "scan_keep": 0,
    "shortlist": 0,
    "expand": 0,
    "rescan": 16,
}


@dataclass(frozen=True)
class RecallSpec:
    """How evicted context is stored and brought back.

    Attributes:
        blocks (int): ``k``: blocks retrieved into the fixed region of every layer.
        block (int): Tokens per block; equals the cache's stride (blocks are cut, and
            the selection refreshed, at stride boundaries). Default: ``64``.
        bits (int, optional): Store keys and values quantized to 4 or 8 bits
            (``mx.quantize``, the window's quantization). Default: the model's dtype.
        group_size (int): Quantization group size of the store. Default: ``64``.
        ram_bytes (int): Host bytes the store may hold, its blocks and their summaries
            together (the summaries up to a quarter), before new segments spill to
            files in ``folder``. Default: 1 GB.
        folder (str, optional): Where spilled blocks go. Default: a temporary folder.
    """

    blocks: int = DEFAULT_BLOCKS
    block: int = DEFAULT_BLOCK
    bits: int | None = None
    group_size: int = 64
    ram_bytes: int = DEFAULT_RAM
    folder: str | None = None

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise Unsupported(f"recall blocks must be at least 1 (got {self.blocks})")
        if self.block < 1:
            raise Unsupported(f"recall block size must be at least 1 (got {self.block})")
        if self.bits not in (None, 4, 8):
            raise Unsupported(f"recall store bits must be 4 or 8 (got {self.bits})")
        if self.group_size not in (32, 64, 128):
            raise Unsupported(f"recall group size must be 32, 64 or 128 (got {self.group_size})")
        if self.ram_bytes < 0:
            raise Unsupported(f"recall RAM budget must be 0 or more (got {self.ram_bytes})")

    def settings(self) -> dict:
        """Every setting by name, the fixed ones (:data:`FIXED`) included: what a saved
        store's manifest and a checkpoint's identity record."""
        return {**asdict(self), **FIXED}

    @property
    def copies_sinks(self) -> bool:
        """Whether the region holds a moved copy of the sinks (the ``stream`` placement's)."""
        return PLACEMENT == "stream"

    @property
    def region(self) -> int:
        """Slots of the retrieval region per layer (``blocks * block``)."""
        return self.blocks * self.block
