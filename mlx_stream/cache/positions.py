"""Where each cached tensor carries its position, how to move it, and the self-check
that proves it on the real model.

A ``Move`` names the part of a layer's cached tensors that carries positions (all of
the keys, a roped tail of the keys, the values slot for MLA, or nothing: NoPE) and the
rope that rotates it; moving by ``d`` positions is that rope applied with ``offset=d``.
``check_model`` runs the model on random tokens with probe caches at ``p`` and
``p + d`` and keeps, per layer, the one description that turns one into the other; it
also checks that a rebase leaves the next logits unchanged and whether the model reads
an additive mask. A layer no description fits is refused with one line; the verdict is
cached per model object. In full: docs/cache.md ("Positions and the self-check").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from mlx_stream.mlxlm import BaseCache, rope_freqs

SLOTS = ("keys", "values")
PROBE_AT, PROBE_SHIFT, PROBE_TOKENS = 5, 37, 3
# The logits are also compared this far apart: a cache hands the model offsets over a
# window and a rebase (1,027-2,051 at window 1024), so a dependence on the offset too
# weak to show over PROBE_SHIFT positions must show over this many.
PROBE_FAR = 2048


@dataclass(frozen=True, eq=False)
class Move:
    """The positioned part of a layer's cached tensors.

    Attributes:
        slot (int | None): 0 (keys) or 1 (values); ``None``: nothing carries a
            position (a NoPE layer), nothing ever moves.
        rope (nn.Module | None): The rope that rotated it.
        part (str): ``"all"``, ``"head"`` or ``"tail"``: the whole last axis, or the
            rope's ``dims`` at its start or end.
    """

    slot: int | None
    rope: nn.Module | None = None
    part: str = "all"
    _scale: list = field(default_factory=list, repr=False)

    @property
    def moves(self) -> bool:
        return self.slot is not None

    def describe(self) -> str:
        if self.slot is None:
            return "no position (NoPE)"
        where = {"all": "all dims", "head": "first dims", "tail": "last dims"}[self.part]
        dims = "" if self.part == "all" else f" {rope_dims(self.rope)}"
        return f"{SLOTS[self.slot]}, {where}{dims}, {type(self.rope).__name__}"

    def __call__(self, x: mx.array, d: int) -> mx.array:
        """``x`` (B, H, L, D), cached at positions ``P``, as if cached at ``P + d``."""
        if d == 0 or self.slot is None:
            return x
        B, H, L, D = x.shape
        r = rope_dims(self.rope) if self.part != "all" else D
        lo, hi = {"all": (0, D), "head": (0, r), "tail": (D - r, D)}[self.part]
        part = x[..., lo:hi] if (lo, hi) != (0, D) else x
        flat = part.reshape(B * H * L, 1, 1, hi - lo)  # one position per token
        moved = self.rope(flat, offset=d).reshape(B, H, L, hi - lo)
        scale = self.scale(hi - lo)
        if scale != 1.0:
            moved = moved / scale
        moved = moved.astype(x.dtype)
        if (lo, hi) == (0, D):
            return moved
        return mx.concatenate([x[..., :lo], moved, x[..., hi:]], axis=-1)

    def scale(self, dims: int) -> float:
        """The rope's magnitude factor (YaRN's mscale); 1.0 for a pure rotation."""
        if not self._scale:
            probe = mx.random.normal((4, 1, 1, dims), key=mx.random.key(0))
            out = self.rope(probe, offset=0)
            ratio = (mx.linalg.norm(out) / mx.linalg.norm(probe)).item()
            self._scale.append(1.0 if abs(ratio - 1.0) < 1e-4 else ratio)
        return self._scale[0]


NOPE = Move(None)


def rope_dims(rope: nn.Module) -> int | None:
    """How many dims the rope turns: its ``dims`` attribute, else twice the length of
    its frequency table (ropes that rotate all of what they are given)."""
    for name in ("dims", "dim", "rotary_dim", "rope_dim"):
        value = getattr(rope, name, None)
        if isinstance(value, int):
            return value
    freqs = rope_freqs(rope)
    return None if freqs is None else 2 * freqs.size


def rope_modules(module: nn.Module) -> list[nn.Module]:
    """Modules of ``module`` that look like a rope (by class or attribute name)."""
    found = []
    for name, m in module.named_modules():
        kind = type(m).__name__.lower()
        leaf = name.split(".")[-1].lower()
        if (
            isinstance(m, nn.RoPE)
            or "rope" in kind
            or "rotary" in kind
            or leaf
            in (
                "rope",
                "rotary_emb",
            )
        ):
            if callable(m) and all(m is not f for f in found):
                found.append(m)
    return found


def candidates(ropes: list[nn.Module]) -> list[Move]:
    out = []
    for slot in (0, 1):
        for rope in ropes:
            out.append(Move(slot, rope, "all"))
            if rope_dims(rope):
                out += [Move(slot, rope, "tail"), Move(slot, rope, "head")]
    return out


# ----------------------------------------------------------------------------- probe


class Probe(BaseCache):
    """A growing cache whose first token sits at ``offset`` and whose array masks hide
    key 0 from later rows (so a misread mask changes the logits). It records what the
    layer stored."""

    def __init__(self, offset: int, additive: bool, dtype):
        self.offset, self.additive, self.dtype = offset, additive, dtype
        self.keys = self.values = None
        self.first = None

    def update_and_fetch(self, keys, values):
        if self.first is None:
            self.first = (keys, values)
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def keys_and_values(self):
        return self.keys, self.values

    def size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    def is_trimmable(self) -> bool:
        return False

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        L0 = self.size()
        q = np.arange(L0, L0 + N)[:, None]
        t = np.arange(L0 + N)[None, :]
        seen = (t <= q) & ~((t == 0) & (q > 0))
        if window_size is not None:
            seen &= t > q - window_size
        if return_array or not self.additive:
            return mx.array(seen)
        return mx.array(np.where(seen, 0.0, -np.inf), dtype=self.dtype)

    def rebase(self, moves: Move, d: int) -> None:
        """Move every stored tensor by ``-d`` positions and lower the offset by ``d``."""
        if moves.moves:
            kv = [self.keys, self.values]
            kv[moves.slot] = moves(kv[moves.slot], -d)
            self.keys, self.values = kv
        self.offset -= d


def _run(model, caches_like: list, offset: int, additive: bool, tokens, dtype):
    caches = mlx_cache.make_prompt_cache(model)
    probes = {}
    for i in caches_like:
        caches[i] = probes[i] = Probe(offset, additive, dtype)
    logits = _pass(model, tokens[:, :PROBE_TOKENS], caches)
    return caches, probes, logits


def _pass(model, tokens, caches: list) -> mx.array:
    """One model call, evaluated at once with everything it cached.

    A pipeline-sharded model (mlx-lm's ``pipeline``) sends, receives and gathers
    inside the call: evaluated lazily, the last stage's cached tensors would pull the
    receives of every pass before any gather while the first stage's need no
    communication at all, and the ranks would wait on different collectives. One pass
    at a time runs the same collectives in the same order on every rank.
    """
    logits = model(tokens, cache=caches)
    mx.eval(logits, [c.state for c in caches if isinstance(c, Probe)])
    return logits


def _pipeline_group(model):
    """The group a pipeline-sharded model runs over, or ``None``."""
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        return mx.distributed.init()
    return None


REFUSAL_BYTES = 512


def _agree(model, refusal: str | None) -> str | None:
    """The refusal every rank of a pipeline takes: each rank checks only its own
    layers, and the passes that follow depend on the verdict, so all ranks must take
    the same branch (the first refusing stage's reason, in layer order)."""
    group = _pipeline_group(model)
    if group is None:
        return refusal
    data = (refusal or "").encode()[:REFUSAL_BYTES]
    row = np.zeros((1, REFUSAL_BYTES), np.uint8)
    row[0, : len(data)] = np.frombuffer(data, np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(row), group=group, stream=mx.cpu))
    for r in reversed(range(group.size())):  # the last rank holds the first layers
        text = rows[r].tobytes().rstrip(b"\0").decode(errors="replace")
        if text:
            return text
    return None


def _rel(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    if a.shape != b.shape:
        return float("inf")
    scale = mx.abs(b).max().item() + 1e-6
    return mx.abs(a - b).max().item() / scale


def _dtype(model) -> mx.Dtype:
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


def _vocab(model) -> int:
    args = getattr(model, "args", None)
    for name in ("vocab_size", "n_vocab"):
        value = getattr(args, name, None)
        if isinstance(value, int):
            return value
    return 32


@dataclass
class Verdict:
    """What the self-check found for one model.

    Attributes:
        moves (dict): Cache index -> ``Move`` for every plain ``KVCache`` layer.
        additive_mask (bool): Whether the model reads an additive mask correctly.
        refusal (str | None): Why ``positions="cache"`` would be inexact, or ``None``.
        rows (list): ``(cache index, description, status)`` for a report.
    """

    moves: dict
    additive_mask: bool
    refusal: str | None = None
    rows: list = field(default_factory=list)


_VERDICTS: dict[int, Verdict] = {}


def model_type(model) -> str:
    args = getattr(model, "args", None)
    return str(
        getattr(model, "model_type", None)
        or getattr(args, "model_type", None)
        or type(model).__module__.split(".")[-1]
    )


def check_model(model, caches: list) -> Verdict:
    """The self-check's verdict for ``model`` (computed once per model object).

    Args:
        model: An mlx-lm model.
        caches (list): ``make_prompt_cache(model)``: the layers to check are its plain
            ``KVCache`` entries.
    """
    key = id(model)
    if key not in _VERDICTS:
        _VERDICTS[key] = _check(model, caches)
        weakref.finalize(model, _VERDICTS.pop, key, None)
    return _VERDICTS[key]


def _tolerance(dtype) -> float:
    return 1e-3 if dtype == mx.float32 else 3e-2


def _check(model, caches: list) -> Verdict:
    name = model_type(model)
    plain = [i for i, c in enumerate(caches) if type(c) is mlx_cache.KVCache]
    if not plain:
        return Verdict({}, True)
    dtype = _dtype(model)
    tol = _tolerance(dtype)
    tokens = mx.random.randint(
        0, min(_vocab(model), 1000), (1, PROBE_TOKENS + 1), key=mx.random.key(3)
    )
    limit = position_limit(model)  # stay below it: the model is exact up to there
    far = PROBE_AT + min(PROBE_FAR, limit[0] - PROBE_AT - PROBE_TOKENS - 1 if limit else PROBE_FAR)
    try:
        at_p, probes_p, logits_p = _run(model, plain, PROBE_AT, False, tokens, dtype)
        at_q, probes_q, logits_q = _run(model, plain, PROBE_AT + PROBE_SHIFT, False, tokens, dtype)
        logits_far = _run(model, plain, far, False, tokens, dtype)[2]
    except Exception as e:  # noqa: BLE001 - any failure of a foreign model is a refusal
        msg = " ".join(str(e).split())[:200]
        return Verdict(
            {}, False, f"{name}: the self-check could not run it ({type(e).__name__}: {msg})"
        )
    layers = _layer_list(model)
    aligned = layers is not None and len(layers) == len(caches)
    first_layer = getattr(getattr(model, "model", None), "start_idx", 0) or 0  # pipeline
    moves, rows, refusal = {}, [], None
    for i in plain:
        if probes_p[i].first is None:
            moves[i] = NOPE  # never written (a layer this input does not reach)
            rows.append((i, NOPE.describe(), "unused"))
            continue
        ropes = rope_modules(layers[i] if aligned else model)
        move, error = _fit(probes_p[i].first, probes_q[i].first, ropes, tol)
        if move is None:
            refusal = refusal or (
                f"{name}: layer {first_layer + i}: its cached tensors change with position "
                f"in a way no rope move reproduces ({error})"
            )
            rows.append((i, "unknown", f"REFUSED ({error})"))
            moves[i] = None
        else:
            moves[i] = move
            rows.append((i, move.describe(), "ok"))
    refusal = _agree(model, refusal)
    if refusal is None:
        err, at = max((_rel(logits_q, logits_p), PROBE_AT + PROBE_SHIFT),
                      (_rel(logits_far, logits_p), far))  # fmt: skip
        if err > 10 * tol:
            refusal = (
                f"{name}: its logits depend on absolute positions, not only on distances "
                f"(relative difference {err:.2g} at positions {PROBE_AT} and {at}): "
                "something besides the rope reads cache.offset"
            )
    next_token = tokens[:, PROBE_TOKENS:]
    additive = True
    try:
        # The decode step at p reads an additive mask, the one at p + d (after a
        # rebase back to p) a boolean one: equal logits prove both at once (4 passes).
        for i in plain:
            probes_p[i].additive = True
        decoded_p = _pass(model, next_token, at_p)
        if refusal is None:
            for i in plain:
                probes_q[i].rebase(moves[i], PROBE_SHIFT)
            decoded_q = _pass(model, next_token, at_q)
            if _rel(decoded_q, decoded_p) > 10 * tol:  # which one differs? (2 passes)
                at_b, _, _ = _run(model, plain, PROBE_AT, False, tokens, dtype)
                decoded_b = _pass(model, next_token, at_b)
                additive = _rel(decoded_p, decoded_b) <= 10 * tol
                err = _rel(decoded_q, decoded_b)
                if err > 10 * tol:
                    refusal = (
                        f"{name}: moving the cached positions changes its next logits "
                        f"(relative difference {err:.2g}): state outside the attention "
                        "caches remembers absolute positions"
                    )
        else:
            at_b, _, _ = _run(model, plain, PROBE_AT, False, tokens, dtype)
            additive = _rel(decoded_p, _pass(model, next_token, at_b)) <= 10 * tol
    except Exception as e:  # noqa: BLE001
        msg = " ".join(str(e).split())[:200]
        refusal = refusal or f"{name}: the self-check could not run it ({type(e).__name__}: {msg})"
        additive = False
    return Verdict(moves, additive, refusal, rows)


def _fit(at_p, at_q, ropes, tol) -> tuple[Move | None, str]:
    """The description that moves what was cached at ``p`` onto what was cached at
    ``p + d``; ``(None, what differed)`` if none does."""
    errors = [_rel(at_p[s], at_q[s]) for s in (0, 1)]
    if max(errors) <= tol:
        return NOPE, ""
    best = (float("inf"), None)
    for move in candidates(ropes):
        other = 1 - move.slot
        if errors[other] > tol:
            continue
        try:
            err = _rel(move(at_p[move.slot], PROBE_SHIFT), at_q[move.slot])
        except Exception:  # noqa: BLE001 - a rope that cannot take this shape
            continue
        if err <= tol:
            return move, ""
        best = min(best, (err, move), key=lambda b: b[0])
    changed = " and ".join(SLOTS[s] for s in (0, 1) if errors[s] > tol)
    if not ropes:
        return None, f"{changed} change with position and the layer has no rope module"
    tried = f"; best rope move leaves {best[0]:.2g}" if best[1] is not None else ""
    return None, f"{changed} change with position{tried}"


def _layer_list(model):
    for owner in (model, getattr(model, "model", None), getattr(model, "language_model", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, list):
            return layers
    lm = getattr(model, "language_model", None)
    inner = getattr(lm, "model", None) if lm is not None else None
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, list) else None


def _config_dicts(model) -> list[dict]:
    args = getattr(model, "args", None)
    if args is None:
        return []
    top = dict(vars(args)) if hasattr(args, "__dict__") else {}
    out = [top]
    for value in list(top.values()):
        if isinstance(value, dict):
            out.append(value)
            out += [v for v in value.values() if isinstance(v, dict)]
    return out


def position_limit(model) -> tuple[int, str] | None:
    """``(limit, what)`` when the model reads ``cache.offset`` beyond its rope in a way
    that is harmless only while every position stays below ``limit`` (llama-4 query
    scaling); ``None`` otherwise."""
    for d in _config_dicts(model):
        if d.get("llama_4_scaling_beta") and d.get("original_max_position_embeddings"):
            return int(d["original_max_position_embeddings"]), "llama-4 query scaling"
        if d.get("attn_temperature_tuning") and d.get("floor_scale"):
            return int(d["floor_scale"]) - 1, "llama-4 attention temperature tuning"
    return None
