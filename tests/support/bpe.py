"""The tiny llama with a byte-level BPE tokenizer trained on its vocabulary: written as
a GGUF file the way llama.cpp's converter writes one, or saved as an mlx-lm folder
with ChatML specials and a chat template (with or without tools)."""

from pathlib import Path

from tests import tiny

GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_bpe():
    """A byte-level BPE tokenizer trained in memory on the tiny vocabulary (~300 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=GGUF_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = " ".join(tiny.VOCAB_WORDS)
    tok.train_from_iterator([text, text.upper(), "0123456789 .,?!"] * 4, trainer)
    return tok


def write_tiny_gguf(path, quant="f32", arch="llama", seed=0):
    """Write a tiny llama as a GGUF file the way llama.cpp's converter does.

    q/k rows are permuted with llama.cpp's ``permute``; ``quant`` picks tensor types:
    ``"f32"``, ``"q8_0"`` (matrices Q8_0), ``"q4_0"`` (matrices Q4_0, embedding Q8_0),
    or ``"q4_k"`` (an unsupported type). Returns ``(path, reference_model, tokenizer)``:
    the reference is the tiny model with the weights exactly as the GGUF holds them.
    """
    import json

    import gguf
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.gguf import translate_weight_names

    T = gguf.GGMLQuantizationType
    bpe = tiny_bpe()
    vocab = bpe.get_vocab_size()
    model = tiny.make_model("llama", seed=seed, vocab_size=vocab)
    cfg = tiny.make_config("llama", vocab_size=vocab)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg["hidden_size"] // heads)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(vocab)
    data = json.loads(bpe.to_str())
    tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in GGUF_SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tiny.CHAT_TEMPLATE)

    reference = []
    for name, value in tree_flatten(model.parameters()):
        w = np.array(value.astype(mx.float32))
        gname = translate_weight_names(name)
        if ".attn_q." in gname:
            w = permute(w, heads)
        elif ".attn_k." in gname:
            w = permute(w, kv_heads)
        kind = T.F32
        if w.ndim == 2 and quant != "f32":
            kind = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K}[quant]
            if quant == "q4_0" and gname.startswith("token_embd"):
                kind = T.Q8_0
        if kind == T.F32:
            writer.add_tensor(gname, w)
            stored = w
        elif kind == T.Q4_K:  # gguf-py cannot quantize K-quants: any bytes will do
            raw = np.zeros((w.shape[0], w.shape[1] // 256 * 144 or 144), dtype=np.uint8)
            writer.add_tensor(gname, raw, raw_dtype=kind)
            stored = w
        else:
            raw = gguf.quants.quantize(w, kind)
            writer.add_tensor(gname, raw, raw_dtype=kind)
            stored = gguf.quants.dequantize(raw, kind)
        if ".attn_q." in gname:
            stored = permute_back(stored, heads)
        elif ".attn_k." in gname:
            stored = permute_back(stored, kv_heads)
        reference.append((name, mx.array(stored)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_weights(reference)
    mx.eval(model.parameters())
    return Path(path), model, bpe


def permute_back(w, n_head):
    """Inverse of llama.cpp's permute, written independently of mlx_stream.models.gguf."""
    rows = w.shape[0]
    out = w.copy()
    half = rows // n_head // 2
    for h in range(n_head):
        block = w[h * 2 * half : (h + 1) * 2 * half]
        # llama.cpp interleaves the two halves of each head: rows 2i, 2i+1 <- i, i+half
        out[h * 2 * half : h * 2 * half + half] = block[0::2]
        out[h * 2 * half + half : (h + 1) * 2 * half] = block[1::2]
    return out


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template with tool support in Qwen2.5's format (mlx-lm infers its json_tools parser).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% elif messages[0]['role'] == "
    "'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% elif m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{{ m['content'] }}{% for tool_call in m.tool_calls %}{% set tool_call = "
    'tool_call.function %}<tool_call>\n{"name": "{{ tool_call.name }}", '
    '"arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_bpe_model_folder(path, template: str = CHATML, extra_specials: tuple = ()):
    """A tiny llama with a byte-level BPE tokenizer (what llguidance needs: any JSON
    can be written), ChatML specials (and ``extra_specials``) and ``template``, saved
    as an mlx-lm folder."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True)
    bpe = tiny_bpe()
    bpe.add_special_tokens(list(extra_specials))
    vocab = bpe.get_vocab_size()
    model = tiny.make_model("llama", vocab_size=vocab)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = tiny.make_config("llama", vocab_size=vocab)
    config["eos_token_id"] = [bpe.token_to_id("<|im_end|>"), bpe.token_to_id("<|endoftext|>")]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>", *extra_specials],
        chat_template=template,
    ).save_pretrained(str(path))  # fmt: skip
    return path
