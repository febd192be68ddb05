"""The embedded default model (SmolLM2-135M-Instruct), pulled by `mlx-stream models pull`.

Fixtures ``real_model_path`` and ``real_model`` live in ``tests/conftest.py``. To keep
these fast, one model decodes 20 greedy tokens once (``greedy20``); the other side is
checked with one forward pass over prompt + those tokens: its argmax at every step
must reproduce them, which is exactly "its own greedy decode gives the same ids".
"""

import mlx.core as mx
import pytest

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N = 20


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)


def greedy_ids(model, prompt, n=N) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def teacher_forced_argmax(model, prompt, ids) -> list[int]:
    """The greedy choice after each prefix of ``prompt + ids``, in one forward pass."""
    logits = model(mx.array([prompt + ids[:-1]]))
    return mx.argmax(logits[0, len(prompt) - 1 :], axis=-1).tolist()


@pytest.fixture(scope="session")
def greedy20(real_model):
    model, tokenizer, _ = real_model
    prompt = prompt_ids(tokenizer)
    return prompt, greedy_ids(model, prompt)


def test_greedy_answer_names_paris(real_model, greedy20):
    _, tokenizer, info = real_model
    assert info.dtype == ("float32" if info.device == "cpu" else "quantized")
    ids = greedy20[1]
    answer = tokenizer.decode(ids[: ids.index(2)] if 2 in ids else ids)
    assert "Paris" in answer, answer


def test_same_tokens_as_plain_mlx_lm(real_model, real_model_path, greedy20):
    """mlx_stream.models.loader.load == plain mlx_lm.load on the converted folder, with the
    same dtype policy applied on the plain side (mlx-lm's own dequantize_model)."""
    from mlx_lm.utils import dequantize_model, load

    _, tokenizer, info = real_model
    plain, plain_tokenizer = load(str(real_model_path))
    if info.dtype != "quantized":
        plain.set_dtype(mx.float32)
        dequantize_model(plain)
        plain.set_dtype(getattr(mx, info.dtype))
    prompt, ids = greedy20
    assert prompt_ids(plain_tokenizer) == prompt
    assert teacher_forced_argmax(plain, prompt, ids) == ids


def test_quantized_policy_is_plain_mlx_lm(real_model_path):
    """dtype="quantized" keeps the weights exactly as plain mlx_lm.load has them (equal
    parameters, so equal tokens; running both would cost ~10 s of quantized CPU matmul)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from mlx_stream.models import loader

    model, _ = loader.load(real_model_path, dtype="quantized")
    plain, _ = load(str(real_model_path))
    ours, theirs = dict(tree_flatten(model.parameters())), dict(tree_flatten(plain.parameters()))
    assert ours.keys() == theirs.keys()
    assert ours["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32  # still packed
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
