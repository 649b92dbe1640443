"""Prometheus metrics of one sidecar (served on the HTTP front's /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SidecarMetrics:
    def __init__(self, pool: str, instance: str):
        self.registry = CollectorRegistry()
        labels = {"pool": pool, "instance_id": instance}
        self.requests = Counter(
            "infermesh_sidecar_requests_total",
            "Requests finished, by front, API, class and outcome.",
            ["front", "api", "request_class", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "infermesh_sidecar_time_to_first_token_seconds",
            "Time from admission to the first generated token.",
            ["front", "request_class"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "infermesh_sidecar_prompt_tokens_total", "Prompt tokens processed.", ["model"], registry=self.registry
        )
        self.completion_tokens = Counter(
            "infermesh_sidecar_completion_tokens_total", "Tokens generated.", ["model"], registry=self.registry
        )
        self.inflight = Gauge("infermesh_sidecar_requests_in_flight", "Requests being served.", registry=self.registry)
        self.model_load = Gauge(
            "infermesh_sidecar_model_load_seconds", "Time the engine took to load a model.", ["model"], registry=self.registry
        )
        self.info = Gauge("infermesh_sidecar_info", "Static identity of this sidecar.", list(labels), registry=self.registry)
        self.info.labels(**labels).set(1)
