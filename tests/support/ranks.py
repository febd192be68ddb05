"""Ranks on loopback for the sharded-run tests: started under ``mlx.launch`` or by
hand, stopped, their output read; and the tiny models they shard (fixtures, registered
by ``tests/conftest.py``)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from mlx_stream import distributed
from tests import tiny

runner = CliRunner()
VENV_BIN = Path(sys.executable).parent
MLX_STREAM = VENV_BIN / "mlx-stream"
LAUNCH_TIMEOUT = 120
REAL_MODEL_TIMEOUT = 300  # three float32 copies' shards on two shared cores
SMALL = ["--window", "16", "--sinks", "2"]
GREEDY = ["--temp", "0"]  # chat and stream-run --prompt sample by default: compare greedy


def launch(
    n: int, *args: str, input: str | None = None, timeout: float = LAUNCH_TIMEOUT
) -> subprocess.CompletedProcess:
    """``mlx-stream ARGS`` on ``n`` loopback ranks under ``mlx.launch`` (killed on timeout)."""
    command = distributed.loopback_launch(n, [str(MLX_STREAM), *args])
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # stdin stays open: at end of input mlx.launch spins on it, slowing the ranks down
    try:
        proc.stdin.write(input or "")
        proc.stdin.flush()
        proc.wait(timeout=timeout)  # our outputs are far below a pipe's buffer
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def start_ranks(
    n: int, args: list[str], tmp_path: Path, program: list[str] | None = None
) -> list[subprocess.Popen]:
    """``mlx-stream ARGS`` (or ``PROGRAM ARGS``) on ``n`` loopback ranks started by hand
    (what mlx.launch does: a hostfile and ``MLX_RANK``), without the launcher's stdin
    forwarding loop."""
    procs = []
    for env in distributed.loopback_envs(n, tmp_path):
        procs.append(
            subprocess.Popen(
                [*(program or [str(MLX_STREAM)]), *args],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        )
    return procs


def stop_ranks(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def errors(result: subprocess.CompletedProcess) -> list[str]:
    """Our ``Error:`` lines (mlx.launch adds its own ``[WARN]`` lines)."""
    return [line for line in result.stderr.splitlines() if "Error:" in line]


def last_json(result: subprocess.CompletedProcess) -> dict:
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, (result.stdout, result.stderr)
    return json.loads(lines[-1])


def single(*args: str) -> dict:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def shard_models(tmp_path_factory):
    """Tiny models on disk: llama (tensor parallel only), qwen2 (tensor and pipeline)."""
    root = tmp_path_factory.mktemp("distributed")
    return {
        "llama": tiny.save_model_folder(root / "llama", "llama"),
        "qwen2": tiny.save_model_folder(root / "qwen2", "qwen2", num_hidden_layers=4),
    }


@pytest.fixture(scope="module")
def shard_text(tmp_path_factory) -> Path:
    rng = random.Random(3)
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text(" ".join(rng.choice(tiny.VOCAB_WORDS) for _ in range(400)) + "\n")
    return path
