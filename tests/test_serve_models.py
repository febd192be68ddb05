"""Several models behind one ``serve``: the request's ``model`` picks one, loaded on first
use; the OpenAI, Anthropic and ollama clients reach each; under a small memory budget a
third model unloads the least recently used idle one, whose sessions go to its state
folder and come back when it is asked again (the conversation resumes from its cache);
a model that cannot be loaded is one error and the others serve on; two models answering
at once give the greedy answers each gives alone (one computes at a time)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlx_stream.errors import UserError
from mlx_stream.serve.models import Turns, parse_keep_alive
from tests import tiny
from tests.support.server import Server, http

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

# alpha's and beta's weights with a session each fit; a third model's do not
BUDGET = "1100000"
FLAGS = ("--sinks", "2", "--window", "32", "--max-tokens", "6", "--memory-budget", BUDGET,
         "--keep-alive", "30m")  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    return {
        "alpha": tiny.save_model_folder(root / "alpha", "llama"),
        "beta": tiny.save_model_folder(root / "beta", "qwen2", seed=1),
        "gamma": tiny.save_model_folder(root / "gamma", "llama", seed=2),
        "broken": broken,
        "state": tmp_path_factory.mktemp("state"),
    }


@pytest.fixture(scope="module")
def server(folders):
    extra = [a for n in ("beta", "gamma", "broken") for a in ("--add-model", str(folders[n]))]
    s = Server(folders["alpha"], *FLAGS, *extra, "--state-dir", str(folders["state"]))
    s.claude = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    s.ollama = ollama.Client(host=s.url)
    yield s
    s.stop()


def ask(s, model: str, messages: list[dict], **kw):
    return s.client.chat.completions.create(model=model, messages=messages, max_tokens=4, **kw)


def loaded(s) -> list[str]:
    return [m["name"] for m in s.get("/api/ps")["models"]]


def test_keep_alive_reads_ollamas_durations():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive(0) == 0 and parse_keep_alive("30s") == 30
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None
    with pytest.raises(UserError, match="keep_alive"):
        parse_keep_alive("soon")


def test_turns_are_granted_in_the_order_asked():
    turns, order, threads = Turns(), [], []
    with turns:  # held: the two threads queue behind it, in the order they asked
        for i in (0, 1):
            threads.append(threading.Thread(target=_take, args=(turns, order, i)))
            threads[-1].start()
            while turns._next < i + 2:  # noqa: SLF001 - asked before the next starts
                threading.Event().wait(0.01)
    for t in threads:
        t.join()
    assert order == [0, 1]


def _take(turns, order, i):
    with turns:
        order.append(i)


def test_the_listing_names_every_model_and_marks_the_loaded(server):
    listed = {m["id"]: m["loaded"] for m in server.get("/v1/models")["data"]}
    assert list(listed)[0] == "alpha"  # the first (-m) model first
    assert set(listed) == {"alpha", "beta", "gamma", "broken"} and listed["alpha"]
    tags = [m["name"] for m in server.get("/api/tags")["models"]]
    assert set(tags) == set(listed)


def test_three_clients_reach_two_models(server):
    for model in ("alpha", "beta"):
        reply = ask(server, model, [{"role": "user", "content": "the sea"}])
        assert reply.model == model and reply.usage.completion_tokens > 0
        message = server.claude.messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "the ship"}]
        )
        assert message.model == model and message.usage.output_tokens > 0
        chat = server.ollama.chat(
            model=model, messages=[{"role": "user", "content": "the wind"}],
            options={"temperature": 0, "num_predict": 4},
        )  # fmt: skip
        assert chat.eval_count > 0
    assert {"alpha", "beta"} <= set(loaded(server))
    scrape = http("GET", server.url + "/metrics").text
    assert 'mlx_stream_model_loaded{model="beta"} 1.0' in scrape
    assert "mlx_stream_models_loaded 2.0" in scrape


def test_two_models_at_once_answer_as_each_does_alone(server):
    prompts = {m: [{"role": "user", "content": f"{m} sails at dawn"}] for m in ("alpha", "beta")}
    for m in prompts:
        ask(server, m, [{"role": "user", "content": "warm up"}])  # both loaded first
    alone = {m: ask(server, m, p).choices[0].message.content for m, p in prompts.items()}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(2):  # both models decode at once, twice
            futures = {m: pool.submit(ask, server, m, p) for m, p in prompts.items()}
            together = {m: f.result().choices[0].message.content for m, f in futures.items()}
            assert together == alone


def test_a_third_model_unloads_the_least_recently_used_and_its_sessions_come_back(server, folders):
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a harbour"}]
    reply = ask(server, "alpha", first)
    ask(server, "beta", [{"role": "user", "content": "a gull"}])  # alpha is now the oldest
    ask(server, "gamma", [{"role": "user", "content": "a lighthouse"}])
    assert "alpha" not in loaded(server) and "gamma" in loaded(server)
    index = json.loads((folders["state"] / "index.json").read_text())  # alpha's folder
    assert index["sessions"], "alpha's sessions were saved when it was unloaded"
    history = [*first, {"role": "assistant", "content": reply.choices[0].message.content}]
    again = ask(server, "alpha", [*history, {"role": "user", "content": "and a quay"}])
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # resumed, not rebuilt
    assert "alpha" in loaded(server)
    assert (folders["state"] / "gamma").is_dir()  # each other model its own folder


def test_unknown_and_broken_models_are_one_error_and_the_others_serve_on(server):
    body = {"model": "nowhere", "messages": [{"role": "user", "content": "hi"}]}
    missing = http("POST", server.url + "/v1/chat/completions", json.dumps(body).encode())
    assert missing.status_code == 404 and "nowhere" in missing.json()["error"]["message"]
    body["model"] = "broken"
    failed = http("POST", server.url + "/v1/chat/completions", json.dumps(body).encode())
    message = failed.json()["error"]["message"]
    assert failed.status_code == 500 and "broken" in message and "\n" not in message
    codex = {"model": "nowhere", "input": "hi"}
    refused = http("POST", server.url + "/v1/responses", json.dumps(codex).encode())
    assert (refused.status_code, refused.json()["error"]["type"]) == (404, "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        server.claude.messages.create(model="nowhere", max_tokens=4, messages=body["messages"])
    with pytest.raises(ollama.ResponseError) as raised:
        server.ollama.chat(model="broken", messages=body["messages"])
    assert raised.value.status_code == 500
    assert ask(server, "beta", body["messages"]).usage.completion_tokens > 0


def test_keep_alive_unloads_a_model_after_its_request(server):
    server.ollama.generate(model="gamma", prompt="")  # ollama's load
    until = {m["name"]: m["expires_at"] for m in server.get("/api/ps")["models"]}
    assert not until["gamma"].startswith("2999")  # --keep-alive 30m, not forever
    done = server.ollama.generate(model="gamma", prompt="", keep_alive=0)
    assert done.done_reason == "unload" and "gamma" not in loaded(server)
    reply = server.ollama.chat(
        model="beta", messages=[{"role": "user", "content": "hi"}], keep_alive=0,
        options={"num_predict": 2},
    )  # fmt: skip
    assert reply.done
    for _ in range(50):  # the keep-alive check runs once a second
        if "beta" not in loaded(server):
            break
        threading.Event().wait(0.1)
    assert "beta" not in loaded(server)
