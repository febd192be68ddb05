"""What recall refuses before the first token (one line each), and the slack it needs;
``check`` installs the attention hook on a model it can serve."""

from __future__ import annotations

from mlx_lm.models import cache as mlx_cache

import mlx_stream.recall.hook as hook
from mlx_stream.cache.positions import model_type
from mlx_stream.errors import Unsupported
from mlx_stream.recall.spec import REFEED, RecallSpec


def min_slack(window: int, block: int) -> int:
    """Slack that keeps a block in the ring until the first call that can store it:
    a block is whole past the window ``block - 1 + window`` tokens after its start,
    the next call start at a multiple of ``block`` comes at most ``(1 - window) % block``
    tokens later, and its first token is overwritten ``window + slack`` tokens after it."""
    return block - 1 + (1 - window) % block


def check(model, caches: list, verdict, spec: RecallSpec, window: int, stride: int,
          positions: str, slack: int) -> int:  # fmt: skip
    """Refuse, with one line, what recall cannot serve; install the attention hook;
    return the slack the cache needs."""
    name = model_type(model)
    if positions != "cache":
        raise Unsupported("recall needs positions='cache' (bounded positions)")
    if spec.block != stride:
        raise Unsupported(
            f"the recall block ({spec.block}) must equal the cache stride ({stride}): blocks "
            "are cut and selections refreshed at stride boundaries"
        )
    layers = [i for i, c in enumerate(caches) if type(c) is mlx_cache.KVCache]
    if not layers:
        raise Unsupported(f"{name}: no layer keeps an unbounded cache: nothing to recall")
    for i in layers:
        move = verdict.moves.get(i)
        if move is not None and move.moves and (move.slot != 0 or move.part != "all"):
            raise Unsupported(
                f"{name}: layer {i} keeps its positions in {move.describe()}; recall "
                "supports keys roped on all of their dims"
            )
    if spec.bits is not None:
        from mlx_stream.cache.estimate import model_layout

        layout = model_layout(model)
        for dim in (layout.key_dim, layout.value_dim):
            if dim % spec.group_size:
                raise Unsupported(
                    f"the recall store's group size {spec.group_size} does not divide the "
                    f"head dimension {dim}; use one that does"
                )
    hook.install(model, layers, name)
    return max(slack, min_slack(window, spec.block), REFEED * spec.block)
