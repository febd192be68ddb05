"""Stream-run checkpoints (issue 13): they know what they belong to, prove their arrays
intact, are saved on a cadence and when a run is stopped, and leave nothing behind."""

import os
import subprocess
import sys

import pytest

from mlx_stream import checkpoint as ckpt
from mlx_stream.errors import UserError
from mlx_stream.eval.perplexity import stream_perplexity
from mlx_stream.files import file_mode, remove_stale
from tests import tiny

SINKS, WINDOW = 4, 32
TOKENS = tiny.random_tokens(400, seed=1)
OTHER = tiny.random_tokens(400, seed=2)
IDENTITY = {"model": "tiny", "sinks": SINKS, "window": WINDOW, "positions": "cache"}


def run(model, tokens, path, **kwargs):
    kwargs = {"segment": 100, "checkpoint": path, "identity": IDENTITY, **kwargs}
    return stream_perplexity(model, tokens, SINKS, WINDOW, **kwargs)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_resume_refuses_another_text(tiny_llama, tmp_path):
    path = tmp_path / "c.safetensors"
    run(tiny_llama, TOKENS, path, limit_tokens=150)
    with pytest.raises(UserError, match="made from another text"):
        run(tiny_llama, OTHER, path, resume=True)
    # The same text resumes, and a text shorter than what was consumed is another text.
    assert run(tiny_llama, TOKENS, path, resume=True).tokens == len(TOKENS) - 1
    with pytest.raises(UserError, match="another text"):
        run(tiny_llama, TOKENS[:100], path, resume=True)


@pytest.mark.parametrize(
    "field, value",
    [("positions", "absolute"), ("kv-bits", 4), ("model", "other"), ("window", 64)],
)
def test_resume_refuses_other_settings_naming_the_field(tiny_llama, tmp_path, field, value):
    path = tmp_path / "c.safetensors"
    run(tiny_llama, TOKENS, path, limit_tokens=150)
    with pytest.raises(UserError, match=f"made with {field} .*this run has {field} {value}"):
        run(tiny_llama, TOKENS, path, resume=True, identity={**IDENTITY, field: value})
    with pytest.raises(UserError, match="segment 100, this run has segment 50"):
        run(tiny_llama, TOKENS, path, resume=True, segment=50)


def test_corrupted_arrays_fail_their_checksum(tiny_llama, tmp_path):
    path = tmp_path / "c.safetensors"
    run(tiny_llama, TOKENS, path, limit_tokens=150)
    data = bytearray(path.read_bytes())
    data[-200:-100] = b"\xff" * 100  # tensor data (NaN-like floats), header intact
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        run(tiny_llama, TOKENS, path, resume=True)


def test_checkpoints_follow_the_cadence(tiny_llama, tmp_path, monkeypatch):
    saved = []
    real = ckpt.save
    monkeypatch.setattr(ckpt, "save", lambda p, c, state, i: (saved.append(state["position"]), real(p, c, state, i)))  # fmt: skip
    run(tiny_llama, TOKENS, tmp_path / "c.safetensors", limit_tokens=350, checkpoint_every=100)
    # One save per crossed multiple of 100 (chunks are 64 tokens), and one at the end.
    assert len(saved) == 4 and saved[-1] == 350
    assert [p // 100 for p in saved[:3]] == [1, 2, 3]


def test_a_stopped_run_saves_and_resumes_exactly(tiny_llama, tmp_path):
    whole = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, segment=100)
    path = tmp_path / "c.safetensors"
    calls = []
    stopped = run(tiny_llama, TOKENS, path, should_stop=lambda: len(calls.append(0) or calls) > 3)
    assert stopped.interrupted and 100 < stopped.position < len(TOKENS)
    assert ckpt.read_metadata(path)["state"]["position"] == stopped.position
    rest = run(tiny_llama, TOKENS, path, resume=True)
    assert not rest.interrupted and rest.tokens == whole.tokens
    assert rest.nll == pytest.approx(whole.nll, abs=1e-4)


def test_a_failed_save_does_not_end_the_run(tiny_llama, tmp_path):
    missing = tmp_path / "gone" / "c.safetensors"  # its folder does not exist
    r = run(tiny_llama, TOKENS, missing, checkpoint_every=100)
    assert r.tokens == len(TOKENS) - 1
    assert r.checkpoint_error and "cannot save checkpoint" in r.checkpoint_error


def test_save_removes_a_killed_saves_leftover_and_follows_the_umask(tiny_llama, tmp_path):
    path = tmp_path / "c.safetensors"
    leftover = tmp_path / f".c.safetensors.partial-{dead_pid()}-.safetensors"
    leftover.write_bytes(b"half a checkpoint")
    old = os.umask(0o022)
    try:
        run(tiny_llama, TOKENS, path, limit_tokens=100)
        assert path.stat().st_mode & 0o777 == 0o644 == file_mode()
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


def test_remove_stale_keeps_live_processes_work(tmp_path):
    target = tmp_path / "m"
    dead = tmp_path / f".m.partial-{dead_pid()}-x"
    dead.mkdir()
    live = tmp_path / ".m.partial-1-x"  # pid 1 is always alive
    live.write_text("")
    unrelated = tmp_path / ".m.partial-notapid"
    unrelated.write_text("")
    assert remove_stale(target) == [dead]
    assert live.exists() and unrelated.exists()


def test_not_a_checkpoint(tmp_path):
    old_format = tmp_path / "old.safetensors"
    import mlx.core as mx

    mx.save_safetensors(str(old_format), {"a": mx.zeros(2)}, {"mlx_stream": "{}"})
    with pytest.raises(UserError, match="not a stream-run checkpoint"):
        ckpt.read_metadata(old_format)
    with pytest.raises(UserError, match="no such checkpoint"):
        ckpt.read_metadata(tmp_path / "none.safetensors")
