"""Tiny random-weight models and an in-memory tokenizer, shared by the tests.

Nothing here touches the network: models are built from mlx-lm ``ModelArgs`` with a
fixed seed, and the tokenizer is a ``tokenizers`` WordLevel vocabulary wrapped in
``PreTrainedTokenizerFast`` and mlx-lm's ``TokenizerWrapper``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

VOCAB_WORDS = (
    "the a of and to in is was it he she they we you i that for on with as at by "
    "from this be are not but or had have his her their there what which when "
    "where who how why all one two three sea ship whale captain ahab sail water "
    "wind day night land man men old new long time way said like just so then "
    "now up down out over only very good great little paris france capital city "
    "user assistant system hi hello yes no"
).split()
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)

ARCHS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # Mixed layers: sliding-window layers keep mlx-lm's RotatingKVCache,
    # every third layer is global (KVCache -> SinkCache).
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        sliding_window=16,
        sliding_window_pattern=3,
        query_pre_attn_scalar=16,
        max_position_embeddings=4096,
    ),
}


def vocab_size() -> int:
    return len(SPECIALS) + len(VOCAB_WORDS)


def make_config(arch: str = "llama", **overrides) -> dict:
    """The config.json dict of a tiny model of ``arch``."""
    config = dict(ARCHS[arch], vocab_size=vocab_size(), max_position_embeddings=4096)
    config.update(overrides)
    return config


def make_model(arch: str = "llama", seed: int = 0, dtype=mx.float32, scale=4.0, **overrides):
    """A tiny random-weight mlx-lm model of ``arch`` (deterministic for ``seed``).

    ``scale`` multiplies mlx's small random init so logits are not all ties."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = make_config(arch, **overrides)
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    params = [(k, (v * scale).astype(dtype)) for k, v in tree_flatten(model.parameters())]
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


def make_hf_tokenizer():
    """A ``PreTrainedTokenizerFast`` over a WordLevel vocabulary, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(VOCAB_WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )


def make_tokenizer():
    """mlx-lm's ``TokenizerWrapper`` around the in-memory tokenizer."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(make_hf_tokenizer(), eos_token_ids=[1, 3])


def save_model_folder(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny model as an mlx-lm folder (weights, config, tokenizer) that
    ``mlx_lm.utils.load`` reads back."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = make_model(arch, seed=seed, **overrides)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    config = {k: v for k, v in make_config(arch, **overrides).items() if v is not None}
    config["eos_token_id"] = [1, 3]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    make_hf_tokenizer().save_pretrained(str(path))
    return path


def random_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of ordinary words (no specials), deterministic for ``seed``."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(len(SPECIALS), vocab_size()) for _ in range(n)]
