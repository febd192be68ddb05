"""The options, each declared once: ``Annotated`` aliases, and the groups of them
several commands share (:class:`ModelOptions`, :class:`CacheOptions`, ...; taken as
one parameter through :func:`cli.groups.grouped`), each turning itself into the
engine's value (a loaded model, ``CacheSpec``, ``Sampling``, ``RecallSpec``). The
engine is imported inside those methods, so ``mlx-stream --help`` stays instant.

Ranges are checked inside the commands (``cli.checks``), not with
``typer.Option(min=...)``: a bad value must give one plain line on stderr, not a box.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, ClassVar

import typer

from mlx_stream.defaults import (  # noqa: F401 - the commands read them from here
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_CHUNK,
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_RECALL_BLOCKS,
    DEFAULT_RECALL_RAM_MB,
    DEFAULT_RECLAIM_EVERY,
)
from mlx_stream.prefix_store import DEFAULT_MB as DEFAULT_PREFIX_STORE_MB  # noqa: F401

from .groups import OptionGroup

# Defaults of the CLI only.
DEFAULT_SEGMENT = 1024
DEFAULT_PROFILE_TOKENS = 1000

Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        envvar="MLX_STREAM_MODEL",
        help="Registry name, MLX model folder or .gguf file. Default: the registry default.",
        show_envvar=True,
    ),
]
Sinks = Annotated[
    int | None,
    typer.Option(help="Attention-sink tokens kept forever. Default: the model's registry entry."),
]
Window = Annotated[
    int | None,
    typer.Option(help="Recent tokens kept in the rolling window. Default: the registry entry."),
]
Dtype = Annotated[
    str,
    typer.Option(
        help="Weights dtype: auto (float32 on the CPU, quantized on a GPU), float32, "
        "float16, bfloat16, or quantized (as stored: a 4-bit model stays 4-bit)."
    ),
]
MaxTokens = Annotated[
    int,
    typer.Option("--max-tokens", help="Most tokens generated per reply."),
]
_SAMPLING_DEFAULT = "Default: the model's generation_config.json, else"
Temp = Annotated[
    float | None,
    typer.Option(
        help=f"Sampling temperature; 0 is greedy. {_SAMPLING_DEFAULT} 0.7.", show_default=False
    ),
]
TopP = Annotated[
    float | None,
    typer.Option(
        "--top-p",
        help=f"Nucleus sampling: the probability mass kept. {_SAMPLING_DEFAULT} 0.9.",
        show_default=False,
    ),
]
TopK = Annotated[
    int | None,
    typer.Option(
        "--top-k",
        help=f"Sample among the k likeliest tokens; 0 is off. {_SAMPLING_DEFAULT} 40.",
        show_default=False,
    ),
]
RepetitionPenalty = Annotated[
    float | None,
    typer.Option(
        "--repetition-penalty",
        help=f"Penalty on tokens of the last 20; 1 is off. {_SAMPLING_DEFAULT} 1.1.",
        show_default=False,
    ),
]
Seed = Annotated[
    int | None, typer.Option(help="Random seed: the same seed gives the same samples.")
]
DraftModel = Annotated[
    str | None,
    typer.Option("--draft-model", help="A smaller model with the same tokenizer (speculative)."),
]
NumDraftTokens = Annotated[
    int,
    typer.Option("--num-draft-tokens", help="Tokens drafted per speculative round."),
]
KvBits = Annotated[
    int | None,
    typer.Option(
        "--kv-bits",
        help="Store the KV cache quantized to 4 or 8 bits (keys per channel, the newest "
        "in float; sinks keep a full-precision copy).",
    ),
]
KvKeyBits = Annotated[
    int | None,
    typer.Option(
        "--kv-key-bits",
        help="Bits for the keys when they differ from --kv-bits (8: 8-bit keys).",
    ),
]
KvGroupSize = Annotated[
    int,
    typer.Option("--kv-group-size", help="Quantization group size for --kv-bits: 32, 64, 128."),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
Csv = Annotated[Path | None, typer.Option("--csv", help="Write per-row CSV here (atomic).")]
Prompt = Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text.")]
JsonSchema = Annotated[
    Path | None,
    typer.Option("--json-schema", help="Constrain replies to JSON matching this JSON Schema file."),
]

# chat
System = Annotated[str | None, typer.Option(help="System prompt.")]
KeepSystem = Annotated[
    bool,
    typer.Option(
        "--keep-system",
        help="Make the whole rendered system prompt the sinks, so it is never evicted.",
    ),
]

# stream-run
Positions = Annotated[
    str,
    typer.Option(
        help="RoPE positions: 'cache' (bounded, StreamingLLM) or 'absolute' (mlx-lm style).",
    ),
]
Chunk = Annotated[int, typer.Option(help="Tokens scored per forward pass.")]
Segment = Annotated[int, typer.Option(help="Tokens per reported perplexity segment.")]
LimitTokens = Annotated[
    int | None,
    typer.Option("--limit-tokens", help="Stop after this many tokens."),
]
Checkpoint = Annotated[
    Path | None,
    typer.Option(help="Save the cache and running totals here as the stream goes (atomic)."),
]
CheckpointEvery = Annotated[
    int,
    typer.Option("--checkpoint-every", help="Tokens between checkpoints (and one on Ctrl-C)."),
]
Resume = Annotated[
    Path | None,
    typer.Option(help="Continue from a checkpoint written by --checkpoint."),
]

# profile
Tokens = Annotated[int, typer.Option("--tokens", "-n", help="Tokens to generate.")]
PromptFile = Annotated[
    Path | None,
    typer.Option("--file", "-f", help="Read the prompt from this text file."),
]
CacheKind = Annotated[
    str,
    typer.Option(
        "--cache",
        help="KV cache: 'sink' (ours), 'full' (grows), 'rotating' (mlx-lm RotatingKVCache).",
    ),
]
Schedule = Annotated[
    str,
    typer.Option(
        help="When to return MLX's buffer pool: 'crossing', 'exact' (n % every == 0), 'none'.",
    ),
]
Every = Annotated[int, typer.Option(help="Reclaim cadence in tokens.")]
Compare = Annotated[
    bool,
    typer.Option(
        "--compare",
        help="Run several settings: sink/full/rotating, or with --draft-model the schedules.",
    ),
]
Plot = Annotated[
    Path | None,
    typer.Option("--plot", help="Save a PNG of memory against tokens (needs matplotlib)."),
]
Distributed = Annotated[
    str,
    typer.Option(
        "--distributed",
        help="Shard the model over the ranks of mlx.launch: auto (when launched), tensor, "
        "pipeline or off.",
    ),
]

# The recall tier (mlx_stream.recall): evicted context brought back into attention.
_CONTEXT: list = []  # the running command's context, kept by the --recall-* options


def _keep_context(ctx: typer.Context, param: typer.CallbackParam, value):
    """Keep the running command's context (until it closes): ``--recall``'s options
    take the model's registry defaults only where the command line did not give them
    (``cli.common.recall_spec``)."""
    if not _CONTEXT or _CONTEXT[0] is not ctx:
        _CONTEXT[:] = [ctx]
        ctx.call_on_close(_CONTEXT.clear)
    return value


def command_context():
    """The running command's context (set by its ``--recall-*`` options), or ``None``."""
    return _CONTEXT[0] if _CONTEXT else None


Recall = Annotated[
    bool,
    typer.Option(
        "--recall",
        help="Keep what leaves the window (host memory, then disk) and bring the blocks the "
        "queries need back into attention; device memory stays fixed.",
    ),
]
RecallBlocks = Annotated[
    int,
    typer.Option(
        "--recall-blocks",
        help="Blocks of 64 tokens brought back per step. Default: the model's registry "
        "entry's, else 8.",
        callback=_keep_context,
    ),
]
RecallBits = Annotated[
    int | None,
    typer.Option(
        "--recall-bits",
        help="Store evicted blocks at 4 or 8 bits. Default: the registry entry's, else the "
        "model's dtype.",
        callback=_keep_context,
    ),
]
RecallRam = Annotated[
    int,
    typer.Option(
        "--recall-ram",
        help="MB of host memory for the store before it spills to disk. Default: the "
        "registry entry's, else 1024.",
        callback=_keep_context,
    ),
]
RecallDir = Annotated[
    Path | None,
    typer.Option("--recall-dir", help="Folder for the spilled store. Default: a temporary folder."),
]
PrefixStoreDir = Annotated[
    Path | None,
    typer.Option(
        "--prefix-store",
        help="Folder of the prefix store: the cache after a system prompt, shared by "
        "chat and serve and by every process. Default: prefixes/ in the user cache.",
        show_default=False,
    ),
]
PrefixStoreMb = Annotated[
    int,
    typer.Option(
        "--prefix-store-mb",
        help="MB the prefix store may take; least recently used entries go first.",
    ),
]
NoPrefixStore = Annotated[
    bool,
    typer.Option("--no-prefix-store", help="Neither read nor write the prefix store."),
]


# The groups: what several commands share, each option in one of them.


@dataclasses.dataclass(frozen=True)
class ModelOptions(OptionGroup):
    """The model and how it is loaded."""

    panel: ClassVar[str | None] = "Model"
    model: Model = None
    dtype: Dtype = "auto"
    distributed: Distributed = "auto"

    def join(self) -> Any:
        """The ``mlx.launch`` cluster ``--distributed`` joins, or ``None``."""
        from mlx_stream import distributed as dist

        return dist.join(self.distributed, self.model)

    def load(self, cache: CacheOptions, cluster: Any = None, **options: Any):
        """Load the model (``loading.load_for_cache``): fit-checked against ``cache``
        and sharded over ``cluster``; ``options`` as for :meth:`CacheOptions.spec`.

        Returns:
            ``(model, tokenizer, entry, cache_spec, path)``: ``entry`` the registry
            entry (None for a path), ``path`` the mlx-lm folder loaded.
        """
        from mlx_stream import distributed as dist

        from .loading import load_for_cache

        return load_for_cache(
            self.model, self.dtype, cache.sinks, cache.window, prepare=dist.preparer(cluster),
            with_path=True, **cache.kv(), **options,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CacheOptions(OptionGroup):
    """The sink cache's sizes and its quantization."""

    panel: ClassVar[str | None] = "KV cache"
    sinks: Sinks = None
    window: Window = None
    kv_bits: KvBits = None
    kv_group_size: KvGroupSize = DEFAULT_KV_GROUP_SIZE
    kv_key_bits: KvKeyBits = None

    def kv(self) -> dict[str, Any]:
        """The quantization as ``CacheSpec`` spells it."""
        return {"kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size,
                "key_bits": self.kv_key_bits}  # fmt: skip

    def check(self, positions: str = "cache") -> None:
        """One-line error naming the flag, before any model loads."""
        from .checks import check_cache

        check_cache(self.sinks, self.window, positions, **self.kv())

    def spec(self, entry: Any, **options: Any) -> Any:
        """The ``CacheSpec``: the registry entry's (None for a path) with these options
        over it (``options``: ``positions``, ``num_draft_tokens``, ``recall``)."""
        from .loading import cache_spec

        return cache_spec(entry, self.sinks, self.window, **self.kv(), **options)


@dataclasses.dataclass(frozen=True)
class SamplingOptions(OptionGroup):
    """How replies are sampled, over the model's defaults."""

    panel: ClassVar[str | None] = "Sampling"
    temp: Temp = None
    top_p: TopP = None
    top_k: TopK = None
    repetition_penalty: RepetitionPenalty = None
    seed: Seed = None

    def check(self) -> None:
        """One-line error for a value out of range."""
        from .checks import check_sampling

        check_sampling(self.temp, self.top_p, self.top_k, self.repetition_penalty)

    def sampling(self, model_path: Any) -> Any:
        """The ``Sampling``: the model's defaults with the options given over them."""
        from .checks import sampling

        return sampling(model_path, self.temp, self.top_p, self.top_k, self.repetition_penalty)


@dataclasses.dataclass(frozen=True)
class DraftOptions(OptionGroup):
    """Speculative decoding."""

    panel: ClassVar[str | None] = "Speculative decoding"
    draft_model: DraftModel = None
    num_draft_tokens: NumDraftTokens = DEFAULT_NUM_DRAFT_TOKENS

    def check(self) -> None:
        """One-line error for a bad ``--num-draft-tokens``."""
        from .checks import check_positive

        check_positive(self.num_draft_tokens, "--num-draft-tokens")

    def load(self, dtype: str) -> Any:
        """The draft model, or ``None`` without ``--draft-model``."""
        from .loading import load_model

        if not self.draft_model:
            return None
        return load_model(self.draft_model, dtype, what="draft model")[0]


@dataclasses.dataclass(frozen=True)
class RecallOptions(OptionGroup):
    """The recall tier: what leaves the window, kept and brought back."""

    panel: ClassVar[str | None] = "Recall"
    recall: Recall = False
    recall_blocks: RecallBlocks = DEFAULT_RECALL_BLOCKS
    recall_bits: RecallBits = None
    recall_ram: RecallRam = DEFAULT_RECALL_RAM_MB
    recall_dir: RecallDir = None

    def spec(self) -> Any:
        """The ``RecallSpec`` (``None`` without ``--recall``; ``loading.recall_spec``)."""
        from .loading import recall_spec

        return recall_spec(self.recall, self.recall_blocks, self.recall_bits, self.recall_ram,
                           self.recall_dir)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PrefixStoreOptions(OptionGroup):
    """The prefix store on disk, shared by chat and serve."""

    panel: ClassVar[str | None] = "Prefix store"
    prefix_store_dir: PrefixStoreDir = None
    prefix_store_mb: PrefixStoreMb = DEFAULT_PREFIX_STORE_MB
    no_prefix_store: NoPrefixStore = False

    def open(self) -> Any:
        """The ``PrefixStore``, or ``None`` when off (``loading.prefix_store``)."""
        from .loading import prefix_store

        return prefix_store(self.prefix_store_dir, self.prefix_store_mb, self.no_prefix_store)


@dataclasses.dataclass(frozen=True)
class ReplyOptions(OptionGroup):
    """The prompt and the reply to it (the command's own panel)."""

    prompt: Prompt = None
    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS
    json_schema: JsonSchema = None


@dataclasses.dataclass(frozen=True)
class OutputOptions(OptionGroup):
    """What the command writes besides its table (the command's own panel)."""

    json_out: Json = False
    csv: Csv = None


@dataclasses.dataclass(frozen=True)
class ScoringOptions(OptionGroup):
    """How a text is scored (the command's own panel)."""

    chunk: Chunk = DEFAULT_CHUNK
    segment: Segment = DEFAULT_SEGMENT
    limit_tokens: LimitTokens = None

    def check(self) -> None:
        """One-line error for a bad value."""
        from .checks import check_positive

        check_positive(self.chunk, "--chunk")
        check_positive(self.segment, "--segment")
        check_positive(self.limit_tokens, "--limit-tokens", 2)
