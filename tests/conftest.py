import os
from pathlib import Path

import pytest

from tests import tiny

# Where the real default model lives, captured before any test redirects the home.
REAL_HOME = os.environ.get("MLX_STREAM_HOME")
REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No network, and a throwaway user directory for every test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLX_STREAM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLX_STREAM_MODEL", raising=False)


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
