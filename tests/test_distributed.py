"""Sharded runs with MLX distributed (issue 16), on loopback with the ring backend.

The fast tests check the refusals in-process. The ``slow`` ones start real ranks with
``mlx.launch --backend ring --hosts 127.0.0.1`` (or by hand, to kill one) and compare
what rank 0 prints with one process: perplexity within float tolerance and greedy
answers token for token, past many wraps of a small window.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from mlx_stream import distributed
from mlx_stream.errors import UserError
from tests import tiny
from tests.conftest import DATA, assert_one_line_error

runner = CliRunner()
VENV_BIN = Path(sys.executable).parent
MLX_STREAM = VENV_BIN / "mlx-stream"
LAUNCH_TIMEOUT = 120
REAL_MODEL_TIMEOUT = 300  # three float32 copies' shards on two shared cores
SMALL = ["--window", "16", "--sinks", "2"]
GREEDY = ["--temp", "0"]  # chat and stream-run --prompt sample by default: compare greedy


# ----------------------------------------------------------------------- helpers


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
def folders(tmp_path_factory):
    """Tiny models on disk: llama (tensor parallel only), qwen2 (tensor and pipeline)."""
    root = tmp_path_factory.mktemp("distributed")
    return {
        "llama": tiny.save_model_folder(root / "llama", "llama"),
        "qwen2": tiny.save_model_folder(root / "qwen2", "qwen2", num_hidden_layers=4),
    }


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    rng = random.Random(3)
    path = tmp_path_factory.mktemp("text") / "book.txt"
    path.write_text(" ".join(rng.choice(tiny.VOCAB_WORDS) for _ in range(400)) + "\n")
    return path


# ------------------------------------------------------------------- refusals


def test_refuses_heads_that_do_not_divide_and_names_them():
    model = tiny.make_model("llama")  # 4 heads, 2 KV heads; no pipeline in mlx-lm
    with pytest.raises(UserError, match="4 attention heads do not divide over 3 ranks"):
        distributed.choose(model, 3)
    assert distributed.choose(model, 2) == "tensor"
    with pytest.raises(UserError, match="pipeline: mlx-lm has none"):
        distributed.choose(model, 2, "pipeline")


def test_pipeline_takes_over_where_tensor_parallel_does_not_fit():
    model = tiny.make_model("qwen2", num_hidden_layers=3)
    assert distributed.strategies(model) == ["tensor", "pipeline"]
    assert distributed.choose(model, 2) == "tensor"
    assert distributed.choose(model, 3) == "pipeline"  # 4 heads do not divide over 3
    assert distributed.choose(model, 2, "pipeline") == "pipeline"
    with pytest.raises(UserError, match="3 layers are fewer than 4 ranks"):
        distributed.choose(model, 4, "pipeline")


def test_refuses_a_model_with_neither_strategy():
    model = tiny.make_model("gemma3_text")
    with pytest.raises(UserError, match="neither tensor parallel .* nor pipeline"):
        distributed.choose(model, 2)


def test_no_launch_is_one_process_unless_a_strategy_is_forced(monkeypatch, tiny_model_dir):
    for name in distributed.LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    assert distributed.start("auto") is None
    assert distributed.start("off") is None
    with pytest.raises(UserError, match="unknown --distributed mode"):
        distributed.start("rings")
    result = runner.invoke(app, ["chat", "-m", str(tiny_model_dir), "--distributed", "tensor"])
    assert_one_line_error(result, 2, "runs under mlx.launch")


# ------------------------------------------------------------- real ranks (slow)


def compare_stream_run(n: int, folder: Path, text: Path, *extra: str) -> None:
    args = ["stream-run", str(text), "-m", str(folder), *SMALL, "--json"]
    args += ["--prompt", "the sea", "--max-tokens", "24", *GREEDY]
    one = single(*args)
    result = launch(n, *args, *extra)
    assert not errors(result), result.stderr
    sharded = last_json(result)
    assert sharded["tokens"] == one["tokens"] > 16 * 10  # many wraps of the window
    assert sharded["perplexity"] == pytest.approx(one["perplexity"], rel=1e-4)
    assert sharded["answer"] == one["answer"] and sharded["answer"]
    assert len([line for line in result.stdout.splitlines() if line.startswith("{")]) == 1


@pytest.mark.slow
def test_tensor_parallel_stream_run_equals_one_process(folders, text):
    compare_stream_run(2, folders["llama"], text)


@pytest.mark.slow
def test_pipeline_stream_run_equals_one_process(folders, text):
    """Each rank runs 2 of the 4 layers; the sink cache's build-time model check runs
    its probe passes through the pipeline in step on both ranks."""
    compare_stream_run(2, folders["qwen2"], text, "--distributed", "pipeline")


@pytest.mark.slow
def test_chat_replies_equal_one_process_and_refuses_save(folders):
    # mlx.launch never passes on the end of its input: /quit ends the ranks
    lines = "hello the sea\n/save here\nwhale ship captain\n/quit\n"
    args = ["chat", "-m", str(folders["llama"]), *SMALL, "--max-tokens", "30", *GREEDY]
    one = runner.invoke(app, args, input="hello the sea\nwhale ship captain\n")
    assert one.exit_code == 0, one.stderr
    result = launch(2, *args, "--distributed", "tensor", input=lines)
    assert result.stdout == one.stdout
    assert errors(result) == ["Error: /save is not available with --distributed (each rank holds part of the cache)"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("model", "mode"), [("llama", "tensor"), ("qwen2", "pipeline")])
def test_profile_each_rank_holds_half_the_cache(folders, model, mode):
    args = ["profile", "-m", str(folders[model]), *SMALL, "--tokens", "40", "--json"]
    one = single(*args)
    result = launch(2, *args, "--distributed", mode)
    assert not errors(result), result.stderr
    report = last_json(result)["distributed"]
    assert report["strategy"] == mode
    whole = one["kv_cache_mb"]["end"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:  # half the KV heads (tensor) or half the layers (pipeline)
        assert r["kv_cache_mb"] == pytest.approx(whole / 2, abs=1e-3)
        assert 0 < r["weights_mb"]
    assert 0 < report["collective_share"]


@pytest.mark.slow
def test_refusal_under_launch_is_one_line(folders, text):
    result = launch(3, "stream-run", str(text), "-m", str(folders["llama"]), "--json")
    assert errors(result) == [
        "Error: cannot shard llama over 3 ranks: tensor: its 4 attention heads do not divide "
        "over 3 ranks; pipeline: mlx-lm has none for it"
    ]
    assert "Traceback" not in result.stdout + result.stderr


# mlx-stream with one qwen2 layer reading its cache's offset besides the rope (as a
# learned absolute position would): the cache's model check must refuse it.
ABSOLUTE_LAYER = """
import sys
from mlx_lm.models import qwen2

LAYER = int(sys.argv.pop(1))

class AbsoluteBlock(qwen2.TransformerBlock):
    def __call__(self, x, mask=None, cache=None):
        return super().__call__(x, mask, cache) + 1e-2 * (cache.offset if cache else 0)

init = qwen2.Qwen2Model.__init__

def patched(self, args):
    init(self, args)
    self.layers[LAYER].__class__ = AbsoluteBlock

qwen2.Qwen2Model.__init__ = patched
from cli.main import main
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("layer", [0, 2], ids=["rank-1-refuses", "rank-0-refuses"])
def test_pipeline_ranks_agree_when_one_ranks_layers_fail_the_check(folders, text, tmp_path, layer):
    """Each rank checks only its own layers (rank 1 holds layers 0-1, rank 0 layers
    2-3); a bad layer changes the next layer's cache, so one rank finds it. Both ranks
    must refuse with the same line before the first token: a rank that went on alone
    would wait for its peer until the connection watch ended it."""
    script = tmp_path / "absolute_layer.py"
    script.write_text(ABSOLUTE_LAYER)
    program = [sys.executable, str(script), str(layer)]
    args = ["stream-run", str(text), "-m", str(folders["qwen2"]), *SMALL, "--json"]
    one = subprocess.run([*program, *args], capture_output=True, text=True, timeout=120)
    assert one.returncode == 2, one.stderr
    [refusal] = one.stderr.strip().splitlines()
    assert refusal.startswith(f"Error: qwen2: layer {layer + 1}: its cached tensors change")
    assert refusal.endswith("; stream-run and eval can run it with --positions absolute (chat and serve need cache positions)")  # fmt: skip
    procs = start_ranks(2, [*args, "--distributed", "pipeline"], tmp_path, program)
    try:
        outs = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
    finally:
        stop_ranks(procs)
    assert [p.returncode for p in procs] == [2, 2], outs
    assert [err.decode().strip() for _, err in outs] == [refusal, f"rank 1: {refusal}"]
    assert [out for out, _ in outs] == [b"", b""]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "mode"), [("llama", "tensor"), ("qwen2", "pipeline")])
def test_a_killed_rank_ends_the_others_within_seconds(folders, tmp_path, model, mode):
    """Ranks started by hand (no mlx.launch to clean up): rank 1 dies mid-reply, and
    rank 0 ends by itself with one error line (MLX raises, or, where its collective
    waits on forever, the rank's watch on its ring connections ends it)."""
    args = ["chat", "-m", str(folders[model]), *SMALL, "--max-tokens", "100000"]
    args += ["--distributed", mode]
    procs = start_ranks(2, args, tmp_path)
    root, other = procs
    try:
        root.stdin.write(b"the sea\n")
        root.stdin.flush()
        assert root.stdout.read(16)  # rank 0 is replying
        other.kill()
        start = time.monotonic()
        root.stdin.close()  # should the reply have ended, the next read ends it too
        code = root.wait(timeout=30)
        waited = time.monotonic() - start
        err = root.stderr.read().decode()
    finally:
        stop_ranks(procs)
    assert code == 1
    assert waited < 15
    assert err.strip().splitlines() == ["Error: RuntimeError: [ring] connection to a peer was lost"]  # fmt: skip


WATCHED = """
import socket, sys, time
from mlx_stream import distributed
peer = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
root = type("Root", (), {"is_root": True})()
distributed._watch_peers(root, [peer])
print("watching", flush=True)
time.sleep(60)  # a collective that never returns: the main thread sits still
"""


def test_a_rank_stuck_after_its_peer_left_ends_itself_with_one_line():
    """MLX's ring can wait forever on a peer that left: the watch on the connection
    ends the rank within seconds of the peer closing its side."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-c", WATCHED, str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            other, _ = server.accept()
            assert proc.stdout.readline() == "watching\n"
            time.sleep(distributed.PEER_GRACE)
            assert proc.poll() is None  # the peer is there: nothing happens
            other.close()
            start = time.monotonic()
            code = proc.wait(timeout=30)
            waited = time.monotonic() - start
            err = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert code == 1 and waited < distributed.PEER_GRACE + 3
    assert err.splitlines() == ["Error: RuntimeError: [ring] connection to a peer was lost"]


@pytest.mark.slow
def test_ctrl_c_ends_every_rank_with_one_line(folders, tmp_path):
    """Ctrl-C reaches every rank of the terminal's process group, mid-reply: all stop
    (a reply stopped on one rank only would leave the ranks out of step)."""
    args = ["chat", "-m", str(folders["llama"]), *SMALL, "--max-tokens", "100000"]
    procs = start_ranks(2, args, tmp_path)
    root = procs[0]
    try:
        root.stdin.write(b"the sea\n")
        root.stdin.flush()
        assert root.stdout.read(16)  # rank 0 is replying
        for p in procs:
            p.send_signal(signal.SIGINT)
        codes = [p.wait(timeout=30) for p in procs]
        err = root.stderr.read().decode()
    finally:
        stop_ranks(procs)
    assert codes == [130, 130]
    assert err.strip().splitlines() == ["Error: interrupted; every rank stops"]


def start_server(
    n: int, folder: Path, tmp_path: Path, sizes: list[str] = SMALL
) -> tuple[str, list[subprocess.Popen]]:
    """``mlx-stream serve`` on ``n`` ranks started by hand (one: a single process);
    returns rank 0's URL once it answers, and the ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["serve", "-m", str(folder), "--max-tokens", "40", *sizes, "--port", str(port)]
    args += ["--distributed", "off" if n == 1 else "auto"]
    (tmp_path / f"ranks-{n}").mkdir()
    procs = start_ranks(n, args, tmp_path / f"ranks-{n}")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline:
        if procs[0].poll() is not None:
            stop_ranks(procs)
            raise RuntimeError(f"serve exited: {procs[0].stderr.read().decode()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return url, procs
        except OSError:
            time.sleep(0.2)
    stop_ranks(procs)
    raise RuntimeError("serve did not start")


def converse(url: str, turns: list[str]) -> list[str]:
    """Greedy replies to ``turns``, each request resending the conversation so far."""
    messages, replies = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        body = json.dumps({"model": "default", "messages": messages, "temperature": 0})
        request = urllib.request.Request(
            url + "/v1/chat/completions", data=body.encode(), method="POST",
            headers={"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=LAUNCH_TIMEOUT) as r:
            reply = json.loads(r.read())["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


@pytest.mark.slow
def test_serve_replies_equal_one_process_and_followers_end_with_rank_0(folders, tmp_path):
    """Rank 0 serves HTTP, rank 1 runs every request with it (tensor parallel); the
    first message alone wraps the 16-token window several times."""
    rng = random.Random(5)
    turns = [" ".join(rng.choice(tiny.VOCAB_WORDS) for _ in range(60)), "the sea", "whale"]
    replies = {}
    for n in (1, 2):
        url, procs = start_server(n, folders["llama"], tmp_path)
        try:
            replies[n] = converse(url, turns)
            procs[0].terminate()
            codes = [p.wait(timeout=15) for p in procs]  # rank 1 ends with rank 0
            err = procs[0].stderr.read().decode()
        finally:
            stop_ranks(procs)
        assert "Error" not in err, err
        assert codes[0] == 0  # SIGTERM: requests ended, sessions saved, a clean exit
    assert replies[2] == replies[1] and all(replies[1])
    assert "tensor over 2 ranks" in err and "--distributed: one request at a time" in err


@pytest.mark.slow
def test_sharded_serve_runs_agent_requests_in_step(tiny_bpe_model_dir, tmp_path):
    """Tools, a forced call, its result, a seeded sampled reply with logit_bias and a
    JSON-schema reply on 2 ranks: what one process replies (every rank builds the same
    constraint, call ids and transcript, so the ranks stay in step)."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}},
        "required": ["city"], "additionalProperties": False}}}  # fmt: skip

    def post(url, body):
        request = urllib.request.Request(
            url + "/v1/chat/completions", data=json.dumps({"model": "default", **body}).encode(),
            method="POST", headers={"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=LAUNCH_TIMEOUT) as r:
            return json.loads(r.read())["choices"][0]

    results = {}
    for n in (1, 2):
        # --max-tokens caps a request's max_tokens: room for the forced call's 200
        sizes = ["--window", "1024", "--max-tokens", "200"]
        url, procs = start_server(n, tiny_bpe_model_dir, tmp_path, sizes)
        try:
            ask = [{"role": "user", "content": "weather"}]
            first = post(url, {"messages": ask, "tools": [weather], "tool_choice": "required",
                               "max_tokens": 200})  # fmt: skip
            (call,) = first["message"]["tool_calls"]
            follow = [*ask, first["message"],
                      {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]  # fmt: skip
            second = post(url, {"messages": follow, "tools": [weather], "temperature": 1.0,
                                "seed": 3, "logit_bias": {"40": 5}, "max_tokens": 8})  # fmt: skip
            schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"], "additionalProperties": False}}}  # fmt: skip
            third = post(url, {"messages": [{"role": "user", "content": "ok?"}],
                               "response_format": schema, "max_tokens": 60})  # fmt: skip
            results[n] = (first, second, third)
        finally:
            stop_ranks(procs)
    assert results[2] == results[1]
    assert results[1][0]["finish_reason"] == "tool_calls"
    assert isinstance(json.loads(results[1][2]["message"]["content"])["ok"], bool)


@pytest.mark.real_model
@pytest.mark.slow
def test_default_model_tensor_parallel_over_three_ranks(real_model_path, tmp_path):
    """9 heads and 3 KV heads over 3 ranks: the same greedy answer and perplexity,
    96 tokens through a 16-token window (5 wraps). Each token costs 60 collectives
    over loopback, slow on a loaded machine: few tokens, ranks started by hand."""
    text = DATA / "alice_in_wonderland.txt"
    args = ["stream-run", str(text), "-m", str(real_model_path), "--window", "16"]
    args += ["--sinks", "4", "--limit-tokens", "96", "--json", "--prompt", "Who is Alice?"]
    args += ["--max-tokens", "12", *GREEDY]
    one = single(*args)
    procs = start_ranks(3, args, tmp_path)
    try:
        out, err = procs[0].communicate(timeout=REAL_MODEL_TIMEOUT)
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        stop_ranks(procs)
    assert procs[0].returncode == 0, err.decode()
    sharded = json.loads(out.decode().strip().splitlines()[-1])
    assert sharded["tokens"] == one["tokens"] == 95
    assert sharded["perplexity"] == pytest.approx(one["perplexity"], rel=1e-4)
    assert sharded["answer"] == one["answer"] and sharded["answer"]


def test_benchmark_quick_one_rank_and_skips_what_does_not_divide(
    folders, tmp_path, capsys, monkeypatch
):
    from tests.test_benchmarks_smoke import load_script

    bench = load_script("distributed", monkeypatch)
    out = tmp_path / "d.jsonl"
    records = bench.main(["--quick", "--model", str(folders["llama"]), "--ranks", "1,3",
                          "--out", str(out)])  # fmt: skip
    assert "skipping 3 ranks: cannot shard llama over 3 ranks" in capsys.readouterr().err
    *rows, summary = records
    assert {r["cache"] for r in rows} == {"sink", "rotating"}
    for r in rows:
        assert r["ranks"] == 1 and r["tok_s"] > 0 and r["per_rank"][0]["weights_mb"] > 0
    assert summary["ranks"] == [1] and summary["sink_over_rotating_tok_s_1"] > 0
    assert len(out.read_text().splitlines()) == 3
    sys.modules.pop("tables", None)
    import tables  # benchmarks/tables.py, on the path load_script set

    assert "| 1 | - | sink |" in tables.distributed_tables(tables.read(out))
