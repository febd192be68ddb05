"""``mlx-stream serve`` under load and faults: fair, bounded work (long prompts are
prefilled a chunk per round and stop when their client leaves; prompt size and reply
length are capped), a memory budget the accounting never exceeds (snapshots evicted
like sessions), SIGTERM, and a state folder that survives restarts, lost files and a
full disk. In-process engines where no HTTP is needed; real servers otherwise."""

from __future__ import annotations

import json
import queue
import signal
import threading
import time

import pytest

from mlx_stream.serve.event_types import Delta, End, Failed, Started
from tests.support.engine import ask, make_engine, on_worker, refused

openai = pytest.importorskip("openai")


LONG = "the sea " * 3000  # 6,000 tokens: dozens of prefill chunks


# ------------------------------------------------------------- fair, bounded work


@pytest.mark.parametrize("batching", [True, False])
def test_a_long_prefill_lets_a_newcomer_finish_first(loaded, tmp_path, batching):
    """A short request that arrives while a 6,000-token prompt prefills is answered
    before the long one's first token (the prefill goes in a chunk per round)."""
    from mlx_stream.serve.engine import Request

    e = make_engine(loaded, tmp_path, batching=batching, settings={"max_tokens": 4})
    events: list[tuple[str, type]] = []
    lock = threading.Lock()

    def tagged(tag):
        def emit(event):
            with lock:
                events.append((tag, type(event)))

        return emit

    try:
        started = threading.Event()
        long = Request(emit=lambda ev: (tagged("long")(ev), started.set()), logprobs=0,
                       messages=[{"role": "user", "content": LONG}])  # fmt: skip
        e.submit(long)
        assert started.wait(60)
        e.submit(Request(emit=tagged("short"), messages=[{"role": "user", "content": "hi"}]))
        deadline = time.monotonic() + 120
        while not {("long", End), ("short", End)} <= set(events) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        e.stop()
    assert ("long", End) in events and ("short", End) in events, events
    # logprobs=0: every token of the long reply is an event, even one without text.
    assert events.index(("short", End)) < events.index(("long", Delta)), events


@pytest.mark.parametrize("batching", [True, False])
def test_a_cancelled_prefill_stops_between_chunks(loaded, tmp_path, monkeypatch, batching):
    from mlx_stream.serve.engine import Request

    model = loaded[0]
    e = make_engine(loaded, tmp_path, batching=batching, settings={"max_tokens": 4})
    fed: list[int] = []
    call = type(model).__call__

    def counting(self, inputs, *args, **kw):
        fed.append(int(inputs.size))
        return call(self, inputs, *args, **kw)

    monkeypatch.setattr(type(model), "__call__", counting)
    try:
        started = threading.Event()
        long = Request(emit=lambda ev: started.set(), messages=[{"role": "user", "content": LONG}])
        e.submit(long)
        assert started.wait(60)
        long.cancelled.set()  # the client went away while its prompt goes in
        text, usage, error = ask(e, [{"role": "user", "content": "hi"}])
        assert error is None
        assert on_worker(e, lambda: e.running) == 0
    finally:
        e.stop()
    assert sum(fed) < 3000, sum(fed)  # far from the 6,000 tokens of the whole prompt


def test_prompts_over_the_limit_are_413_and_max_tokens_is_the_clients_under_a_ceiling(
    loaded, tmp_path, monkeypatch
):
    model = loaded[0]
    e = make_engine(
        loaded, tmp_path, max_prompt_tokens=100, settings={"max_tokens": 5}, max_tokens_ceiling=9
    )
    fed: list[int] = []
    call = type(model).__call__
    monkeypatch.setattr(
        type(model), "__call__", lambda self, x, *a, **k: (fed.append(1), call(self, x, *a, **k))[1]
    )
    try:
        _, _, error = ask(e, [{"role": "user", "content": "the sea " * 150}])
        assert error is not None and error[1] == 413, error
        message = error[2]
        assert "300" in message and "100" in message and "\n" not in message, message
        assert not fed  # refused before any prefill
        from mlx_stream.serve.engine import Request

        box: queue.Queue = queue.Queue()
        e.submit(Request(emit=box.put, prompt="the sea " * 60))
        while not isinstance(event := box.get(timeout=60), (End, Failed)):
            pass
        assert isinstance(event, Failed), event
        assert refused(event)[1] == 413 and "120" in refused(event)[2], event
        text, usage, error = ask(e, [{"role": "user", "content": "hello sea"}], max_tokens=500)
        assert error is None and usage["completion_tokens"] <= 9, usage  # the ceiling
        asked = []
        for max_tokens in (None, 7, 2):
            _, usage, error = ask(
                e, [{"role": "user", "content": "the sea"}], max_tokens=max_tokens
            )
            assert error is None, error
            asked.append(usage["completion_tokens"])
        assert asked[0] <= 5 and asked[1] <= 7 and asked[2] <= 2, asked  # default; its own
    finally:
        e.stop()


def test_drain_ends_running_requests_and_refuses_new_ones(loaded, tmp_path):
    """What SIGTERM does: a request that has sent tokens ends (``length``) with its
    reply kept, one still prefilling is refused, later ones get 503; then stop()
    saves the sessions where a restart finds them."""
    from mlx_stream.serve.engine import Request

    e = make_engine(loaded, tmp_path, {"max_tokens": 100000})
    streaming: queue.Queue = queue.Queue()
    prefilling: queue.Queue = queue.Queue()
    try:
        e.submit(Request(emit=streaming.put, messages=[{"role": "user", "content": "hi"}],
                         session_id="streamed"))  # fmt: skip
        while not isinstance(streaming.get(timeout=60), Delta):
            pass
        e.submit(Request(emit=prefilling.put, messages=[{"role": "user", "content": LONG}]))
        assert isinstance(prefilling.get(timeout=60), Started)
        e.drain()
        while isinstance(event := streaming.get(timeout=60), Delta):
            pass
        assert isinstance(event, End) and event.finish_reason == "length", event
        assert refused(prefilling.get(timeout=60))[:2] == ("error", 503)
        _, _, error = ask(e, [{"role": "user", "content": "hi"}])
        assert error[:2] == ("error", 503)
    finally:
        e.stop()
    index = json.loads((tmp_path / "index.json").read_text())
    saved = {r["id"]: r for r in index["sessions"]}
    assert len(saved["streamed"]["messages"]) == 2  # the turn, cut short, is kept


# ----------------------------------------------------------------------- budget


SYSTEMS = [f"you are a {w}" for w in "captain whale sailor man ship sea day night".split()]


@pytest.mark.parametrize("room", [2.5, 1.2])
def test_chats_with_different_system_prompts_all_fit_in_turn(loaded, tmp_path, room):
    """room x (a session + its snapshot) over the weights: snapshots are evicted like
    sessions, and with no room for a shared snapshot a session prefills its own; the
    accounting never exceeds the budget."""
    e = make_engine(loaded, tmp_path)
    try:
        sinks = on_worker(e, lambda: e.sinks_for(SYSTEMS[0]))
        per = on_worker(e, lambda: e.session_bytes(sinks))
        e.budget = e.weights + int(room * (per + per // 2))
        used = []
        original = e.scheduler.refresh  # what the worker calls for the stats

        def refresh():
            original()
            used.append(e.stats["memory"]["used_bytes"])

        e.scheduler.refresh = refresh
        for system in SYSTEMS:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
            text, usage, error = ask(e, messages, max_tokens=3)
            assert error is None, (system, error)
        assert max(used) <= e.budget, (max(used), e.budget)
    finally:
        e.stop()


def test_a_fork_whose_source_is_evicted_to_make_room_still_restores(loaded, tmp_path):
    """Room for two sessions: regenerating an older conversation's last turn without
    an id forks it; making room for the fork evicts that very conversation (the least
    recently used), whose checkpoint the fork restores."""
    settings = {"window": 256, "max_tokens": 6}
    e = make_engine(loaded, tmp_path, settings, keep_system=False, max_sessions=2)
    fresh = make_engine(loaded, tmp_path / "fresh", settings, keep_system=False)
    try:
        a = [{"role": "user", "content": "hello the sea"}]
        text, _, _ = ask(e, a)
        a += [{"role": "assistant", "content": text}, {"role": "user", "content": "ship"}]
        text, _, _ = ask(e, a)
        ask(e, [{"role": "user", "content": "the whale"}])  # now the other one is older
        regenerated, usage, error = ask(e, a)  # the last turn again: a fork
        assert error is None, error
        want, _, _ = ask(fresh, a)
        assert regenerated == want
    finally:
        e.stop()
        fresh.stop()


# -------------------------------------------------------------- the state folder


def test_a_lost_or_corrupt_session_file_is_rebuilt_from_the_history(loaded, tmp_path):
    """Not a 400 on every later request: the client's history rebuilds the session,
    as it rebuilds one the server never saw (the reference: no id, no match)."""
    import shutil

    settings = {"window": 256, "max_tokens": 8}
    state = tmp_path / "state"
    state.mkdir()
    e = make_engine(loaded, state, settings, keep_system=False)
    fresh = make_engine(loaded, tmp_path / "fresh", settings, keep_system=False)
    try:
        for how in ("lost", "corrupt", "folder"):
            sid = f"s-{how}"
            messages = [{"role": "user", "content": f"hello the sea {how}"}]
            text, _, error = ask(e, messages, session_id=sid)
            assert error is None
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "ship"},
            ]
            path = on_worker(e, lambda sid=sid: e.evict(e.entries[("", sid)]))
            cache = path.with_name(path.name + ".safetensors")
            if how == "lost":
                cache.unlink()
            elif how == "corrupt":
                cache.write_bytes(cache.read_bytes()[:-40] + b"\0" * 40)
            else:  # the whole state folder is gone
                shutil.rmtree(state)
            again, usage, error = ask(e, messages, session_id=sid)
            assert error is None, error
            want, _, error = ask(fresh, messages)
            assert error is None and again == want
    finally:
        e.stop()
        fresh.stop()


def test_a_restart_checks_the_index_and_removes_what_it_does_not_name(loaded, tmp_path):
    """Sessions saved by a run that never stopped (kill -9) are found by the index;
    a file whose size changed is dropped at start with its entry, one corrupted in
    place is caught by its checksum on its next request and rebuilt."""
    settings = {"window": 256, "max_tokens": 6}
    a = make_engine(loaded, tmp_path, settings, keep_system=False)
    talks = {}
    for sid in ("kept", "truncated", "flipped"):
        messages = [{"role": "user", "content": f"hello the {sid} sea"}]
        text, _, _ = ask(a, messages, session_id=sid)
        talks[sid] = messages + [{"role": "assistant", "content": text}]
        on_worker(a, lambda sid=sid: a.evict(a.entries[("", sid)]))
    name = {sid: a.store.path("", sid).name + ".safetensors" for sid in talks}
    # no a.stop(): as after a kill -9
    (tmp_path / name["truncated"]).write_bytes((tmp_path / name["truncated"]).read_bytes()[:-8])
    data = bytearray((tmp_path / name["flipped"]).read_bytes())
    data[-5] ^= 0xFF
    (tmp_path / name["flipped"]).write_bytes(bytes(data))
    b = make_engine(loaded, tmp_path, settings, keep_system=False)
    try:
        assert set(b.entries) == {("", "kept"), ("", "flipped")}
        assert not list(tmp_path.glob(a.store.path("", "truncated").name + "*"))
        for sid in ("kept", "flipped"):
            messages = talks[sid] + [{"role": "user", "content": "ship"}]
            _, usage, error = ask(b, messages, session_id=sid)
            assert error is None, error
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert (cached > 0) == (sid == "kept"), (sid, usage)
        assert b.restores == 1
    finally:
        b.stop()
        a.stop()


def test_a_restart_with_another_cache_shape_drops_the_saved_sessions(loaded, tmp_path):
    a = make_engine(loaded, tmp_path, {"window": 64})
    ask(a, [{"role": "user", "content": "hello"}], session_id="s")
    a.stop()  # saved
    assert list(tmp_path.glob("session-*.safetensors"))
    b = make_engine(loaded, tmp_path, {"window": 128})
    try:
        assert not b.entries and not list(tmp_path.glob("session-*"))
    finally:
        b.stop()


def test_a_missing_state_folder_is_recreated(loaded, tmp_path):
    import shutil

    state = tmp_path / "state"
    state.mkdir()
    e = make_engine(loaded, state, keep_system=False)
    try:
        text, _, _ = ask(e, [{"role": "user", "content": "hello"}], session_id="a")
        shutil.rmtree(state)
        path = on_worker(e, lambda: e.evict(e.entries[("", "a")]))
        assert path.with_name(path.name + ".safetensors").is_file()
    finally:
        e.stop()


@pytest.mark.parametrize(
    "fault",
    [RuntimeError("[write] Unable to write 26923 bytes"), OSError(28, "No space left on device")],
)
def test_a_full_disk_is_507_naming_the_folder_and_the_resident_session_stays(
    loaded, tmp_path, monkeypatch, fault
):
    import mlx.core as mx

    e = make_engine(loaded, tmp_path, keep_system=False)
    try:
        per = on_worker(e, lambda: e.session_bytes(e.settings.cache.sinks))
        e.budget = e.weights + per + per // 2  # room for one session
        first = [{"role": "user", "content": "hello the sea"}]
        text, _, error = ask(e, first, session_id="kept")
        assert error is None

        def full(*args, **kw):
            raise fault

        monkeypatch.setattr(mx, "save_safetensors", full)
        _, _, error = ask(e, [{"role": "user", "content": "ship"}], session_id="newcomer")
        assert error is not None and error[1] == 507, error
        assert str(tmp_path) in error[2] and "full or unwritable" in error[2], error
        assert "\n" not in error[2]
        assert on_worker(e, lambda: e.entries[("", "kept")].session is not None)
        follow = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "a"}]
        _, usage, error = ask(e, follow, session_id="kept")
        assert error is None and usage["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        e.stop()


# ------------------------------------------------------- a real server: SIGTERM, restart


def test_sigterm_ends_streams_saves_sessions_and_a_restart_continues_them(tiny_model_dir, tmp_path):
    from tests.support.server import Server, chat, http

    state = tmp_path / "state"
    state.mkdir()
    args = ("--sinks", "2", "--window", "64", "--state-dir", str(state))
    system = {"role": "system", "content": "you are a captain"}
    turn1 = [system, {"role": "user", "content": "hello the sea"}]
    s = Server(tiny_model_dir, *args, "--max-tokens", "100000", "--max-prompt-tokens", "50")
    try:
        too_big = {"messages": [{"role": "user", "content": "the sea " * 40}]}
        r = http("POST", s.url + "/v1/chat/completions", json.dumps(too_big).encode())
        assert r.status_code == 413 and "80" in r.json()["error"]["message"], r.text
        first = chat(s, turn1, max_tokens=12, extra_headers={"X-Session-ID": "kept"})
        twin = chat(s, turn1, max_tokens=12, extra_headers={"X-Session-ID": "twin"})
        assert twin.choices[0].message.content == first.choices[0].message.content
        turn2 = turn1 + [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "the ship"},
        ]
        want = chat(s, turn2, max_tokens=12, extra_headers={"X-Session-ID": "twin"})
        stream = chat(s, [{"role": "user", "content": "the whale"}], stream=True,
                      extra_headers={"X-Session-ID": "streamed"})  # fmt: skip
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        tic = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)  # the stream gets its end
        assert rest and rest[-1].choices[0].finish_reason is not None
        code = s.proc.wait(timeout=10)
        assert code == 0 and time.monotonic() - tic < 10
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
    index = json.loads((state / "index.json").read_text())
    assert {"kept", "twin", "streamed"} <= {e["id"] for e in index["sessions"]}
    (state / "session-0123abcd.safetensors").write_bytes(b"left over")  # no index entry
    (state / "notes.txt").write_text("not ours")
    s = Server(tiny_model_dir, *args, "--max-tokens", "100")
    try:
        again = chat(s, turn2, max_tokens=12, extra_headers={"X-Session-ID": "kept"})
        assert again.choices[0].message.content == want.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.total_tokens - 1
    finally:
        s.stop()
    assert not (state / "session-0123abcd.safetensors").exists()
    assert (state / "notes.txt").exists()


def test_a_client_that_leaves_a_plain_request_stops_it(tiny_model_dir):
    """Not streamed: the server notices the closed connection, the request stops
    (between prefill chunks) and its session rolls back."""
    import socket

    from tests.support.server import Server

    s = Server(tiny_model_dir, "--sinks", "2", "--window", "64", "--max-tokens", "100000")
    try:
        long = "the sea " * 8000  # 16,000 tokens: 250 prefill chunks
        body = json.dumps({"messages": [{"role": "user", "content": long}]}).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Session-ID: gone\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(head.encode() + body)
            deadline = time.monotonic() + 30
            while "gone" not in s.sessions() and time.monotonic() < deadline:
                time.sleep(0.02)
        deadline = time.monotonic() + 10
        while s.sessions()["gone"]["busy"] and time.monotonic() < deadline:
            time.sleep(0.1)
        info = s.sessions()["gone"]
        assert not info["busy"] and info["turns"] == 0, info
    finally:
        s.stop()


def test_bad_max_prompt_tokens_is_one_line_exit_2(tiny_model_dir):
    from typer.testing import CliRunner

    from cli.main import app
    from tests.support.cli import assert_one_line_error

    result = CliRunner().invoke(
        app, ["serve", "-m", str(tiny_model_dir), "--max-prompt-tokens", "0"]
    )
    assert_one_line_error(result, 2, "--max-prompt-tokens")
