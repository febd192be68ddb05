"""``serve``'s sampling defaults: a request that names a temperature gets exactly the
sampling it names; one that names none gets the server's defaults (the model's, or
``--temp`` and the other sampling options), batched or alone."""

from __future__ import annotations

import queue
import subprocess
import sys

import pytest

from mlx_stream.generate.model_config import Sampling
from mlx_stream.serve.event_types import Delta, End, Failed

MESSAGES = [{"role": "user", "content": "the cat sat on the mat and the dog"}]


def reply(loaded, tmp_path, batching, sampling=None, penalty=None, **request) -> str:
    """The whole reply of a fresh in-process engine to :data:`MESSAGES`."""
    from mlx_stream.cache import CacheSpec
    from mlx_stream.generate.session import Settings
    from mlx_stream.serve.engine import Engine, Request

    model, tokenizer = loaded
    settings = Settings(CacheSpec(sinks=2, window=64), max_tokens=24,
                        repetition_penalty=penalty)  # fmt: skip
    engine = Engine(model, tokenizer, settings, "tiny", state_dir=tmp_path / str(id(request)),
                    batching=batching, sampling=sampling)  # fmt: skip
    engine.start()
    try:
        box: queue.Queue = queue.Queue()
        engine.submit(Request(emit=box.put, messages=MESSAGES, **request))
        parts = []
        while not isinstance(event := box.get(timeout=120), (End, Failed)):
            if isinstance(event, Delta):
                parts.append(event.text)
        assert isinstance(event, End), event
        return "".join(parts)
    finally:
        engine.stop()


@pytest.mark.parametrize("batching", [True, False])
def test_defaults_apply_only_to_requests_that_name_no_temperature(loaded, tmp_path, batching):
    defaults = Sampling(temp=0.0, repetition_penalty=1.5, source="test")
    greedy = reply(loaded, tmp_path, batching)  # an engine without defaults: greedy
    # The same penalty set on the session itself: the reference for the defaults.
    penalized = reply(loaded, tmp_path, batching, penalty=1.5)
    assert penalized != greedy  # the penalty changes this tiny model's reply
    assert reply(loaded, tmp_path, batching, sampling=defaults) == penalized
    assert reply(loaded, tmp_path, batching, sampling=defaults, temp=0.0) == greedy


def test_resolve_fills_what_a_request_leaves_out():
    from mlx_stream.serve.engine import Request
    from mlx_stream.serve.sampling import resolve

    defaults = Sampling(temp=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1)
    named = Request(emit=print, prompt="x", temp=0.2)
    assert resolve(named, defaults) is None
    assert (named.temp, named.top_p, named.top_k) == (0.2, 1.0, None)
    bare = Request(emit=print, prompt="x", top_p=0.5)
    assert resolve(bare, defaults) == 1.1
    assert (bare.temp, bare.top_p, bare.top_k) == (0.7, 0.5, 40)
    drafted = Request(emit=print, prompt="x")  # a draft model takes no processors
    assert resolve(drafted, defaults, draft=True) is None
    assert (drafted.temp, drafted.top_p, drafted.top_k) == (0.7, 0.9, None)


def test_bad_sampling_options_are_one_line_exit_2(tiny_model_dir):
    for flag, value in (("--temp", "-1"), ("--top-p", "0"), ("--repetition-penalty", "0")):
        proc = subprocess.run(
            [sys.executable, "-c", "from cli.main import main; main()", "serve", "-m",
             str(tiny_model_dir), flag, value],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert flag in proc.stderr and "Traceback" not in proc.stderr
