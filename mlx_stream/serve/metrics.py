"""``GET /metrics`` of ``serve``: Prometheus' text format, written by prometheus-client.

Contract: every HTTP request is counted by route and status once its response ended
(a path that is no route counts as ``other``: labels stay bounded); an engine request
adds its tokens by kind (``prompt``: fed this turn, ``cached``: its session's cache
held them, ``repaired``: computed again after an edit, ``generated``) and observes its
time to first token and time per output token. Gauges are read from the engine's
published stats at each scrape: sessions resident and on disk, bytes per session,
memory used and budgeted, weights, MLX's active memory, the prefix store's hits and
misses, models loaded (summed over the loaded models; ``model_loaded`` and
``model_memory_used_bytes`` per model, labelled). Each app has its own registry (no process-wide state). Behind
the API key when one is set (it is not ``/health``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)


class Metrics:
    """The metrics of one app serving ``models`` (a
    :class:`~mlx_stream.serve.models.Models`); :meth:`observe` takes each finished
    request's access record (:class:`~mlx_stream.serve.accesslog.Record`)."""

    def __init__(self, models: Any):
        self.registry = CollectorRegistry()
        self.routes: set[str] = set()  # the app's paths (set once its routes exist)
        kw = {"registry": self.registry, "namespace": "mlx_stream"}
        self.requests = Counter("requests", "HTTP requests by route and status",
                                ["route", "status"], **kw)  # fmt: skip
        self.tokens = Counter("tokens", "Tokens of engine requests by kind", ["kind"], **kw)
        self.ttft = Histogram("time_to_first_token_seconds", "Time to the first token",
                              buckets=TTFT_BUCKETS, **kw)  # fmt: skip
        self.tpot = Histogram("time_per_output_token_seconds", "Time per token after the first",
                              buckets=TPOT_BUCKETS, **kw)  # fmt: skip
        self.registry.register(_Engines(models))

    def observe(self, record: Any, now: float) -> None:
        route = record.path if record.path in self.routes else "other"
        self.requests.labels(route, str(record.status or 0)).inc()
        usage = record.usage
        if usage is not None:
            prompt = int(usage.get("prompt_tokens", 0))
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            generated = int(usage.get("completion_tokens", 0))
            self.tokens.labels("prompt").inc(max(0, prompt - cached))
            self.tokens.labels("cached").inc(cached)
            self.tokens.labels("repaired").inc(int(usage.get("repaired_tokens", 0)))
            self.tokens.labels("generated").inc(generated)
            if record.first is not None and generated > 1:
                self.tpot.observe((now - record.first) / (generated - 1))
        if record.first is not None:
            self.ttft.observe(record.first - record.started)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Engines:
    """Gauges read from the loaded engines' stats at each scrape."""

    def __init__(self, models: Any):
        self.models = models

    def collect(self):
        listing = self.models.listing()
        loaded = [m for m in listing if m["loaded"]]
        stats = [m["engine"].stats for m in loaded]
        sessions = [s for st in stats for s in st.get("sessions") or []]
        resident = sum(1 for s in sessions if s.get("resident"))
        memories = [st.get("memory") or {} for st in stats]

        def total(key: str) -> int:
            return sum(int(m.get(key) or 0) for m in memories)

        memory = {k: total(k) for k in ("used_bytes", "budget_bytes", "weights_bytes")}
        if self.models.budget is not None:
            memory["budget_bytes"] = self.models.budget
        memory["session_bytes"] = memories[0].get("session_bytes") if memories else 0
        memory["mlx_active_bytes"] = max((m.get("mlx_active_bytes") or 0 for m in memories),
                                         default=0)  # fmt: skip

        def gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
            return GaugeMetricFamily("mlx_stream_" + name, doc, value=float(value or 0))

        yield gauge("models_loaded", "Models loaded", len(loaded))
        per = GaugeMetricFamily("mlx_stream_model_loaded", "Whether a model is loaded",
                                labels=["model"])  # fmt: skip
        used = GaugeMetricFamily("mlx_stream_model_memory_used_bytes",
                                 "A loaded model's weights and sessions", labels=["model"])  # fmt: skip
        for m in listing:
            per.add_metric([m["id"]], float(m["loaded"]))
            if m["loaded"]:
                mem = m["engine"].stats.get("memory") or {}
                used.add_metric([m["id"]], float(mem.get("used_bytes") or 0))
        yield per
        yield used
        yield gauge("sessions_resident", "Sessions in memory", resident)
        yield gauge(
            "sessions_on_disk", "Sessions saved to the state folder", len(sessions) - resident
        )
        yield gauge(
            "session_bytes", "Bytes one resident session costs", memory.get("session_bytes")
        )
        yield gauge(
            "memory_used_bytes",
            "Weights, snapshots and resident sessions",
            memory.get("used_bytes"),
        )
        yield gauge("memory_budget_bytes", "The memory budget", memory.get("budget_bytes"))
        yield gauge("weights_bytes", "Bytes of the weights", memory.get("weights_bytes"))
        yield gauge("mlx_active_bytes", "MLX's active memory", memory.get("mlx_active_bytes"))
        stores = [st.get("prefix_store") or {} for st in stats]
        family = CounterMetricFamily(
            "mlx_stream_prefix_store", "Prefix-store lookups", labels=["result"]
        )
        for result in ("hits", "misses"):
            family.add_metric([result], float(sum(s.get(result, 0) for s in stores)))
        yield family
