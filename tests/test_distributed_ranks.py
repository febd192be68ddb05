"""Sharded runs that end early, on loopback: a refusal on every rank, a killed or
stuck rank, Ctrl-C; and ``serve`` on two ranks replying what one process replies."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mlx_stream import distributed
from tests import tiny
from tests.support.ranks import (
    LAUNCH_TIMEOUT,
    SMALL,
    errors,
    launch,
    start_ranks,
    stop_ranks,
)


@pytest.mark.slow
def test_refusal_under_launch_is_one_line(shard_models, shard_text):
    result = launch(3, "stream-run", str(shard_text), "-m", str(shard_models["llama"]), "--json")
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
def test_pipeline_ranks_agree_when_one_ranks_layers_fail_the_check(
    shard_models, shard_text, tmp_path, layer
):
    """Each rank checks only its own layers (rank 1 holds layers 0-1, rank 0 layers
    2-3); a bad layer changes the next layer's cache, so one rank finds it. Both ranks
    must refuse with the same line before the first token: a rank that went on alone
    would wait for its peer until the connection watch ended it."""
    script = tmp_path / "absolute_layer.py"
    script.write_text(ABSOLUTE_LAYER)
    program = [sys.executable, str(script), str(layer)]
    args = ["stream-run", str(shard_text), "-m", str(shard_models["qwen2"]), *SMALL, "--json"]
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
def test_a_killed_rank_ends_the_others_within_seconds(shard_models, tmp_path, model, mode):
    """Ranks started by hand (no mlx.launch to clean up): rank 1 dies mid-reply, and
    rank 0 ends by itself with one error line (MLX raises, or, where its collective
    waits on forever, the rank's watch on its ring connections ends it)."""
    args = ["chat", "-m", str(shard_models[model]), *SMALL, "--max-tokens", "100000"]
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
def test_ctrl_c_ends_every_rank_with_one_line(shard_models, tmp_path):
    """Ctrl-C reaches every rank of the terminal's process group, mid-reply: all stop
    (a reply stopped on one rank only would leave the ranks out of step)."""
    args = ["chat", "-m", str(shard_models["llama"]), *SMALL, "--max-tokens", "100000"]
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
def test_serve_replies_equal_one_process_and_followers_end_with_rank_0(shard_models, tmp_path):
    """Rank 0 serves HTTP, rank 1 runs every request with it (tensor parallel); the
    first message alone wraps the 16-token window several times."""
    rng = random.Random(5)
    turns = [" ".join(rng.choice(tiny.VOCAB_WORDS) for _ in range(60)), "the sea", "whale"]
    replies = {}
    for n in (1, 2):
        url, procs = start_server(n, shard_models["llama"], tmp_path)
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
