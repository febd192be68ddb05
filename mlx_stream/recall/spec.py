"""The recall policy as one small frozen value (no mlx import: the CLI may read it).

``RecallSpec`` says how many evicted blocks come back into attention, how they are
chosen and placed, and where the store of evicted blocks lives. A cache policy value
carries it as one field; ``make_sink_cache(model, ..., recall=RecallSpec())`` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_stream.defaults import DEFAULT_RECALL_BLOCKS, DEFAULT_RECALL_RAM_MB, DEFAULT_STRIDE
from mlx_stream.errors import Unsupported

SELECTORS = ("exact", "quest", "mean", "token")
PLACEMENTS = ("stream", "before", "fixed", "near")
INDEXES = ("flat", "tree", "reuse")
DEFAULT_BLOCKS = DEFAULT_RECALL_BLOCKS
DEFAULT_BLOCK = DEFAULT_STRIDE
DEFAULT_RAM = DEFAULT_RECALL_RAM_MB * 1_000_000  # host bytes before spilling to disk


@dataclass(frozen=True)
class RecallSpec:
    """How evicted context is stored and brought back.

    Attributes:
        blocks (int): ``k``: blocks retrieved into the fixed region of every layer.
        block (int): Tokens per block; equals the cache's stride (blocks are cut, and
            the selection refreshed, at stride boundaries). Default: ``64``.
        selector (str): How blocks are scored against the queries: ``"exact"``
            (softmax mass over every stored key; the oracle, O(store) per refresh),
            ``"quest"`` (per-channel min/max bound of a block's keys) or ``"mean"``
            (the block's mean key) or ``"token"`` (the largest probability one of the
            block's stored keys gets: ``mlx_stream.recall.score``; O(store) per refresh).
        prompt_selector (str, optional): How a prompt's end scores the blocks (its
            question's queries choose once per prompt, so it can afford to read every
            stored key); ``None``: ``selector``. Default: ``"token"``: on book
            haystacks with plain questions it ranked the needle's block in the top 3
            of 247 where Quest's bound ranked it 24th-126th (benchmarks/README.md,
            "Needles in books").
        prompt_neighbours (bool): A prompt's end chooses blocks in pairs: each block
            with the better-scoring of its two neighbours (a fact cut by a block
            boundary keeps both halves; ``mlx_stream.recall.select.with_neighbours``).
            Default: ``True``.
        placement (str): ``"stream"``: sinks, retrieved blocks, window, in stream
            order (each block keeps its own token spacing); ``"before"``: the blocks
            right before the sinks; ``"fixed"``: every retrieved token at the one
            position right before the sinks (InfLLM); ``"near"``: in stream order,
            right before the token the selection was refreshed at.
        prompt_placement (str, optional): Where the blocks a prompt's end chooses go
            (from the question's queries, for the prompt's re-fed tail and the
            answer up to the next block boundary); ``None``: ``placement``. Default:
            ``"near"``: a small model copies from a few hundred tokens back, not from
            the far end of its window (measured: the pass key read back at 16k tokens
            in 5 of 5 trials, against 0 of 3 with ``stream``), while ``stream`` keeps
            streaming perplexity no worse than the window alone (``near`` at every
            boundary made it 8.6% worse).
        bits (int, optional): Store keys and values quantized to 4 or 8 bits
            (``mx.quantize``, the window's quantization). Default: the model's dtype.
        group_size (int): Quantization group size of the store. Default: ``64``.
        ram_bytes (int): Host bytes the store may hold, its blocks and their summaries
            together (the summaries up to a quarter), before new segments spill to
            files in ``folder``. Default: 1 GB.
        folder (str, optional): Where spilled blocks go. Default: a temporary folder.
        index (str): How a ``quest`` (or ``mean``) refresh finds its blocks:
            ``"flat"`` scores every stored block; ``"tree"`` searches superblocks of 64
            blocks for a shortlist and reranks it (``mlx_stream.recall.index``: its
            bounds do not prune on real keys); ``"reuse"`` scans every block once per
            ``rescan`` refreshes and, in between, that scan's ``shortlist`` best, the
            blocks stored since and those the last prompt's end chose
            (``mlx_stream.recall.reuse``). Default: ``"reuse"``: the default model's
            time per 1k tokens the same at 128k as at 32k stored tokens, its streaming
            perplexity the flat scan's (benchmarks/README.md, "Refreshes between full
            scans").
        shortlist (int): Blocks the ``tree`` search reranks, or a ``reuse`` scan keeps;
            ``0``: ``max(8 * blocks, 64)``. Default: ``0``.
        rescan (int): A ``reuse`` index scans every block once per this many
            refreshes. Default: ``16``.
        expand (int): Superblocks one ``tree`` search expands at most (``0``: no cap).
            Default: ``0``.
        scan_stride (int): The ``token`` selector's first pass reads every this many
            layers' keys (``mlx_stream.recall.score.shortlisted_peaks``). Default: ``1``.
        scan_keep (int): Blocks that first pass keeps for every layer to rank; ``0``:
            one pass over every block and layer (the flat scan). Default: ``0``.
        refeed (int): At a prompt's end, its last tokens back to the start of this
            many blocks are fed again with the selection the prompt's queries chose
            (the slack grows to cover the rollback); ``0``: only the prompt's last
            token sees it. Default: ``2``.
    """

    blocks: int = DEFAULT_BLOCKS
    block: int = DEFAULT_BLOCK
    selector: str = "quest"
    placement: str = "stream"
    prompt_selector: str | None = "token"
    prompt_neighbours: bool = True
    prompt_placement: str | None = "near"
    bits: int | None = None
    group_size: int = 64
    ram_bytes: int = DEFAULT_RAM
    folder: str | None = None
    refeed: int = 2
    index: str = "reuse"
    scan_stride: int = 1
    scan_keep: int = 0
    shortlist: int = 0
    expand: int = 0
    rescan: int = 16

    @property
    def shortlist_blocks(self) -> int:
        """Blocks the ``tree`` search reranks or a ``reuse`` scan keeps (``shortlist``,
        or its default)."""
        return self.shortlist or max(8 * self.blocks, 64)

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise Unsupported(f"recall blocks must be at least 1 (got {self.blocks})")
        if self.block < 1:
            raise Unsupported(f"recall block size must be at least 1 (got {self.block})")
        if self.selector not in SELECTORS:
            raise Unsupported(
                f"recall selector must be one of {', '.join(SELECTORS)} (got {self.selector!r})"
            )
        if self.prompt_selector not in (*SELECTORS, None):
            raise Unsupported(f"recall prompt selector must be one of {', '.join(SELECTORS)} "
                              f"(got {self.prompt_selector!r})")  # fmt: skip
        for name in ("placement", "prompt_placement"):
            value = getattr(self, name)
            if value not in PLACEMENTS and (value is not None or name == "placement"):
                raise Unsupported(
                    f"recall {name.replace('_', ' ')} must be one of {', '.join(PLACEMENTS)} "
                    f"(got {value!r})"
                )
        if self.bits not in (None, 4, 8):
            raise Unsupported(f"recall store bits must be 4 or 8 (got {self.bits})")
        if self.group_size not in (32, 64, 128):
            raise Unsupported(f"recall group size must be 32, 64 or 128 (got {self.group_size})")
        if self.refeed < 0:
            raise Unsupported(f"recall refeed must be 0 or more blocks (got {self.refeed})")
        if self.index not in INDEXES:
            raise Unsupported(f"recall index must be one of {', '.join(INDEXES)} "
                              f"(got {self.index!r})")  # fmt: skip
        if self.scan_stride < 1 or self.scan_keep < 0:
            raise Unsupported("recall scan stride must be 1 or more and scan keep 0 or more")
        if self.shortlist < 0 or self.expand < 0:
            raise Unsupported("recall shortlist and expand must be 0 or more")
        if self.rescan < 1:
            raise Unsupported(f"recall rescan must be 1 or more refreshes (got {self.rescan})")
        if self.ram_bytes < 0:
            raise Unsupported(f"recall RAM budget must be 0 or more (got {self.ram_bytes})")

    @property
    def copies_sinks(self) -> bool:
        """Whether the region holds a moved copy of the sinks (``stream`` placement)."""
        return "stream" in (self.placement, self.prompt_placement)

    @property
    def region(self) -> int:
        """Slots of the retrieval region per layer (``blocks * block``)."""
        return self.blocks * self.block
