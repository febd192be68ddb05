"""Passkey prompts (``mlx_stream.eval.passkey``): where the key lands relative to the window,
what the pinned system prompt covers, and the accuracy bookkeeping, on the tiny
tokenizer and model; one real-model run."""

from __future__ import annotations

import pytest

from mlx_stream.eval import passkey as rec

WINDOW = 64


def key_span(tokens: list[int], tokenizer, key: str) -> tuple[int, int]:
    """[start, end) of the key sentence's tokens in ``tokens``."""
    sentence = list(tokenizer.encode(rec.KEY_SENTENCE.format(key=key), add_special_tokens=False))
    for i in range(len(tokens) - len(sentence) + 1):
        if tokens[i : i + len(sentence)] == sentence:
            return i, i + len(sentence)
    raise AssertionError("key sentence not found")


@pytest.mark.parametrize("placement", ["inside", "just_outside", "far_outside"])
def test_the_key_lands_where_asked(tokenizer, placement):
    length = rec.prompt_length(WINDOW, 4096, 12)
    p = rec.build_prompt(tokenizer, placement, WINDOW, length, "12345", sinks=4)
    assert len(p.tokens) == length == 2 * WINDOW + 256 and p.sinks == 4
    start, end = key_span(p.tokens, tokenizer, "12345")
    assert p.distance == len(p.tokens) - end  # tokens after the key's last one
    last = len(p.tokens) - 1  # the last prompt token's query sees (last - WINDOW, last]
    visible = range(last - WINDOW + 1, last + 1)
    if placement == "inside":
        assert start in visible and end - 1 + 12 in visible  # also while answering
    else:
        assert end - 1 < visible.start and start >= p.sinks  # evicted, not a sink
    if placement == "just_outside":
        assert visible.start - end < WINDOW // 8
    if placement == "far_outside":
        assert p.distance > WINDOW * 3 // 2


def test_the_system_prompt_is_the_sinks(tokenizer):
    length = rec.prompt_length(WINDOW, 4096, 12)
    p = rec.build_prompt(tokenizer, "system", WINDOW, length, "12345", sinks=4)
    start, end = key_span(p.tokens, tokenizer, "12345")
    assert end <= p.sinks < len(p.tokens) - WINDOW  # pinned, far from the question
    system = tokenizer.apply_chat_template(
        [{"role": "system", "content": rec.SYSTEM + rec.KEY_SENTENCE.format(key="12345")}],
        add_generation_prompt=False, tokenize=False,
    )  # fmt: skip
    assert p.tokens[: p.sinks] == list(tokenizer.encode(system, add_special_tokens=False))


def test_prompts_that_cannot_fit_are_refused(tokenizer):
    with pytest.raises(ValueError, match="cannot place"):
        rec.build_prompt(tokenizer, "just_outside", 512, 400, "12345")
    with pytest.raises(ValueError, match="window 4096.*context is 4096"):
        rec.check_prompts(tokenizer, [64, 4096], rec.PLACEMENTS, 4, 4096, 12)
    rec.check_prompts(tokenizer, [64], rec.PLACEMENTS, 4, 4096, 12)  # fits
    with pytest.raises(ValueError, match="placement"):
        rec.build_prompt(tokenizer, "nowhere", 64, 400, "12345")


def test_accuracy_counts_answers_holding_the_key(monkeypatch, tokenizer, tiny_llama):
    """Scoring by hand: a stand-in answerer that gives the key through the full cache
    (mlx-lm KVCache) always, and through the policy's cache on even trials only."""
    from mlx_lm.models.cache import KVCache

    calls, last = [], {}
    real_build = rec.build_prompt

    def build(*args, **kwargs):
        p = real_build(*args, **kwargs)
        last["key"] = p.key
        return p

    def fake_answer(model, tok, cache, tokens, n):
        calls.append(type(cache[0]).__name__)
        trial = (len(calls) - 1) // 2
        knows = isinstance(cache[0], KVCache) or trial % 2 == 0
        return f"The pass key is {last['key'] if knows else '99999'}."

    monkeypatch.setattr(rec, "answer", fake_answer)
    monkeypatch.setattr(rec, "build_prompt", build)
    rows = rec.recall(tiny_llama, tokenizer, [WINDOW], ["inside", "system"], trials=4,
                      context=4096)  # fmt: skip
    assert calls == ["SinkCache", "KVCache"] * 8
    assert [(r["placement"], r["accuracy"], r["reference_accuracy"]) for r in rows] == [
        ("inside", 0.5, 1.0), ("system", 0.5, 1.0)]  # fmt: skip
    assert rows[0]["sinks"] == 4 and rows[1]["sinks"] > 4  # the system prompt is pinned
    keys = [a["key"] for r in rows for a in r["answers"]]
    assert len(set(keys)) == 8 and all(len(k) == 5 and k.isdigit() for k in keys)


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_recalls_inside_and_forgets_outside(real_model):
    """SmolLM2-135M finds a key half a window back through the window, like the full
    cache, and loses one far outside it (the full cache still finds it)."""
    model, tokenizer, _ = real_model
    # context 200: prompts of 188 tokens (the key 149 tokens back when far outside);
    # without an optimized BLAS the CPU prefills ~10 tokens/s, so short prompts.
    rows = rec.recall(model, tokenizer, [WINDOW], ["inside", "far_outside"], trials=1,
                      context=200)  # fmt: skip
    inside, far = rows
    assert inside["accuracy"] == inside["reference_accuracy"] == 1.0
    assert far["accuracy"] == 0.0 and far["reference_accuracy"] == 1.0
