"""How far a bounded cache drifts from the full cache, on one text.

Contract: against the model's own full cache, every policy (sink + window caches,
optionally quantized or with the recall tier, or mlx-lm's ``RotatingKVCache``) is fed
the text in lockstep and measured per token (KL, top-1 agreement, NLL); at sampled
points each continues greedily on a copy and the first divergence is recorded.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import cache as mlx_cache

from mlx_stream.cache.sink import max_call_tokens
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.defaults import DEFAULT_CHUNK, DEFAULT_KV_GROUP_SIZE
from mlx_stream.generate.decode import generate_step
from mlx_stream.recall import tier_of

POSITIONS = ("cache", "absolute", "rotating")


@dataclass(frozen=True)
class Policy:
    """One bounded cache to compare with the full cache.

    Attributes:
        sinks: First tokens kept forever.
        window: Recent tokens each query sees.
        positions: ``"cache"`` (StreamingLLM positions), ``"absolute"`` (sinks at
            absolute positions, mlx-lm style) or ``"rotating"`` (mlx-lm's
            ``RotatingKVCache`` itself; float only).
        kv_bits: Bits of the stored values (and keys unless ``key_bits``); ``None``: float.
        key_bits: Bits of the stored keys when they differ from ``kv_bits``.
        kv_group_size: Quantization group size.
        recall (RecallSpec, optional): The recall tier on the sink cache.
    """

    sinks: int
    window: int
    positions: str = "cache"
    kv_bits: int | None = None
    key_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    recall: Any = None

    def __post_init__(self) -> None:
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}")
        if self.positions == "rotating" and self.kv_bits is not None:
            raise ValueError(
                "mlx-lm's RotatingKVCache cannot be quantized (its to_quantized is NYI)"
            )
        if self.recall is not None and self.positions != "cache":
            raise ValueError("recall needs cache positions (bounded positions)")
        self.spec  # noqa: B018 - refuses sizes a sink cache cannot have

    @property
    def spec(self) -> CacheSpec:
        """The sink cache's policy (for ``"rotating"``, its sizes under cache positions)."""
        positions = "cache" if self.positions == "rotating" else self.positions
        return CacheSpec(self.sinks, self.window, positions=positions, kv_bits=self.kv_bits,
                         kv_group_size=self.kv_group_size, key_bits=self.key_bits,
                         recall=self.recall)  # fmt: skip

    @property
    def kv(self) -> str:
        """``float``, ``8``, ``4`` or ``4k8`` (4-bit values, 8-bit keys)."""
        if self.kv_bits is None:
            return "float"
        if self.key_bits is None or self.key_bits == self.kv_bits:
            return str(self.kv_bits)
        return f"{self.kv_bits}k{self.key_bits}"

    def make_cache(self, model: nn.Module) -> list:
        """A fresh cache of this policy for ``model``."""
        if self.positions != "rotating":
            return self.spec.build(model, check_memory=False)
        return [
            mlx_cache.RotatingKVCache(max_size=self.sinks + self.window, keep=self.sinks)
            if type(c) is mlx_cache.KVCache
            else c
            for c in mlx_cache.make_prompt_cache(model)
        ]


@dataclass
class PolicyResult:
    """What :func:`divergence` measured for one policy.

    Per-token arrays have one row per fed token ``j`` (0..T-2): the query at token
    ``j`` predicting ``tokens[j + 1]``; ``points`` holds one entry per free-generation point:
    ``{position, first_divergence, mismatch}``, where ``first_divergence`` is how many
    greedy tokens matched the full cache's before the first that differs (``None``:
    none differs) and ``mismatch`` the share of positions from there on that differ.
    """

    policy: Policy
    kl: np.ndarray
    agree: np.ndarray
    nll: np.ndarray
    reference_nll: np.ndarray
    points: list[dict] = field(default_factory=list)

    def summary(self, segment: int = 1024) -> dict:
        """The figures as one JSON-ready dict (overall, after the window filled, and per
        ``segment`` stream tokens)."""
        p = self.policy
        tokens = int(self.kl.size)
        # Row j holds the query at token j (predicting j + 1): the first row whose
        # query has lost a token is sinks + window.
        evicted = slice(p.sinks + p.window, None)
        firsts = [pt["first_divergence"] for pt in self.points]
        diverged = [pt for pt in self.points if pt["first_divergence"] is not None]
        return {
            "window": p.window, "sinks": p.sinks, "positions": p.positions,
            "kv_bits": p.kv_bits, "key_bits": p.key_bits, "kv": p.kv, "tokens": tokens,
            "recall": None if p.recall is None else {"blocks": p.recall.blocks,
                                                     "bits": p.recall.bits},
            "evicted_tokens": int(self.kl[evicted].size),
            "kl": _mean(self.kl), "top1_agreement": _mean(self.agree),
            "kl_evicted": _mean(self.kl[evicted]),
            "top1_agreement_evicted": _mean(self.agree[evicted]),
            "perplexity": _ppl(self.nll), "reference_perplexity": _ppl(self.reference_nll),
            "points": len(self.points), "diverged": len(diverged),
            "first_divergence_median": median_first_divergence(firsts),
            "mismatch_after_divergence": (
                float(np.mean([pt["mismatch"] for pt in diverged])) if diverged else None
            ),
            "samples": self.points,
            "segments": self.segments(segment),
        }  # fmt: skip

    def segments(self, segment: int) -> list[dict]:
        out = []
        for start in range(0, self.kl.size + 1, segment):
            lo, hi = max(start, 1), min(start + segment, self.kl.size + 1)
            if hi <= lo:
                continue
            part = slice(lo - 1, hi - 1)
            out.append({"start": start, "end": hi, "tokens": hi - lo,
                        "kl": _mean(self.kl[part]), "top1_agreement": _mean(self.agree[part]),
                        "perplexity": _ppl(self.nll[part]),
                        "reference_perplexity": _ppl(self.reference_nll[part])})  # fmt: skip
        return out


def _mean(x: np.ndarray) -> float | None:
    return float(np.mean(x)) if x.size else None


def _ppl(nll: np.ndarray) -> float | None:
    return math.exp(float(np.mean(nll))) if nll.size else None


def median_first_divergence(firsts: Sequence[int | None]) -> float | None:
    """Median of first-divergence positions, a point that never diverged counting as
    later than any that did; ``None`` when that median falls on such a point."""
    if not firsts:
        return None
    values = sorted(math.inf if f is None else f for f in firsts)
    n = len(values)
    median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return None if math.isinf(median) else float(median)


def compare_generations(reference: Sequence[int], policy: Sequence[int]) -> dict:
    """``{first_divergence, mismatch}`` of two greedy continuations of one point."""
    n = min(len(reference), len(policy))
    first = next((i for i in range(n) if reference[i] != policy[i]), None)
    if first is None:
        return {"first_divergence": None, "mismatch": 0.0}
    differ = sum(reference[i] != policy[i] for i in range(first, n))
    return {"first_divergence": first, "mismatch": differ / (n - first)}


def sample_points(tokens: int, count: int, generate: int) -> list[int]:
    """``count`` free-generation points evenly spread over the second half of a stream of
    ``tokens`` tokens (each point ``p`` continues after ``tokens[p]``), ending where the
    ``generate`` tokens still fit in the stream: the full cache never runs longer than
    the text (so never past the model's context when the text is within it)."""
    last = tokens - 1 - generate
    if count <= 0 or generate <= 0 or last < 1:
        return []
    first = min(max(tokens // 2, 1), last)
    return sorted({int(round(x)) for x in np.linspace(first, last, count)})


def greedy(model: nn.Module, cache: list, first: int, n: int) -> list[int]:
    """``n`` greedy tokens continuing after feeding ``first`` into ``cache``."""
    return [token for token, _, _ in generate_step([first], model, cache, max_tokens=n)]


def divergence(
    model: nn.Module,
    tokens: Sequence[int],
    policies: Sequence[Policy],
    chunk: int = DEFAULT_CHUNK,
    points: Sequence[int] = (),
    generate: int = 32,
    callback: Callable[[int, int], None] | None = None,
) -> list[PolicyResult]:
    """Compare every policy with the full cache on ``tokens`` (one pass for all).

    Args:
        model (nn.Module): The model.
        tokens (Sequence[int]): The text, at most the model's context long (the full
            cache is the reference only where the model was trained).
        policies (Sequence[Policy]): The caches to compare.
        chunk (int): Most tokens per model call. Default: ``64``.
        points (Sequence[int]): Stream indices ``p`` (``0 <= p < len(tokens)``) where
            every cache, holding ``tokens[:p]``, is fed ``tokens[p]`` and continues
            greedily. Default: none.
        generate (int): Greedy tokens per point. Default: ``32``.
        callback (Callable[[int, int], None], optional): ``(tokens fed, total)`` after
            each call.

    Returns:
        list[PolicyResult]: One per policy, in order.
    """
    tokens = list(tokens)
    T = len(tokens)
    if T < 2:
        raise ValueError("the text must hold at least 2 tokens")
    points = sorted(set(points))
    if points and not (0 <= points[0] and points[-1] < T):
        raise ValueError(f"points must lie in 0..{T - 1}")
    reference = mlx_cache.make_prompt_cache(model)
    caches = [p.make_cache(model) for p in policies]
    arrays = [{k: np.zeros(T - 1) for k in ("kl", "agree", "nll", "ref")} for _ in policies]
    samples: list[list[dict]] = [[] for _ in policies]
    pending = list(points)
    pos = 0  # tokens fed; the next call predicts tokens[pos + 1...]
    while pos < T - 1 or pending:
        if pending and pending[0] == pos:
            _free_run(model, tokens[pos], pos, generate, reference, caches, samples)
            pending.pop(0)
            continue
        n = min(chunk, T - 1 - pos)
        for c in caches:
            bound = max_call_tokens(c)
            n = n if bound is None else min(n, bound)
        if pending:
            n = min(n, pending[0] - pos)
        x = mx.array(tokens[pos : pos + n])[None]
        targets = mx.array(tokens[pos + 1 : pos + n + 1])
        ref_lp = _logprobs(model(x, cache=reference)[0])
        ref_nll = -mx.take_along_axis(ref_lp, targets[:, None], axis=-1)[:, 0]
        ref_top = mx.argmax(ref_lp, axis=-1)
        ref_p = mx.exp(ref_lp)
        out = []
        for c in caches:
            lp = _logprobs(model(x, cache=c)[0])
            kl = mx.sum(ref_p * (ref_lp - lp), axis=-1)
            agree = mx.argmax(lp, axis=-1) == ref_top
            nll = -mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
            out.append((kl, agree, nll))
        mx.eval(ref_nll, out, [[layer.state for layer in c] for c in [reference, *caches]])
        for a, (kl, agree, nll) in zip(arrays, out, strict=True):
            a["kl"][pos : pos + n] = np.array(kl)
            a["agree"][pos : pos + n] = np.array(agree)
            a["nll"][pos : pos + n] = np.array(nll)
            a["ref"][pos : pos + n] = np.array(ref_nll)
        pos += n
        if callback is not None:
            callback(pos, T - 1)
    for c in caches:
        tier = tier_of(c)
        if tier is not None:
            tier.close()  # the store's temporary files
    return [
        PolicyResult(p, np.maximum(a["kl"], 0.0), a["agree"], a["nll"], a["ref"], s)
        for p, a, s in zip(policies, arrays, samples, strict=True)
    ]


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _free_run(model, first, pos, generate, reference, caches, samples) -> None:
    """Greedy continuations from copies of every cache at stream index ``pos``."""
    ref = greedy(model, copy.deepcopy(reference), first, generate)
    for c, s in zip(caches, samples, strict=True):
        tier = tier_of(c)
        mark = None if tier is None else tier.mark()
        mine = greedy(model, copy.deepcopy(c), first, generate)
        if tier is not None:
            tier.rewind(c, mark)  # the copy ran on the shared tier
        s.append({"position": pos, **compare_generations(ref, mine)})
