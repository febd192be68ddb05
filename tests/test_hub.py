"""Hugging Face ids, offline: a tiny model in a temporary Hugging Face cache (huggingface_hub's
own layout) and in an LM Studio folder, loaded by its id; downloads by huggingface_hub's
real client from a stand-in Hub on a loopback port (``HF_ENDPOINT``), with the Hub's
own error answers, a closed port and a dropped connection; the fit check before a
download and before loading; ``serve`` answering to the id."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app
from mlx_stream.cache import estimate
from mlx_stream.errors import UserError
from mlx_stream.models import gguf, hub, loader, registry
from tests import hf_cache
from tests.support.cli import assert_one_line_error

REPO = "tiny-org/tiny-llama"
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture
def cached(tiny_model_dir):
    """The tiny llama as ``tiny-org/tiny-llama`` in the test's Hugging Face cache."""
    return hf_cache.save(hub.hf_cache_dir(), REPO, tiny_model_dir)


def snapshots(repo_id: str = REPO) -> list[Path]:
    from huggingface_hub.file_download import repo_folder_name

    root = hub.hf_cache_dir() / repo_folder_name(repo_id=repo_id, repo_type="model")
    return sorted((root / "snapshots").glob("*/*"))


def logits(model) -> np.ndarray:
    return np.array(model(mx.array([[5, 6, 7, 8]])))


# ------------------------------------------------------------ the shared cache


def test_the_cache_layout_is_huggingface_hubs_own(cached):
    from huggingface_hub import scan_cache_dir, snapshot_download

    assert hub.hf_cache_dir() == Path(os.environ["HF_HOME"]) / "hub"
    info = scan_cache_dir(hub.hf_cache_dir())
    [repo] = info.repos
    assert repo.repo_id == REPO and [set(r.refs) for r in repo.revisions] == [{"main"}]
    found = snapshot_download(REPO, cache_dir=hub.hf_cache_dir(), local_files_only=True)
    assert Path(found) == cached


def test_an_id_loads_from_the_cache_offline_without_the_network(
    cached, tiny_model_dir, monkeypatch
):
    import httpx2

    def network(*args, **kwargs):
        pytest.fail("the network was asked")

    monkeypatch.setattr(httpx2.Client, "send", network)  # huggingface_hub's HTTP client
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model, _, info = loader.load(REPO, return_info=True)
    assert info.path == cached and info.spec.name == REPO
    assert (info.spec.sinks, info.spec.window) == (4, 1024)  # no catalogue entry: defaults
    reference, _ = loader.load(tiny_model_dir)
    np.testing.assert_array_equal(logits(model), logits(reference))


def test_mlx_lm_loads_the_same_copy(cached):
    """One copy for both: mlx-lm's own loader finds the snapshot mlx-stream loads."""
    code = (
        "from mlx_lm.utils import hf_repo_to_path, load; "
        f"load({REPO!r}); print(hf_repo_to_path({REPO!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip().splitlines()[-1]) == cached


def test_an_incomplete_snapshot_is_not_taken(tiny_model_dir, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf_cache.save(hub.hf_cache_dir(), REPO, folder)  # the second shard never arrived
    assert "missing (model-00002-of-00002.safetensors)" in hub.folder_problem(snapshots()[0].parent)
    assert hub.find_local(REPO) is None
    with pytest.raises(UserError, match="is not on this machine .* HF_HUB_OFFLINE is set"):
        loader.load(REPO)


def test_a_snapshot_missing_a_file_huggingface_hub_listed_is_not_taken(cached):
    """An interrupted download: huggingface_hub recorded the commit's files (its tree
    cache) and one the model needs never arrived."""
    storage = cached.parent.parent
    files = {f.name: {"size": f.stat().st_size, "blob_id": "0" * 40} for f in cached.iterdir()}
    (cached / "tokenizer.json").unlink()
    (storage / "trees").mkdir()
    tree = {"format_version": 1, "files": files}
    (storage / "trees" / f"{hf_cache.COMMIT}.json").write_text(json.dumps(tree))
    assert hub.cached_snapshot(REPO) == cached  # config and weights are there
    assert hub.find_local(REPO, verify=True) is None
    with pytest.raises(UserError, match="cached copy of .* is incomplete"):
        loader.load(REPO)


def test_not_downloaded_without_pull(monkeypatch):
    with pytest.raises(UserError, match=r"not downloaded \(run: mlx-stream models pull"):
        loader.resolve(REPO, pull=False)


def test_a_registry_entry_with_an_hf_source_uses_the_cached_copy(cached):
    """A catalogue model pulled by mlx-lm or earlier: used in place, removed from there."""
    hf_cache.save(hub.hf_cache_dir(), "mlx-community/Qwen3-0.6B-4bit", cached)
    assert loader.is_pulled("qwen3-0.6b")
    folder, spec = loader.resolve("qwen3-0.6b")
    assert folder == snapshots("mlx-community/Qwen3-0.6B-4bit")[0].parent
    assert spec.name == "qwen3-0.6b" and spec.window == 2048
    # By its id: the catalogue entry's window and sinks, named by the id.
    _, by_id = loader.resolve("mlx-community/Qwen3-0.6B-4bit")
    assert (by_id.name, by_id.window, by_id.context) == (
        "mlx-community/Qwen3-0.6B-4bit",
        2048,
        40960,
    )
    rows = {r["name"]: r for r in json.loads(cli("models", "list", "--json").stdout)}
    assert rows["qwen3-0.6b"]["where"] == "hf-cache" and rows["qwen3-0.6b"]["pulled"]
    assert "mlx-community/Qwen3-0.6B-4bit" not in rows  # shown once, as its entry
    result = cli("models", "rm", "qwen3-0.6b")
    assert result.exit_code == 0, result.output
    assert not loader.is_pulled("qwen3-0.6b") and snapshots("mlx-community/Qwen3-0.6B-4bit") == []
    assert snapshots() != []  # another repo's copy stays


# ------------------------------------------------------------------- LM Studio


def test_an_lmstudio_model_loads_by_id(tiny_model_dir, monkeypatch):
    folder = Path(os.environ["LMSTUDIO_MODELS_DIR"]) / "lmstudio-community" / "tiny-MLX-4bit"
    shutil.copytree(tiny_model_dir, folder)
    _, _, info = loader.load("lmstudio-community/tiny-MLX-4bit", return_info=True)
    assert info.path == folder
    result = cli("models", "rm", "lmstudio-community/tiny-MLX-4bit")
    assert_one_line_error(result, 2, "LM Studio's copy")
    assert folder.is_dir()


def test_lmstudio_models_dir_is_found_as_lm_studio_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSTUDIO_MODELS_DIR", str(tmp_path / "mine"))
    assert hub.lmstudio_models_dir() == tmp_path / "mine"
    monkeypatch.delenv("LMSTUDIO_MODELS_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.lmstudio_models_dir() == tmp_path / ".lmstudio" / "models"
    (tmp_path / ".cache" / "lm-studio").mkdir(parents=True)  # an older install
    assert hub.lmstudio_models_dir() == tmp_path / ".cache" / "lm-studio" / "models"
    (tmp_path / ".lmstudio-home-pointer").write_text(str(tmp_path / "elsewhere") + "\n")
    assert hub.lmstudio_models_dir() == tmp_path / "elsewhere" / "models"
    app = tmp_path / ".config" / "LM Studio"  # the app's own settings (Linux)
    app.mkdir(parents=True)
    (app / "settings.json").write_text(json.dumps({"downloadsFolder": str(tmp_path / "app")}))
    assert hub.lmstudio_models_dir() == tmp_path / "app"
    (tmp_path / "elsewhere").mkdir()  # the settings in its home come first
    settings = {"downloadsFolder": str(tmp_path / "big-disk" / "models")}
    (tmp_path / "elsewhere" / "settings.json").write_text(json.dumps(settings))
    assert hub.lmstudio_models_dir() == tmp_path / "big-disk" / "models"


def test_models_list_shows_the_models_on_disk(cached, tiny_model_dir, tmp_path):
    lmstudio = Path(os.environ["LMSTUDIO_MODELS_DIR"])
    shutil.copytree(tiny_model_dir, lmstudio / "org" / "tiny-mlx")
    (lmstudio / "org" / "tiny-gguf").mkdir(parents=True)  # a GGUF model: not MLX
    (lmstudio / "org" / "tiny-gguf" / "m.Q4_K_M.gguf").write_bytes(b"GGUF")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "not-an-mlx-lm-model"}))
    (bert / "model.safetensors").write_bytes(b"x")
    hf_cache.save(hub.hf_cache_dir(), "other/bert", bert)
    rows = {r["name"]: r for r in json.loads(cli("models", "list", "--json").stdout)}
    size = sum(f.stat().st_size for f in tiny_model_dir.iterdir())
    assert rows[REPO]["where"] == "hf-cache" and rows[REPO]["size_bytes"] == size
    assert (
        rows["org/tiny-mlx"]["where"] == "lmstudio" and rows["org/tiny-mlx"]["size_bytes"] == size
    )
    assert rows[REPO]["description"] == "llama, float"
    assert "org/tiny-gguf" not in rows and "other/bert" not in rows
    table = runner.invoke(app, ["models", "list"], env={"COLUMNS": "200"}).stdout
    assert f"{REPO}" in table and "hf-cache" in table and "lmstudio" in table
    info = cli("models", "info", REPO)
    assert info.exit_code == 0, info.output
    assert "on disk:     hf-cache" in info.stdout and "memory:      weights" in info.stdout
    assert cli("models", "rm", REPO).stdout == f"removed {REPO} from the Hugging Face cache\n"
    assert snapshots() == [] and REPO not in {r["name"] for r in json.loads(cli("models", "list", "--json").stdout)}  # fmt: skip
    assert_one_line_error(cli("models", "rm", REPO), 2, "is not in the Hugging Face cache")


# ------------------------------------------------------------ a stand-in Hub


@pytest.fixture
def hub_server(monkeypatch, tiny_model_dir):
    """A loopback Hub holding ``REPO`` (the tiny llama, plus files mlx-lm does not
    read), reached by huggingface_hub's real client through ``HF_ENDPOINT``; online."""
    from huggingface_hub import constants

    from tests.fake_hub import FakeHub

    files = {f.name: f.read_bytes() for f in tiny_model_dir.iterdir()}
    files["README.md"] = b"# tiny"
    files["original/consolidated.pth"] = b"0" * 1000  # not for mlx-lm: never downloaded
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    with FakeHub({REPO: files}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def mlx_files(tiny_model_dir) -> list[str]:
    return sorted(f.name for f in tiny_model_dir.iterdir())


def test_pull_by_id_downloads_only_what_mlx_lm_reads_into_the_shared_cache(
    hub_server, tiny_model_dir, monkeypatch
):
    result = cli("models", "pull", REPO)
    assert result.exit_code == 0, result.output
    folder = snapshots()[0].parent
    assert sorted(p.name for p in folder.iterdir()) == mlx_files(tiny_model_dir)
    assert hub_server.fetched("README|consolidated") == []
    assert f"pulled {REPO} in" in result.stdout and str(folder) in result.stdout
    assert "already on disk (hf-cache)" in cli("models", "pull", REPO).stdout
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # from now on: the cached copy, offline
    model, _, info = loader.load(REPO, return_info=True)
    assert info.path == folder
    reference, _ = loader.load(tiny_model_dir)
    np.testing.assert_array_equal(logits(model), logits(reference))


def test_the_progress_callback_gets_the_bytes(hub_server, tiny_model_dir):
    stages = []
    hub.pull(REPO, "float32", 4, 64, progress=lambda d, t, s: stages.append((d, t, s)))
    size = sum(f.stat().st_size for f in tiny_model_dir.iterdir())
    steps = [(d, t) for d, t, s in stages if s == f"download {REPO}"]
    assert steps[0] == (0, size) and steps[-1] == (size, size)
    assert len(steps) > 2  # huggingface_hub's own bar reported in between


def test_the_remote_estimate_is_the_one_of_the_folder(hub_server, tiny_model_dir):
    repo = hub.remote_repo(REPO)
    config = hub.remote_config(repo)
    assert hub.remote_tensors(repo) is not None  # read from the headers, by byte range
    for policy in ("float32", "bfloat16", "quantized"):
        weights, _ = hub.weights_estimate(repo, config, policy)
        assert weights == estimate.weights_bytes(tiny_model_dir, policy)
    assert hub_server.fetched("model.safetensors") == []


def test_the_fit_check_runs_before_the_download(hub_server, tiny_model_dir, monkeypatch):
    need = estimate.weights_bytes(tiny_model_dir, "float32") + 10**5
    monkeypatch.setattr(estimate, "available_memory", lambda: need)
    result = cli("models", "pull", REPO)  # the default window (1024) does not fit
    assert_one_line_error(result, 2, f"{REPO} does not fit", "at sinks 4 + window 1024")
    assert hub_server.fetched("model.safetensors|tokenizer") == []
    assert [p.name for p in snapshots()] == ["config.json"]  # a whole file, nothing else
    result = cli("models", "pull", REPO, "--window", "8")  # a window that does: pulled
    assert result.exit_code == 0, result.output
    assert hub.find_local(REPO, verify=True) is not None
    hub.remove_cached(REPO)
    monkeypatch.setattr(estimate, "available_memory", lambda: 10**5)
    result = cli("models", "pull", REPO, "--window", "8")  # not even the weights fit
    assert_one_line_error(result, 2, f"{REPO} does not fit", "only 0.1 MB of memory")
    folder, _ = loader.resolve(REPO, fit=False)  # sharded over machines: no one-machine check
    assert hub.folder_problem(folder) is None


def test_a_catalogue_entry_the_repo_contradicts_is_reported(hub_server):
    notes = []
    expected = {"model_type": "llama", "hidden_size": 999}
    hub.pull(REPO, "float32", 4, 64, log=notes.append, expected=expected)
    assert notes == [
        f"the catalogue entry for {REPO} differs from its config.json (hidden_size: 999 != 64)"
    ]


def test_a_download_cut_off_leaves_no_half_file_and_resumes(
    hub_server, tiny_model_dir, monkeypatch
):
    from huggingface_hub import file_download

    monkeypatch.setattr(file_download.time, "sleep", lambda s: None)  # its retries' pauses
    hub_server.cut = "model.safetensors"
    result = cli("models", "pull", REPO)
    assert_one_line_error(result, 1, f"the download of {REPO} broke off", "run it again")
    assert "model.safetensors" not in [p.name for p in snapshots()]
    assert hub.find_local(REPO, verify=True) is None
    hub_server.cut = None
    assert cli("models", "pull", REPO).exit_code == 0
    assert sorted(p.name for p in snapshots()) == mlx_files(tiny_model_dir)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "kind, code, words",
    [
        ("gated", 2, ["is gated", "hf auth login"]),
        ("missing", 2, ["no such model on Hugging Face"]),
        ("no network", 2, ["is not on this machine", "the Hub cannot be reached (ConnectError)"]),
        ("offline", 2, ["is not on this machine", "HF_HUB_OFFLINE is set"]),
        ("hub down", 1, ["Hugging Face answered 500"]),
    ],
)
def test_hub_failures_are_one_line_and_leave_nothing(hub_server, monkeypatch, kind, code, words):
    repo = REPO
    if kind == "gated":
        hub_server.gated.add(REPO)
    elif kind == "missing":
        repo = "tiny-org/no-such-model"
    elif kind == "no network":
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    elif kind == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        hub_server.down = True
    for command in (["models", "pull", repo], ["models", "info", repo], ["chat", "-m", repo]):
        if kind == "offline" and command[1] == "info":  # says so, asks nothing: exit 0
            assert "on disk:     no (HF_HUB_OFFLINE is set" in cli(*command).stdout
            continue
        assert_one_line_error(runner.invoke(app, command, input="hi\n"), code, *words)
    assert snapshots(repo) == []


def test_offline_with_nothing_cached_is_one_line_on_every_command(tmp_path, monkeypatch):
    text = tmp_path / "book.txt"
    text.write_text("the sea and the ship " * 50)
    for command in (["chat", "-m", REPO], ["stream-run", str(text), "-m", REPO],
                    ["profile", "-m", REPO, "-n", "4"], ["eval", "divergence", str(text), "-m", REPO],
                    ["serve", "-m", REPO, "--port", "0"], ["models", "check", REPO]):  # fmt: skip
        result = runner.invoke(app, command, input="hi\n")
        assert_one_line_error(result, 2, f"{REPO} is not on this machine", "HF_HUB_OFFLINE is set")
    assert snapshots() == []


@pytest.mark.parametrize(
    "files, config, words",
    [
        ({"model.Q4_K_M.gguf": b"GGUF"}, None, ["not an MLX model", "models import"]),
        ({"pytorch_model.bin": b"x"}, {"model_type": "llama"}, ["not an MLX model"]),
        ({"model.safetensors": b"x"}, {"model_type": "nothing-like-it"}, ["mlx-lm can load"]),
    ],
)
def test_a_repo_that_is_not_an_mlx_model_is_refused(hub_server, files, config, words):
    hub_server.repos[REPO] = dict(files)
    if config is not None:
        hub_server.repos[REPO]["config.json"] = json.dumps(config).encode()
    assert_one_line_error(cli("models", "pull", REPO), 2, *words)
    assert hub_server.fetched("safetensors|gguf|bin") == []
    assert all(p.name == "config.json" for p in snapshots())


def test_info_by_id_asks_the_hub_for_sizes_and_fit(hub_server):
    result = cli("models", "info", REPO)
    assert result.exit_code == 0, result.output
    assert f"on disk:     no (run: mlx-stream models pull {REPO})" in result.stdout
    assert "download:" in result.stdout and "commit 89abcdef0123" in result.stdout
    assert "llama, 2 layers" in result.stdout and "memory:      weights" in result.stdout
    assert hub_server.fetched("model.safetensors") == []


def test_the_progress_class_reports_only_the_bytes_written(monkeypatch):
    """huggingface_hub makes a transfer bar and a reconstruction bar with the tqdm
    class it is given: only the second (bytes on disk) is reported."""
    seen = []
    bar_class = hub.remote.progress_class(lambda d, t, s: seen.append((d, t, s)), "download x")
    transfer = bar_class(desc="Downloading bytes", total=100, unit="B", name="transfer")
    transfer.update(50)
    written = bar_class(desc="Reconstructing (incomplete total...)", total=100, unit="B")
    written.update(30)
    written.update(70)
    transfer.close()
    written.close()
    assert seen == [(30, 100, "download x"), (100, 100, "download x")]


# --------------------------------------------------------- the fit before loading


def test_loading_a_model_that_does_not_fit_is_refused_before_it_loads(tiny_model_dir, monkeypatch):
    weights = estimate.weights_bytes(tiny_model_dir, "float32")
    monkeypatch.setattr(estimate, "available_memory", lambda: weights)  # no room for a cache
    with pytest.raises(
        UserError, match=r"does not fit: it needs .* at sinks 4 \+ window 1024\) but only"
    ):
        loader.load(tiny_model_dir)
    text = tiny_model_dir.parent / "book.txt"
    text.write_text("the sea and the ship " * 50)
    result = runner.invoke(app, ["stream-run", str(text), "-m", str(tiny_model_dir)])
    assert_one_line_error(result, 2, "does not fit")


def test_a_quantized_folder_fits_as_it_will_load(tiny_gguf_q4, monkeypatch):
    folder = gguf.convert(tiny_gguf_q4[0], registry.home_dir() / "q4")
    need = estimate.folder_estimate(folder, "float32", 4, 16)["total_bytes"]
    monkeypatch.setattr(estimate, "available_memory", lambda: need)
    loader.load(folder, sinks=4, window=16)  # exactly enough
    monkeypatch.setattr(estimate, "available_memory", lambda: need - 1)
    with pytest.raises(UserError, match="the CPU backend loads weights as float32"):
        loader.load(folder, sinks=4, window=16)
    loader.load(folder, dtype="quantized", sinks=4, window=16)  # as stored: smaller


# ------------------------------------------------------------------------ serve


def test_serve_answers_to_the_id_it_serves_and_its_catalogue_name(cached):
    from tests.support.server import Server, http

    repo = "mlx-community/Qwen3-0.6B-4bit"
    hf_cache.save(hub.hf_cache_dir(), repo, cached)
    server = Server(repo, "--max-tokens", "4")  # HF_HOME of this test: its cache
    try:
        assert [m["id"] for m in server.get("/v1/models")["data"]] == [repo]

        def ask(model: str) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            return http("POST", server.url + "/v1/chat/completions", json.dumps(body).encode())

        assert ask(repo).status_code == 200
        assert ask("qwen3-0.6b").status_code == 200  # the catalogue entry it is
        missing = ask("qwen3-4b")
        assert missing.status_code == 404 and repr(repo) in missing.json()["error"]["message"]
    finally:
        server.stop()


def test_a_quantized_cache_is_counted_as_quantized(tiny_model_dir, monkeypatch):
    """--kv-bits 4 makes a window fit that a float cache would not: the check before
    loading counts the cache the command will build."""
    kv = {"kv_bits": 4, "kv_group_size": 16, "key_bits": None}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    weights = estimate.weights_bytes(tiny_model_dir, "float32")
    small = hub.fit_summary(config, weights, 4, 4, 4096, kv)["total_bytes"]
    monkeypatch.setattr(estimate, "available_memory", lambda: small)
    loader.check_folder_fits(tiny_model_dir, None, "float32", 4, 4096, kv)
    with pytest.raises(UserError, match="does not fit"):
        loader.check_folder_fits(tiny_model_dir, None, "float32", 4, 4096)


def test_config_mismatches_compare_only_what_the_entry_says():
    real = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "head_dim": 256,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "vocab_size": 262208}  # fmt: skip
    entry = {"model_type": "gemma3_text", "head_dim": 256, "rope_scaling": {"rope_type": "linear"},
             "vocab_size": 262208}  # fmt: skip
    assert hub.config_mismatches(entry, real) == []  # a text_config is read as the model's
    entry["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    entry["head_dim"] = 128
    assert hub.config_mismatches(entry, real) == ["head_dim: 128 != 256",
                                                  "rope_scaling.factor: 4.0 != 8.0"]  # fmt: skip
    assert hub.config_mismatches({"model_type": "llama"}, real) == [
        "model_type: 'llama' != 'gemma3'"
    ]


def test_without_headers_the_estimate_scales_the_file_sizes(monkeypatch):
    """A Hub that does not give safetensors headers: the sizes of the weight files,
    as stored, or dequantized at the model's bits per weight."""
    monkeypatch.setattr(hub.remote, "remote_tensors", lambda repo: None)
    repo = hub.RemoteRepo("a/b", None, {"model.safetensors": 4500, "tokenizer.json": 99})
    config = {"quantization": {"bits": 4, "group_size": 64}}
    assert hub.weights_estimate(repo, config, "quantized") == (4500, 2)
    assert hub.weights_estimate(repo, config, "float32") == (32000, 4)  # 8,000 weights
    assert hub.weights_estimate(repo, {}, "float32") == (9000, 4)  # bfloat16 as stored


def test_commands_run_a_cached_id(cached, tmp_path):
    """-m org/name on a command, offline, from the shared cache."""
    text = tmp_path / "book.txt"
    text.write_text("the sea and the ship and the whale " * 40)
    args = ["stream-run", str(text), "-m", REPO, "--window", "32", "--sinks", "4", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] > 200
    check = cli("models", "check", REPO)
    assert check.exit_code == 0 and "verdict: exact" in check.stdout


def test_doctor_says_where_it_looks_and_what_it_found(cached):
    report = json.loads(cli("doctor", "--no-speed", "--json").stdout)
    assert report["hf_cache"] == str(hub.hf_cache_dir()) and report["hf_cache_models"] == 1
    assert report["lmstudio_models_dir"] == os.environ["LMSTUDIO_MODELS_DIR"]
    assert report["lmstudio_models"] == 0
    text = cli("doctor", "--no-speed").stdout
    assert f"{hub.hf_cache_dir()}: 1 MLX model\n" in text and "0 MLX models" in text
