"""Tiny random configs for every text architecture the installed mlx-lm ships.

``architectures()`` discovers the modules of ``mlx_lm.models`` that define ``ModelArgs``
and ``Model`` (a new mlx-lm module is picked up without editing this file).
``tiny_config(arch)`` fills the module's ``ModelArgs`` fields by name with small sizes;
``OVERRIDES`` holds the few per-architecture values the names cannot give. Variants
(``VARIANTS``) give a 1-layer model of each further layer type of a hybrid model.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing

import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_flatten

NOT_ARCHITECTURES = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline"}

# Sizes by field name: small, mutually consistent (hidden 64 = 4 heads x 16).
SIZES = {
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "dim": 64,
    "model_dim": 64,
    "n_embed": 64,
    "hidden_dim": 64,
    "embed_dim": 64,
    "num_hidden_layers": 1,
    "n_layer": 1,
    "n_layers": 1,
    "num_layers": 1,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "n_kv_heads": 2,
    "num_kv_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 16,
    "attention_head_dim": 16,
    "kv_channels": 16,
    "vocab_size": 64,
    "n_vocab": 64,
    "padded_vocab_size": 64,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    "max_position_embeddings": 4096,
    "n_positions": 4096,
    "seq_length": 4096,
    "max_seq_len": 4096,
    "n_ctx": 4096,
    "context_length": 4096,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "conv_kernel": 4,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "state_size": 16,
    "d_state": 16,
    "d_conv": 4,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "time_step_rank": 8,
    "sliding_window": 8,
    "attention_window_size": 8,
    "rope_head_dim": 8,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 4,
    "decoder_sparse_step": 1,
    "rope_theta": 10000.0,
    "rotary_emb_base": 10000.0,
    "rope_base": 10000.0,
    "partial_rotary_factor": 0.5,
    "rotary_pct": 0.5,
}
KEEP_LARGE = ("position", "window", "floor", "original", "max_", "theta", "base", "chunk")
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
TYPE_DEFAULTS = {int: 1, float: 1e-5, bool: False, str: ""}

# Values field names cannot give (architecture-specific rules of the config).
LLAMA4_SCALING = {
    "rope_theta": 10000.0,
    "rope_type": "default",
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 8192,
}
KIMI_LINEAR = {
    "kda_layers": [1],
    "full_attn_layers": [2],
    "head_dim": 16,
    "num_heads": 4,
    "short_conv_kernel_size": 4,
}
OVERRIDES: dict[str, dict] = {
    "gemma4_text": {"num_kv_shared_layers": 0, "layer_types": ["full_attention"]},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "glm_moe_dsa": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    "mimo_v2_flash": {"hybrid_layer_pattern": [0], "moe_layer_freq": [0]},
    "mamba2": {"time_step_limit": [0.0, 1000.0]},
    "kimi_k3": {"num_hidden_layers": 2, "linear_attn_config": KIMI_LINEAR},
    "llama4": {"text_config": {"num_experts_per_tok": 1}},
    "bailing_moe_linear": {"layer_group_size": 2, "num_hidden_layers": 2},
    "minicpm3": {"rope_scaling": {"type": "default"}},
    "mistral4": {"rope_parameters": LLAMA4_SCALING},
    "ministral3": {"rope_parameters": LLAMA4_SCALING},
    "gptj": {"rotary_dim": 8},
    "phixtral": {"rotary_dim": 8},
    "minimax": {"rotary_dim": 8},
    "plamo": {"n_shared_head": 2},
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "baichuan_m1": {"conv_window": 2, "sliding_window_layers": []},
    "deepseek_v2": {
        "rope_scaling": {
            "type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        }
    },
    "afmoe": {"layer_types": ["full_attention"]},
    "gear": {"layer_types": ["full_attention"]},
    "mellum": {
        "layer_types": ["full_attention"],
        "rope_parameters": {
            t: {"rope_theta": 10000.0, "rope_type": "default"}
            for t in ("full_attention", "sliding_attention")
        },
    },
    "exaone_moe": {"layer_types": ["full_attention"], "is_moe_layer": [True]},
    "gemma3n": {"layer_types": ["full_attention"], "activation_sparsity_pattern": [0.0]},
    "granitemoehybrid": {
        "layer_types": ["attention"],
        "shared_intermediate_size": 32,
        "mamba_expand": 2,
    },
    "jamba": {  # a mamba layer, then an attention layer (the model needs both)
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 0,
        "expert_layer_period": 1,
        "num_hidden_layers": 2,
    },
    "nemotron_h": {"hybrid_override_pattern": ["M", "*"], "num_hidden_layers": 2},
    "llama4_text": {"no_rope_layers": [1]},
    "lfm2": {
        "full_attn_idxs": [0],
        "block_ff_dim": 128,
        "block_dim": 64,
        "conv_L_cache": 3,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
    },
    "lfm2_moe": {"full_attn_idxs": [0], "block_dim": 64, "conv_L_cache": 3, "num_dense_layers": 1},
    "recurrent_gemma": {"block_types": ["attention"]},
    "kimi_linear": {
        "num_hidden_layers": 2,
        "linear_attn_config": {
            "kda_layers": [1],
            "full_attn_layers": [2],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
    },
    "openelm": {
        "num_query_heads": [4],
        "num_kv_heads": [2],
        "ffn_multipliers": [2.0],
        "head_dim": 16,
        "model_dim": 64,
    },
    "dbrx": {
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
    },
}

# Architectures whose tiny model kills the process in mlx-lm's own code (checked by
# hand: a plain KVCache, one 3-token call): they cannot run inside the test process.
PROCESS_KILLERS = {
    "phi3small": "mlx-lm's own multi-token call segfaults on the CPU backend (block-sparse "
    "attention)",
}

# Further 1-layer variants of hybrid models: {arch: {variant name: overrides}}.
SLIDING_THEN_FULL = {"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2}
VARIANTS: dict[str, dict[str, dict]] = {
    "gemma4_text": {
        "sliding": {"layer_types": ["sliding_attention"]},
        "kv_shared": {  # the second layer reads the first one's cache (keys_and_values)
            "num_kv_shared_layers": 1,
            "layer_types": ["full_attention", "full_attention"],
            "num_hidden_layers": 2,
        },
    },
    "bailing_hybrid": {"linear": {"layer_group_size": 2, "num_hidden_layers": 2}},
    "afmoe": {"sliding": SLIDING_THEN_FULL},
    "gear": {"sliding": SLIDING_THEN_FULL},
    "mellum": {"sliding": SLIDING_THEN_FULL},
    "granitemoehybrid": {"mamba": {"layer_types": ["mamba"]}},
    "nemotron_h": {
        "moe": {"hybrid_override_pattern": ["E", "*"], "num_hidden_layers": 2},
    },
    "llama4_text": {"nope": {"no_rope_layers": [0]}},
    "lfm2": {"conv": {"full_attn_idxs": [1], "num_hidden_layers": 2}},
    "recurrent_gemma": {
        "recurrent": {"block_types": ["recurrent", "attention"], "num_hidden_layers": 2}
    },
}


def architectures() -> list[str]:
    """Every module of ``mlx_lm.models`` that defines ``ModelArgs`` and ``Model``."""
    names = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        if info.name in NOT_ARCHITECTURES:
            continue
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):  # noqa: BLE001 - an optional dependency missing
            names.append(info.name)
            continue
        if hasattr(module, "ModelArgs") and hasattr(module, "Model"):
            names.append(info.name)
    return sorted(names)


def _fill(cls, overrides: dict) -> dict:
    config = {}
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.name in SIZES:
            config[f.name] = SIZES[f.name]
        elif (
            isinstance(f.default, int)
            and not isinstance(f.default, bool)
            and f.default > 256
            and not any(w in f.name for w in KEEP_LARGE)
        ):
            config[f.name] = 64  # a size (vocab, width...) a tiny model shrinks
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kind = hints.get(f.name)
            origin = typing.get_origin(kind)
            if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
                args = [a for a in typing.get_args(kind) if a is not type(None)]
                kind = args[0] if args else None
            if typing.get_origin(kind) in (list, tuple) or kind in (list, tuple):
                config[f.name] = []
            elif typing.get_origin(kind) is dict or kind is dict:
                config[f.name] = {}
            else:
                config[f.name] = TYPE_DEFAULTS.get(kind, None)
    config.update(overrides)
    return config


def _imported_architectures(module) -> list[str]:
    """Model modules a wrapper imports (``from . import llama``): its text model."""
    import inspect
    import re

    source = inspect.getsource(module)
    names = []
    for line in re.findall(r"^from \. import (.+)$", source, flags=re.M):
        names += [n.strip() for n in line.split(",")]
    return [n for n in names if n not in NOT_ARCHITECTURES]


def tiny_config(arch: str, variant: str | None = None) -> dict:
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    overrides = dict(OVERRIDES.get(arch, {}))
    if variant:
        overrides.update(VARIANTS[arch][variant])
    config = _fill(module.ModelArgs, overrides)
    config.setdefault("model_type", arch)
    if not config.get("model_type"):
        config["model_type"] = arch
    text, text_arch = getattr(module, "TextConfig", None) or getattr(module, "TextArgs", None), arch
    if text is None:
        for name in [f"{arch}_text", *_imported_architectures(module)]:
            try:
                text = importlib.import_module(f"mlx_lm.models.{name}").ModelArgs
            except (ImportError, AttributeError):
                continue
            text_arch = name
            break
    for nested in ("text_config", "llm_config"):
        if nested in config or nested in {f.name for f in dataclasses.fields(module.ModelArgs)}:
            if text is None:
                inner = dict(SIZES)
            else:
                inner = _fill(text, OVERRIDES.get(text_arch, {}) if text_arch != arch else {})
            inner.setdefault("model_type", text_arch)
            if not inner.get("model_type"):
                inner["model_type"] = text_arch
            inner.update(overrides.get(nested, {}))
            config[nested] = inner
    return config


def build(arch: str, variant: str | None = None, seed: int = 0, layers: int = 1):
    """A tiny random-weight model of ``arch`` (weights scaled up so logits differ)."""
    import signal

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = tiny_config(arch, variant)
    fixed = {**OVERRIDES.get(arch, {}), **(VARIANTS[arch][variant] if variant else {})}
    for name in LAYER_COUNTS:
        if name in fixed:
            continue
        if name in config:
            config[name] = layers
        if isinstance(config.get("text_config"), dict) and name in config["text_config"]:
            config["text_config"][name] = layers
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)

    def too_slow(*_):
        raise TimeoutError("building the tiny model took over 20 s")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(20)
    try:
        model = module.Model(args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    size = sum(v.size for _, v in tree_flatten(model.parameters()))
    if size > 20_000_000:
        raise ValueError(f"the tiny config still has {size:,} parameters")
    params = [
        (k, v * 2.0 if mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in tree_flatten(model.parameters())
    ]
    model.load_weights(params, strict=False)
    mx.eval(model.parameters())
    return model, config.get("vocab_size") or 64


# ----------------------------------------------------------------------------- rows

S, W, STRIDE = 2, 8, 4
N_TOKENS = 2 * (S + W) + STRIDE + 1


def _close(a: mx.array, b: mx.array, tol: float = 1e-3) -> bool:
    scale = mx.abs(b).max().item() + 1e-6
    return a.shape == b.shape and mx.abs(a - b).max().item() <= tol * scale


def _feed(model, cache, tokens, chunk, aligned=True):
    from mlx_stream.cache.sink import max_call_tokens

    out, i = [], 0
    while i < len(tokens):
        n = min(chunk, len(tokens) - i)
        if aligned:
            n = min(n, max_call_tokens(cache) or n)
        out.append(model(mx.array([tokens[i : i + n]]), cache=cache)[0])
        i += n
    return mx.concatenate(out)


def classify(arch: str, variant: str | None = None) -> tuple[str, str]:
    """``(status, reason)``: EXACT, PASS-THROUGH, REFUSED, WRONG, CRASH or NO-CONFIG."""
    import random

    from mlx_lm.models import cache as mlx_cache

    if arch in PROCESS_KILLERS:
        return "NO-CONFIG", PROCESS_KILLERS[arch]
    rng = random.Random(0)
    failure = ""
    for layers in (1, 2, 4, 6):  # hybrids index caches by their layer pattern
        try:
            model, vocab = build(arch, variant, layers=layers)
        except (Exception, SystemExit) as e:  # noqa: BLE001
            failure = f"tiny config does not build: {type(e).__name__}: {e}"
            continue
        tokens = [rng.randrange(min(vocab, 64)) for _ in range(N_TOKENS)]
        try:
            ref = _feed(model, mlx_cache.make_prompt_cache(model), tokens[: S + W], 1)
            break
        except Exception as e:  # noqa: BLE001 - mlx-lm's own cache fails: the config's fault
            failure = f"mlx-lm itself fails on it: {type(e).__name__}: {e}"
    else:
        return "NO-CONFIG", " ".join(failure.split())[:160]
    return _verdict(model, tokens, ref)


def classify_model(model, vocab: int) -> tuple[str, str]:
    """:func:`classify` for a model built elsewhere (a catalogue entry's shape)."""
    import random

    from mlx_lm.models import cache as mlx_cache

    rng = random.Random(0)
    tokens = [rng.randrange(min(vocab, 64)) for _ in range(N_TOKENS)]
    try:
        ref = _feed(model, mlx_cache.make_prompt_cache(model), tokens[: S + W], 1)
    except Exception as e:  # noqa: BLE001 - mlx-lm's own cache fails: the config's fault
        return "NO-CONFIG", f"mlx-lm itself fails on it: {type(e).__name__}: {e}"[:160]
    return _verdict(model, tokens, ref)


def _verdict(model, tokens, ref) -> tuple[str, str]:
    """EXACT/PASS-THROUGH/REFUSED/WRONG/CRASH for ``model`` against ``ref``, mlx-lm's
    own cache over the first ``S + W`` tokens."""
    from mlx_stream.cache import SinkCache, make_sink_cache
    from mlx_stream.errors import Unsupported

    try:
        cache = make_sink_cache(model, sinks=S, window=W, slack=STRIDE, stride=STRIDE)
    except Unsupported as e:
        return "REFUSED", str(e)
    except Exception as e:  # noqa: BLE001
        return "CRASH", f"make_sink_cache: {type(e).__name__}: {e}"[:200]
    sinks = [c for c in cache if isinstance(c, SinkCache)]
    if not sinks:
        return "PASS-THROUGH", "every layer keeps the bounded cache mlx-lm makes for it"
    try:
        one = _feed(model, cache, tokens, 1)
        if not _close(one[: S + W], ref):
            return "WRONG", "differs from mlx-lm's own cache before eviction"
        if len(cache) == 1:
            # At a stride multiple the sinks sit right before the window, as in a
            # fresh forward over sinks + window (the recompute oracle).
            for q in (S + W + STRIDE - (S + W) % STRIDE, N_TOKENS - N_TOKENS % STRIDE):
                context = tokens[:S] + tokens[q - W + 1 : q + 1]
                oracle = model(mx.array([context]))[0, -1]
                if not _close(one[q], oracle):
                    return "WRONG", f"differs from the recompute oracle at token {q}"
        for chunk, aligned in ((STRIDE, True), (3, False)):
            c2 = make_sink_cache(model, sinks=S, window=W, slack=STRIDE, stride=STRIDE)
            many = _feed(model, c2, tokens, chunk, aligned)
            if not _close(many, one):
                how = "chunks" if aligned else "chunks crossing strides"
                return "WRONG", f"{how} of {chunk} differ from token by token"
    except Unsupported as e:
        return "REFUSED", str(e)
    except Exception as e:  # noqa: BLE001
        return "CRASH", f"{type(e).__name__}: {e}"[:200]
    moves = sorted({c.move.describe() for c in sinks if c.move is not None})
    return "EXACT", "; ".join(moves)


def rows() -> list[tuple[str, str, str]]:
    out = []
    for arch in architectures():
        for variant in [None, *VARIANTS.get(arch, {})]:
            name = arch if variant is None else f"{arch}[{variant}]"
            out.append((name, *classify(arch, variant)))
    return out


if __name__ == "__main__":
    import collections
    import sys

    table = rows() if len(sys.argv) < 2 else [(a, *classify(a)) for a in sys.argv[1:]]
    for name, status, reason in table:
        print(f"{status:12} {name:28} {reason}", flush=True)
    counts = collections.Counter(status for _, status, _ in table)
    print(", ".join(f"{n} {status}" for status, n in counts.most_common()))
