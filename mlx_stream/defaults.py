"""Defaults and choices shared by the engine and the CLI, defined once.

No imports: the CLI reads these at module level and must stay instant to start.
"""

from __future__ import annotations

# The rolling cache (mlx_stream.cache.sink).
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 1024
DEFAULT_STRIDE = 64
DEFAULT_SLACK = 0  # slack serves rollback only: a multi-token call needs none
POSITIONS = ("cache", "absolute")
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = 64

# The recall tier (mlx_stream.recall).
DEFAULT_RECALL_BLOCKS = 8
DEFAULT_RECALL_RAM_MB = 1024

# Decoding and evaluation (mlx_stream.generate.decode, mlx_stream.eval.perplexity).
DEFAULT_MAX_TOKENS = 256
# A server request that sets no max_tokens (Codex sends none): room for an agent's whole
# answer (a cut reply reads to an agent as a failed turn), still an end for a model that
# never stops.
DEFAULT_SERVE_MAX_TOKENS = 4096
# The most any server request may ask for (serve --max-tokens-ceiling; 0: none): 8x the
# default, room for any real answer, an end for a client asking 10^30 of CPU time.
DEFAULT_MAX_TOKENS_CEILING = 32768
DEFAULT_NUM_DRAFT_TOKENS = 3
# chat and serve end a reply whose last this-many tokens repeat one span at least four
# times (mlx_stream.generate.loops): a small model's loop would otherwise run to
# max_tokens, and an agent client takes a reply cut there as a failed turn.
DEFAULT_STOP_LOOPS = 256
LOOP_REPEATS = 4  # the fewest times a span repeats in those tokens to count as a loop
DEFAULT_CHUNK = 64
DEFAULT_CHECKPOINT_EVERY = 4096

# Tokens one server request may feed (mlx_stream.serve.engine: a new session's whole
# history, else its new messages): a long prompt streams through the window a chunk per
# round like any other, so this only guards against a runaway client. 256k covers the
# 200k-token conversations coding agents keep before they compact them.
DEFAULT_MAX_PROMPT_TOKENS = 262144
# Tokens of a rendered system prompt that serve pins as a session's sinks (keep_system);
# the rest flows through the window. An agent's prompt runs to 6-20k tokens: its head
# (who the assistant is, the rules) stays, its tool list streams by and recall keeps it.
DEFAULT_PIN_TOKENS = 1024
# serve's connections (mlx_stream.serve.transport): seconds a request line and its
# headers may take, and connections open at once (open-file limits are often 1,024).
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_MAX_CONNECTIONS = 256

# Reclaiming MLX's buffer pool (mlx_stream.cache.reclaim).
DEFAULT_RECLAIM_EVERY = 256
RECLAIM_MODES = ("crossing", "exact", "none")


def slack_for(num_draft_tokens: int = 0) -> int:
    """Slack a SinkCache needs: the rollback of a speculative verify block of
    ``num_draft_tokens + 1`` tokens (``trim(n)`` is exact for ``n <= slack + 1``); none
    without drafts (a chat turn trims one token at most)."""
    return num_draft_tokens + 1 if num_draft_tokens > 0 else DEFAULT_SLACK


#: Tokens after an edit in the middle of a conversation computed again
#: (``serve --repair-tokens``, ``mlx_stream.generate.repair``): the value the repair
#: benchmark chose (benchmarks/README.md, "Repair after an edit").
DEFAULT_REPAIR_TOKENS = 128
