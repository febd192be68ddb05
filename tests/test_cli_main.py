"""The root command: instant --help/--version, lazy engine imports, shared options and
the helpers every command uses (one-line errors, file checks, atomic writes)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli import common
from cli.main import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def run_cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run the CLI in a child; its result and the CPU seconds it used (user + system: on a
    shared machine the wall clock measures the other jobs as much as this one)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_help_and_version_are_instant():
    run_cli("--version")  # warm the file cache
    for args in (["--help"], ["--version"]):
        best = min(run_cli(*args)[1] for _ in range(3))
        assert best < 0.5, f"mlx-stream {' '.join(args)} took {best:.2f} s of CPU"
    proc, _ = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("mlx-stream ")


def test_importing_the_cli_does_not_import_the_engine():
    code = (
        "import sys, cli.main\n"
        "heavy = [m for m in ('mlx', 'mlx_lm', 'mlx.core', 'rich', 'numpy', 'transformers')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


@pytest.mark.parametrize(
    "command, options",
    [
        ("chat", ["--model", "--sinks", "--window", "--keep-system", "--system", "--max-tokens",
                  "--temp", "--top-p", "--seed", "--draft-model", "--num-draft-tokens",
                  "--dtype", "MLX_STREAM_MODEL"]),
        ("stream-run", ["--model", "--sinks", "--window", "--prompt", "--json", "--csv",
                        "--positions", "--limit-tokens", "--chunk", "--segment",
                        "--checkpoint", "--resume", "--dtype"]),
        ("profile", ["--model", "--tokens", "--cache", "--schedule", "--every", "--prompt",
                     "--file", "--draft-model", "--num-draft-tokens", "--compare", "--json",
                     "--csv", "--plot", "--sinks", "--window"]),
    ],
)  # fmt: skip
def test_commands_list_their_options(command, options):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in options:
        assert option in result.stdout, option


def test_root_help_lists_the_commands():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in ("chat", "stream-run", "profile"):
        assert name in result.stdout


# ---------------------------------------------------------------------- helpers


def test_handle_errors_maps_exceptions_to_one_line_and_exit_codes(capsys, monkeypatch):
    from mlx_stream.errors import RuntimeFailure, UserError

    monkeypatch.delenv(common.DEBUG_ENV, raising=False)
    cases = [
        (UserError("bad thing\nsecond line"), 2, "Error: bad thing second line"),
        (RuntimeFailure("network down"), 1, "Error: network down"),
        (ValueError("boom"), 1, "Error: ValueError: boom"),
    ]
    for exc, code, line in cases:

        @common.handle_errors
        def command(exc=exc):
            raise exc

        with pytest.raises(typer.Exit) as info:
            command()
        assert info.value.exit_code == code
        err = capsys.readouterr().err
        assert err == line + "\n"


def test_unicode_errors_are_bad_input():
    try:
        b"\xff\xfe".decode("utf-8")
    except UnicodeDecodeError as exc:
        assert common.exit_code_for(exc) == 2
        assert "not UTF-8" in common.describe(exc)


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "no such file"),
        ("dir", "is a directory"),
        (b"", "empty"),
        (b"   \n\n", "whitespace"),
        (b"\x00\x01binary\x00", "binary"),
        ("latin-1 caf\xe9".encode("latin-1"), "not UTF-8"),
    ],
)
def test_check_text_file_rejects_bad_input(tmp_path, content, words):
    from mlx_stream.errors import UserError

    path = tmp_path / "input.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=words):
        common.check_text_file(path)


def test_check_text_file_accepts_utf8_cut_mid_character(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("é" * common.SNIFF_BYTES, encoding="utf-8")  # 2 bytes each
    assert common.check_text_file(path) == path


def test_check_output_path(tmp_path):
    from mlx_stream.errors import UserError

    assert common.check_output_path(tmp_path / "out.csv") == tmp_path / "out.csv"
    with pytest.raises(UserError, match="does not exist"):
        common.check_output_path(tmp_path / "missing" / "out.csv")
    with pytest.raises(UserError, match="is a directory"):
        common.check_output_path(tmp_path)
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        with pytest.raises(UserError, match="not writable"):
            common.check_output_path(locked / "out.csv")


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "out.csv"
    common.atomic_write_text(path, "old\n")
    with pytest.raises(RuntimeError):
        with common.atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]
    common.atomic_write_csv(path, [{"a": 1, "b": 2}, {"a": 3, "b": 4}])
    assert path.read_text() == "a,b\n1,2\n3,4\n"
