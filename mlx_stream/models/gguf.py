"""GGUF file -> mlx-lm model folder (weights, config, tokenizer).

``mx.load(path, return_metadata=True)`` reads GGUF natively: F32/F16 tensors arrive as
float arrays, Q4_0/Q4_1/Q8_0 as MLX affine ``weight``/``scales``/``biases`` (group 32).
This module renames the tensors to mlx-lm's llama names, undoes llama.cpp's q/k row
permutation, writes ``config.json`` (with mlx-lm's per-layer quantization config for
mixed bit widths) and rebuilds the tokenizer with ``tokenizers``, so that plain
``mlx_lm.load(folder)`` runs the result. Weights stay quantized on disk; the loader
decides the dtype at load time.
"""

from __future__ import annotations

import re
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_stream.errors import UserError
from mlx_stream.models.registry import ProgressCallback, atomic_folder, notify

SUPPORTED_ARCHITECTURES = ("llama",)
# ggml type id -> name (ggml.h); only the first five are supported here.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0",
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
    14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
# MLX loads these exactly (affine group 32 or float); it silently squeezes others
# (K-quants, BF16) into float16 or fails without naming the type, so refuse them.
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
SUPPORTED_TYPES = ("F32", "F16", *QUANT_BITS)
GROUP_SIZE = 32

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# GGUF tokenizer.ggml.pre -> extra pre-tokenizer steps before GPT-2 byte-level.
_PRE_SPLIT_DIGITS = {"smollm", "starcoder", "refact"}


def read_tensor_types(path: Path) -> dict[str, str]:
    """The ggml type name of every tensor in a GGUF file, read from its header.

    Hand-written (about 30 lines): MLX does not expose tensor types and the ``gguf``
    package is only a test dependency.

    Raises:
        UserError: The file is not a GGUF file or its header is truncated.
    """
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # fmt: skip
    try:
        with open(path, "rb") as f:

            def read(fmt: str) -> Any:
                size = struct.calcsize("<" + fmt)
                data = f.read(size)
                if len(data) != size:
                    raise EOFError
                return struct.unpack("<" + fmt, data)[0]

            def skip_string() -> None:
                f.seek(read("Q"), 1)

            def skip_value(kind: int) -> None:
                if kind == 8:
                    skip_string()
                elif kind == 9:
                    item, count = read("I"), read("Q")
                    if item in scalar:
                        f.seek(struct.calcsize("<" + scalar[item]) * count, 1)
                    else:
                        for _ in range(count):
                            skip_value(item)
                elif kind in scalar:
                    f.seek(struct.calcsize("<" + scalar[kind]), 1)
                else:
                    raise ValueError(f"unknown metadata type {kind}")

            if f.read(4) != b"GGUF":
                raise ValueError("no GGUF magic number")
            version = read("I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported")
            n_tensors, n_kv = read("Q"), read("Q")
            for _ in range(n_kv):
                skip_string()
                skip_value(read("I"))
            types = {}
            for _ in range(n_tensors):
                name = f.read(read("Q")).decode("utf-8")
                f.seek(8 * read("I"), 1)
                types[name] = GGML_TYPES.get(read("I"), "unknown")
                f.seek(8, 1)
            return types
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (EOFError, ValueError, UnicodeDecodeError, OverflowError) as e:
        reason = "file is truncated" if isinstance(e, EOFError) else str(e)
        raise UserError(f"{path} is not a valid GGUF file ({reason})") from None


def _scalar(metadata: dict, key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def _list(metadata: dict, key: str) -> list:
    value = metadata.get(key, [])
    return value.tolist() if isinstance(value, mx.array) else list(value)


def model_config(metadata: dict, weights: dict[str, mx.array]) -> dict[str, Any]:
    """The mlx-lm ``config.json`` of a llama GGUF (without quantization)."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"unsupported GGUF architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UserError(f"unsupported GGUF rope scaling '{scaling}'")

    def get(key: str, default: Any = None) -> Any:
        value = _scalar(metadata, f"{arch}.{key}", default)
        if value is None:
            raise UserError(f"GGUF metadata lacks '{arch}.{key}'")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = weights["model.embed_tokens.weight"].shape[0]
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        # float32 metadata: 7 significant digits give back the value that was written
        "rms_norm_eps": float(f"{get('attention.layer_norm_rms_epsilon'):.7g}"),
        "rope_theta": float(f"{get('rope.freq_base', 10000.0):.7g}"),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(_scalar(metadata, f"{arch}.vocab_size", vocab)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    for key in ("bos_token_id", "eos_token_id"):
        value = _scalar(metadata, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def _mlx_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias") and base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if suffix in ("weight", "bias") and match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{suffix}"
    raise UserError(f"unsupported tensor '{gguf_name}' for a llama model")


def unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (weights, scales and biases alike).

    llama.cpp's converter reorders each head's rows with
    ``reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2)`` for its RoPE layout;
    this is the inverse.
    """
    rows = x.shape[0]
    half = rows // n_heads // 2
    return x.reshape(n_heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _quantization(types: dict[str, str], names: dict[str, str]) -> dict[str, Any] | None:
    """mlx-lm's quantization config: the most common bit width on top, others per layer."""
    layers = {}
    for gguf_name, kind in types.items():
        if kind in QUANT_BITS:
            path = names[gguf_name].rpartition(".")[0]
            layers[path] = {"group_size": GROUP_SIZE, "bits": QUANT_BITS[kind]}
    if not layers:
        return None
    bits = Counter(q["bits"] for q in layers.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": bits}
    config.update({p: q for p, q in layers.items() if q["bits"] != bits})
    return config


def build_tokenizer(metadata: dict, chat_template: str | None = None):
    """A ``PreTrainedTokenizerFast`` rebuilt from a GGUF's byte-level BPE vocabulary.

    Args:
        metadata: The GGUF metadata (``tokenizer.ggml.*``).
        chat_template: Replaces ``tokenizer.chat_template`` when given.

    Raises:
        UserError: The tokenizer is not byte-level BPE (``tokenizer.ggml.model=gpt2``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UserError(f"unsupported GGUF tokenizer '{kind}' (supported: gpt2 byte-level BPE)")
    tokens = _list(metadata, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _list(metadata, "tokenizer.ggml.merges")]
    token_types = _list(metadata, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if metadata.get("tokenizer.ggml.pre") in _PRE_SPLIT_DIGITS:
        byte_level = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == 3
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == 4
        ]
    )

    def token(key: str) -> str | None:
        value = _scalar(metadata, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(value)] if value is not None and int(value) < len(tokens) else None

    bos = token("bos")
    if bos is not None and _scalar(metadata, "tokenizer.ggml.add_bos_token", False):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=chat_template or metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def write_folder(
    gguf_path: Path,
    folder: Path,
    chat_template: str | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Convert ``gguf_path`` into the existing (empty) ``folder``; not atomic.

    Returns:
        A summary: architecture, model name, tensor type counts, seconds taken.
    """
    from mlx_lm.utils import save_config

    start = time.perf_counter()
    gguf_path = Path(gguf_path)
    notify(progress, 0, None, "read GGUF")
    types = read_tensor_types(gguf_path)
    bad = sorted({t for t in types.values() if t not in SUPPORTED_TYPES})
    if bad:
        first = next(n for n, t in types.items() if t == bad[0])
        raise UserError(
            f"unsupported GGUF tensor type {bad[0]} (tensor '{first}'); supported: {', '.join(SUPPORTED_TYPES)}"
        )
    try:
        raw, metadata = mx.load(str(gguf_path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"{gguf_path} is not a valid GGUF file ({e})") from None
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        model_config(metadata, {})  # raises the one-line architecture error
    names = {name: _mlx_name(name) for name in types}
    weights = {}
    for i, (key, value) in enumerate(raw.items()):
        if key in types:
            name = names[key]
        else:  # "X.scales" / "X.biases" of the quantized tensor "X.weight"
            base, _, suffix = key.rpartition(".")
            name = names[f"{base}.weight"].rpartition(".")[0] + "." + suffix
        weights[name] = value
        notify(progress, i + 1, len(raw), "convert tensors")
    config = model_config(metadata, weights)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, value in weights.items():
        proj = name.split(".")[-2]
        if proj in heads:
            weights[name] = unpermute_rows(value, heads[proj])
    quantization = _quantization(types, names)
    if quantization is not None:
        config["quantization"] = quantization
    notify(progress, 0, None, "write weights")
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, config_path=folder / "config.json")
    notify(progress, 0, None, "build tokenizer")
    build_tokenizer(metadata, chat_template).save_pretrained(str(folder))
    return {
        "architecture": arch,
        "name": metadata.get("general.name"),
        "tensor_types": dict(Counter(types.values())),
        "seconds": round(time.perf_counter() - start, 2),
    }


def convert(
    gguf_path: str | Path,
    out_dir: str | Path,
    chat_template: str | None = None,
    progress: ProgressCallback | None = None,
) -> Path:
    """Convert a llama GGUF file into an mlx-lm folder, atomically.

    The folder is built beside ``out_dir`` and moved into place at the end: a failed or
    interrupted conversion leaves nothing behind (and an existing ``out_dir`` intact).

    Args:
        gguf_path: The ``.gguf`` file.
        out_dir: The folder to create (replaced if it exists).
        chat_template: Replaces the GGUF's ``tokenizer.chat_template`` when given.
        progress: Optional ``progress(done, total, stage)`` callback.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        UserError: Not a GGUF file, or an unsupported architecture, tensor type or
            tokenizer (the message names it).
    """
    out_dir = Path(out_dir)
    with atomic_folder(out_dir) as tmp:
        write_folder(Path(gguf_path), tmp, chat_template, progress)
    return out_dir
