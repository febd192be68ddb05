"""``GET /metrics`` of ``serve``: Prometheus' text format (parsed by prometheus-client's
own parser), counting requests by route and status, tokens by kind and time to first
token; gauges from the engine; behind the API key when one is set."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import Server, http


def scrape(server, key: str | None = None) -> dict[str, list]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(server.url + "/metrics", headers=headers)
    with urllib.request.urlopen(request) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples, name: str, **labels) -> float:
    def wanted(s) -> bool:
        return s.name == name and all(s.labels.get(k) == v for k, v in labels.items())

    return sum(s.value for s in samples if wanted(s))


def test_requests_tokens_and_latency_are_counted(tiny_model_dir):
    s = Server(tiny_model_dir, "--sinks", "2", "--window", "64", "--max-tokens", "6")
    try:
        body = {"model": "default", "messages": [{"role": "user", "content": "hello"}]}
        chat = s.url + "/v1/chat/completions"
        for _ in range(2):
            assert http("POST", chat, json.dumps(body).encode()).status_code == 200
        assert http("POST", chat, b"{}").status_code == 400
        http("GET", s.url + "/no/such/path")
        m = scrape(s)
        requests, total = m["mlx_stream_requests"], "mlx_stream_requests_total"
        route = "/v1/chat/completions"
        assert value(requests, total, route=route, status="200") == 2
        assert value(requests, total, route=route, status="400") == 1
        assert value(requests, total, route="other", status="404") == 1
        tokens = m["mlx_stream_tokens"]
        assert value(tokens, "mlx_stream_tokens_total", kind="generated") >= 2
        assert value(tokens, "mlx_stream_tokens_total", kind="prompt") > 0
        ttft = m["mlx_stream_time_to_first_token_seconds"]
        assert value(ttft, "mlx_stream_time_to_first_token_seconds_count") == 2
        assert value(m["mlx_stream_sessions_resident"], "mlx_stream_sessions_resident") >= 1
        assert value(m["mlx_stream_weights_bytes"], "mlx_stream_weights_bytes") > 0
    finally:
        s.stop()


def test_metrics_are_behind_the_api_key(tiny_model_dir):
    s = Server(tiny_model_dir, "--sinks", "2", "--window", "64", "--api-key", "sesame")
    try:
        assert http("GET", s.url + "/metrics").status_code == 401
        assert "mlx_stream_models_loaded" in scrape(s, key="sesame")
    finally:
        s.stop()


def test_quiet_still_counts(tiny_model_dir):
    s = Server(tiny_model_dir, "--sinks", "2", "--window", "64", "--quiet")
    try:

        def health() -> float:
            return value(scrape(s)["mlx_stream_requests"], "mlx_stream_requests_total",
                         route="/health")  # fmt: skip

        before = health()
        http("GET", s.url + "/health")
        assert health() == before + 1
        assert "POST" not in s.log() and "GET /health" not in s.log()  # no lines written
    finally:
        s.stop()
