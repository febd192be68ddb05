"""The catalogue in models.yaml: each entry's config is built by mlx-lm as a tiny random
model of the same architecture and shape (model type, rope type and scaling, tied
embeddings, sliding layers, head dims, grouped-query ratio; only widths, depth and
vocabulary shrink) and served exactly by the sink cache, through the architecture
matrix's check and through ``mlx-stream models check`` on a saved folder; its size,
context and window agree with its config; ``models list --available`` says what fits."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from cli.main import app
from mlx_stream.cache import estimate
from mlx_stream.models import hub, registry
from tests import archs, tiny

CATALOGUE = [s for s in registry.load_registry(use_user=False).models.values() if s.config]
IDS = [s.name for s in CATALOGUE]


# The rope each family's keys are moved with (its scaling kept by the tiny model).
MOVES = {"llama": "keys, all dims, Llama3RoPE", "phi": "keys, first dims 96, SuScaledRoPE"}


def tiny_config(config: dict) -> dict:
    """``config`` at toy size: the head dimension and the ratio of query to key/value
    heads kept, one key/value head, vocabulary of the tiny tokenizer, two layers (a
    sliding-window model: one full period, so it has both kinds), windows of 8."""
    c = dict(config)
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    c.update(num_attention_heads=heads // kv, num_key_value_heads=1, intermediate_size=64,
             vocab_size=tiny.vocab_size(), num_hidden_layers=c.get("sliding_window_pattern", 2))  # fmt: skip
    # Where the config names head_dim the width is free (a multiple of the heads, as
    # transformers' config check wants); else it sets the head size.
    c["hidden_size"] = (heads // kv) * (32 if "head_dim" in config else head_dim)
    if "sliding_window" in c:
        c["sliding_window"] = 8  # the toy run (25 tokens) wraps the sliding layers
    return c


def build(config: dict):
    """The model mlx-lm builds for ``config``, random weights scaled up (archs.build)."""
    mx.random.seed(0)
    model = hub.model_from_config(config)
    model.load_weights([(k, v * 2.0) for k, v in tree_flatten(model.parameters())])
    mx.eval(model.parameters())
    return model


def test_the_catalogue_has_the_models_the_issue_names():
    names = set(IDS)
    assert {"llama-3.2-1b-instruct", "llama-3.2-3b-instruct", "gemma-3-1b-it", "gemma-3-4b-it",
            "phi-4-mini-instruct", "mistral-7b-instruct-v0.3"} <= names  # fmt: skip
    assert {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"} <= names


@pytest.mark.parametrize("spec", CATALOGUE, ids=IDS)
def test_entry_fields_agree(spec):
    [repo] = spec.hf_repos
    assert re.fullmatch(r"mlx-community/[\w.-]+-4bit", repo)
    config = spec.config
    assert hub.mlx_lm_supports(config["model_type"])
    assert spec.context == config["max_position_embeddings"]
    assert spec.sinks + spec.window <= spec.context
    # size: the Hub's listing (two entries) or the 4-bit weights computed from config.
    weights = hub.config_weights(config, "quantized")
    assert weights <= spec.size <= weights * 1.013, (spec.size, weights)


@pytest.mark.parametrize("spec", CATALOGUE, ids=IDS)
def test_a_tiny_model_of_the_entrys_shape_is_served_exactly(spec, tmp_path):
    config = tiny_config(spec.config)
    model = build(config)
    status, reason = archs.classify_model(model, tiny.vocab_size())
    assert status == "EXACT", f"{spec.name}: {status}: {reason}"
    assert MOVES.get(spec.name.split("-")[0], "keys, all dims, RoPE") in reason
    # The same through the CLI's model check, loading a saved folder by mlx-lm.
    folder = tmp_path / spec.name
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(hub.shape_config(config)))
    tiny.make_hf_tokenizer().save_pretrained(str(folder))
    result = CliRunner().invoke(app, ["models", "check", str(folder)])
    assert result.exit_code == 0, result.output
    assert "verdict: exact" in result.stdout and config["model_type"] in result.stdout


def test_sliding_layers_stay_sliding_in_the_tiny_gemma():
    """The tiny Gemma 3 keeps the 5-of-6 sliding pattern the real one has."""
    from mlx_lm.models import cache as mlx_cache

    spec = next(s for s in CATALOGUE if s.name == "gemma-3-1b-it")
    caches = mlx_cache.make_prompt_cache(build(tiny_config(spec.config)))
    kinds = [type(c).__name__ for c in caches]
    assert kinds == ["RotatingKVCache"] * 5 + ["KVCache"]


def test_list_available_says_what_fits(monkeypatch):
    from mlx_stream.models import loader

    policy = loader.resolve_dtype("auto")
    monkeypatch.setattr(estimate, "available_memory", lambda: 8 * 10**9)
    result = CliRunner().invoke(app, ["models", "list", "--available", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert set(IDS) <= set(rows)
    for spec in CATALOGUE:
        row = rows[spec.name]
        layout = estimate.config_layout(spec.config, 2 if policy == "quantized" else 4)
        cache = estimate.cache_bytes(layout, spec.sinks, spec.window, 64)
        assert row["needs_bytes"] == hub.config_weights(spec.config, policy) + cache
        assert row["fits"] == (row["needs_bytes"] <= 8 * 10**9)
        assert (row["hf"], row["context"], row["pulled"]) == (spec.hf_repos[0], spec.context, False)
    assert rows["qwen3-0.6b"]["fits"] and not rows["mistral-7b-instruct-v0.3"]["fits"]
    table = CliRunner().invoke(app, ["models", "list", "--available"], env={"COLUMNS": "200"})
    assert "mlx-community/Qwen3-4B-4bit" in table.stdout and "40,960" in table.stdout
    info = CliRunner().invoke(app, ["models", "info", "mistral-7b-instruct-v0.3"]).stdout
    need = estimate.human(rows["mistral-7b-instruct-v0.3"]["needs_bytes"])
    assert f"= {need} (does NOT fit in 8.00 GB available)" in info and "context:     32,768" in info
