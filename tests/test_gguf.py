"""GGUF -> mlx-lm folder: round trips against the tiny model the file was written from."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load as mlx_lm_load

from mlx_stream.errors import UserError
from mlx_stream.models import gguf, loader
from tests.support.bpe import write_tiny_gguf

TOKENS = mx.array([[5, 60, 70, 80, 90, 100, 7, 200, 250]])


def logits(model):
    return np.array(model(TOKENS).astype(mx.float32))


def test_unpermute_inverts_llama_cpp_permutation():
    rows, heads = 12, 3
    w = np.arange(rows * 4).reshape(rows, 4)
    # llama.cpp convert_hf_to_gguf.py: LlamaModel.permute
    permuted = w.reshape(heads, 2, rows // heads // 2, 4).swapaxes(1, 2).reshape(w.shape)
    assert (np.array(gguf.unpermute_rows(mx.array(permuted), heads)) == w).all()


def test_f32_round_trip_gives_the_same_logits(tiny_gguf, tmp_path):
    path, reference, _ = tiny_gguf
    folder = gguf.convert(path, tmp_path / "tiny")
    model, _ = mlx_lm_load(str(folder))  # plain mlx-lm reads the folder
    np.testing.assert_allclose(logits(model), logits(reference), atol=1e-4)


def test_without_unpermuting_the_logits_differ(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "unpermute_rows", lambda x, n: x)
    folder = gguf.convert(tiny_gguf[0], tmp_path / "wrong")
    model, _ = mlx_lm_load(str(folder))
    assert np.abs(logits(model) - logits(tiny_gguf[1])).max() > 1e-2


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_quantized_round_trip(quant, tmp_path):
    path, reference, _ = write_tiny_gguf(tmp_path / f"tiny-{quant}.gguf", quant)
    folder = gguf.convert(path, tmp_path / quant)
    config = json.loads((folder / "config.json").read_text())
    bits = 8 if quant == "q8_0" else 4
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
    if quant == "q4_0":  # the 8-bit embedding is a per-layer override, as mlx-lm writes it
        assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    expected = logits(reference)  # gguf-py's own dequantization of the stored blocks
    model, _ = loader.load(folder, dtype="float32")
    np.testing.assert_allclose(logits(model), expected, atol=1e-4)
    # quantized matmul with float16 scales: close, not exact (a wrong row order is ~100%)
    quantized, _ = mlx_lm_load(str(folder))
    assert np.abs(logits(quantized) - expected).max() < 0.05 * np.abs(expected).max()


def test_tokenizer_is_rebuilt(tiny_gguf, tmp_path):
    path, _, bpe = tiny_gguf
    _, tokenizer = mlx_lm_load(str(gguf.convert(path, tmp_path / "tok")))
    for text in ["the whale said hello", "Captain AHAB, 1851!", "  two  spaces\nnew line"]:
        assert tokenizer.encode(text) == bpe.encode(text).ids
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|im_start|>user hi<|im_end|>")[0] == 1
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt[0] == 1 and tokenizer.decode(prompt).endswith("assistant ")


def assert_nothing_left(parent):
    assert not parent.exists() or list(parent.iterdir()) == []


def test_truncated_gguf_is_one_line_error(tiny_gguf, tmp_path):
    data = tiny_gguf[0].read_bytes()
    for name, content in [
        ("half.gguf", data[: len(data) // 2]),
        ("head.gguf", data[:100]),
        ("junk.gguf", b"x" * 99),
    ]:
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(UserError, match="not a valid GGUF file") as e:
            gguf.convert(bad, tmp_path / "out" / "m")
        assert "\n" not in str(e.value)
        assert_nothing_left(tmp_path / "out")


def test_unsupported_tensor_type_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "k.gguf", "q4_k")[0]
    with pytest.raises(UserError, match="unsupported GGUF tensor type Q4_K"):
        gguf.convert(path, tmp_path / "out" / "m")
    assert_nothing_left(tmp_path / "out")


def test_unsupported_architecture_is_named(tmp_path):
    import gguf as gguf_py

    writer = gguf_py.GGUFWriter(str(tmp_path / "q.gguf"), "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="unsupported GGUF architecture 'qwen2'"):
        gguf.convert(tmp_path / "q.gguf", tmp_path / "out" / "m")
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_old_folder_intact(tiny_gguf, tmp_path, monkeypatch, failure):
    target = gguf.convert(tiny_gguf[0], tmp_path / "out" / "m")
    before = sorted(p.name for p in target.iterdir())

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(gguf, "build_tokenizer", fail)
    with pytest.raises(type(failure)):
        gguf.convert(tiny_gguf[0], target)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["m"]
    assert sorted(p.name for p in target.iterdir()) == before
