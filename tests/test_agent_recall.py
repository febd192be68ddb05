"""Recall on an agent's prompt: Codex's real first request (~9k tokens as the default model
reads it, its instructions and tools) with one tool planted in the middle of its tool
list, whose description names an archive. With the window alone (1,024 tokens, its first
1,024 pinned) that description has streamed by when the question comes; with ``--recall``
the question's queries bring its block back (``benchmarks/agent_prompt.py`` measures the
three caches side by side). Minutes of CPU prefill: it runs with the agent CLIs
(``.ci/agents``), not in the README's suite."""

from __future__ import annotations

import pytest

from tests.support.bench import load_script

pytestmark = [pytest.mark.agents, pytest.mark.real_model, pytest.mark.slow]


def test_a_fact_in_the_unpinned_middle_of_an_agent_prompt_is_answered_with_recall(
    real_model_path, tmp_path, monkeypatch
):
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.session import Settings
    from mlx_stream.models.loader import load
    from mlx_stream.recall import RecallSpec
    from mlx_stream.serve.engine import Engine

    bench = load_script("agent_prompt", monkeypatch)
    model, tokenizer = load(str(real_model_path))[:2]
    messages, tools = bench.prompt()
    recall = RecallSpec(blocks=8, ram_bytes=256_000_000, folder=str(tmp_path / "store"))
    engine = Engine(model, tokenizer, Settings(CacheSpec(sinks=4, window=1024, recall=recall),
                                               max_tokens=24), "test")  # fmt: skip
    engine.start()
    try:
        answers = []
        for question in bench.QUESTIONS[1:]:  # the two phrasings it answered when measured
            got = bench.ask(engine, [*messages, {"role": "user", "content": question}], tools, 24)
            assert got["prompt_tokens"] > 8 * 1024  # the whole prompt went in
            answers.append(got["text"])
    finally:
        engine.stop()
    assert any(bench.KEY in text.lower() for text in answers), answers
