"""Prometheus metrics of one sidecar (served on the HTTP front's /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .events import BreakerChanged, PoolEvent

if TYPE_CHECKING:
    from .config import SidecarConfig

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

OTHER = "other"
"""The label value of every class or pool name that is not one of the policy's."""

UNCONFIGURED_CAP = 16
"""Without the policy's names (SidecarMetrics built from names alone: tools, tests), a label keeps
its first this-many distinct values and counts the rest as `other`."""


class LabelBound:
    """The values a class or pool label may take: the policy's `names` (and "", no name sent);
    anything else is `other`. Every distinct label value is a new series: a value a caller chose
    would let any client grow the sidecar's exposition without bound."""

    def __init__(self, names: Iterable[str] | None = None):
        self.names: set[str] | None = None if names is None else set(names)
        self._seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        if not value:
            return ""
        if self.names is not None:
            return value if value in self.names else OTHER
        if value in self._seen:
            return value
        if len(self._seen) >= UNCONFIGURED_CAP or len(value) > 64:
            return OTHER
        self._seen.add(value)
        return value


class _Bounded:
    """A labelled metric whose `labels()` passes the bounded labels' values through their bound
    first: call sites label with whatever name they hold, and only bounded values reach the registry."""

    def __init__(self, metric, bounds: dict[str, Callable[[str | None], str]]):
        self._metric, self._bounds = metric, bounds
        self._names = tuple(metric._labelnames)

    def labels(self, *values: Any, **named: Any):
        if values:
            values = tuple(self._bounds[n](v) if n in self._bounds else v for n, v in zip(self._names, values))
        named = {n: self._bounds[n](v) if n in self._bounds else v for n, v in named.items()}
        return self._metric.labels(*values, **named)

    def __getattr__(self, name: str):
        return getattr(self._metric, name)


class SidecarMetrics:
    """Every metric of one sidecar, on a registry of its own (a test can build as many as it likes).

    Class and pool labels are bounded to `classes` and `pools` (LabelBound): SidecarMetrics.of(config)
    gives the config's classes and the mesh's pools."""

    @classmethod
    def of(cls, config: "SidecarConfig") -> "SidecarMetrics":
        return cls(config.pool, config.instance, classes=config.classes, pools=[config.pool, *config.mesh_pools])

    def __init__(self, pool: str, instance: str, classes: Iterable[str] | None = None, pools: Iterable[str] | None = None):
        self.registry = CollectorRegistry()
        self.bound_class = LabelBound(classes)
        self.bound_pool = LabelBound(pools)
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
        self.itl = Histogram(
            "infermesh_sidecar_inter_token_latency_seconds",
            "Time between streamed tokens (per token, when a message carries several).",
            ["front", "request_class"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
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
        self.shed = Counter(
            "infermesh_sidecar_shed_requests_total",
            "Requests refused by the pool's protection (breaker actions or the concurrency limit).",
            ["request_class", "reason"],
            registry=self.registry,
        )
        self.spilled_in = Counter(
            "infermesh_sidecar_spilled_in_requests_total",
            "Requests the mesh bound for another pool (x-infermesh-pool) that reached this one: "
            "Envoy's failover while that pool was degraded (health check) or down.",
            ["bound_for"],
            registry=self.registry,
        )
        self.breaker_state = Gauge(
            "infermesh_breaker_state",
            "Breaker state: 0 closed, 1 half-open, 2 open.",
            ["breaker", "signal"],
            registry=self.registry,
        )
        self.breaker_actions = Gauge(
            "infermesh_breaker_actions", "How many of a breaker's actions are applied.", ["breaker"], registry=self.registry
        )
        self.breaker_transitions = Counter(
            "infermesh_breaker_transitions_total", "Breaker state changes.", ["breaker", "to"], registry=self.registry
        )
        self.breaker_time = Counter(
            "infermesh_breaker_time_in_state_seconds_total", "Time spent in each state.", ["breaker", "state"], registry=self.registry
        )
        self.signal = Gauge("infermesh_breaker_signal", "Latest reading of a breaker signal.", ["signal"], registry=self.registry)
        self.degradation_level = Gauge(
            "infermesh_pool_degradation_level",
            "0 normal, 1 shedding, 2 serving a fallback model, 3 critical classes only.",
            registry=self.registry,
        )
        self.degraded = Gauge(
            "infermesh_pool_degraded", "1 while new requests are served by a fallback model.", registry=self.registry
        )
        self.kv_cache = Gauge(
            "infermesh_kv_cache_usage_ratio", "vLLM KV-cache use (0-1), by model.", ["model"], registry=self.registry
        )
        self.engine_requests = Gauge(
            "infermesh_engine_requests", "Requests in the vLLM scheduler, by model and state.", ["model", "state"], registry=self.registry
        )
        self.info = Gauge("infermesh_sidecar_info", "Static identity of this sidecar.", list(labels), registry=self.registry)
        self.info.labels(**labels).set(1)
        by_class = {"request_class": self.bound_class}
        self.requests, self.ttft, self.itl, self.shed = (_Bounded(m, by_class) for m in (self.requests, self.ttft, self.itl, self.shed))
        self.spilled_in = _Bounded(self.spilled_in, {"bound_for": self.bound_pool})

    def count_rejection(self, front: str, api: str, request_class: str, status: str, e) -> None:
        """A request refused before generation: bad input, or admission (shed ones also by reason)."""
        self.requests.labels(front, api, request_class, status).inc()
        if e.code in ("pool_shedding", "pool_critical_only") or (e.http_status == 429):
            self.shed.labels(request_class, e.code or "concurrency_limit").inc()

    def count_transition(self, event: PoolEvent) -> None:
        """An event-bus subscriber: counts breaker state changes (not action steps, not drains)."""
        if isinstance(event, BreakerChanged) and event.from_state != event.to_state:
            self.breaker_transitions.labels(event.breaker, event.to_state).inc()

    def observe_pool(self, engine, values: dict, interval_s: float) -> None:
        """Called by the pool's monitor loop after each sample."""
        codes = {"closed": 0, "half_open": 1, "open": 2}
        for b in engine.breakers:
            self.breaker_state.labels(b.name, b.config.signal).set(codes[b.state.value])
            self.breaker_actions.labels(b.name).set(len(b.actions))
            self.breaker_time.labels(b.name, b.state.value).inc(interval_s)
        for sig, v in values.items():
            if v is not None:
                self.signal.labels(sig).set(v)
        self.degradation_level.set(engine.policy.level)
        self.degraded.set(1 if engine.serving_model() is not engine.primary else 0)
        for m in engine.ladder:
            if m.engine is not None and m.stats.kv_cache_usage is not None:
                self.kv_cache.labels(m.config.name).set(m.stats.kv_cache_usage)
                self.engine_requests.labels(m.config.name, "running").set(m.stats.running)
                self.engine_requests.labels(m.config.name, "waiting").set(m.stats.waiting)


# -- vLLM's own series (`vllm:*`) ------------------------------------------------------------------

def vllm_collectors() -> set:
    """The collectors of vLLM's series in prometheus_client's process registry, where vLLM's
    PrometheusStatLogger puts them (as in `vllm serve`)."""
    from prometheus_client import REGISTRY

    return {c for c, names in list(REGISTRY._collector_to_names.items()) if any(n.startswith("vllm:") for n in names)}


class _Merged:
    """Families of several collectors as one set, samples of same-named families joined: each
    engine of the ladder has its own vLLM logger (labelled by model_name), and every engine after
    the first unregisters the earlier ones' from the process registry when it starts."""

    def __init__(self, collectors: list):
        self.collectors = collectors

    def collect(self):
        families: dict = {}
        for c in self.collectors:
            for fam in c.collect():
                have = families.get(fam.name)
                if have is None:
                    families[fam.name] = fam
                else:
                    have.samples.extend(fam.samples)
        return list(families.values())


def process_metrics(engine_collectors: list[set]) -> bytes:
    """The process registry's exposition (vLLM's `vllm:*` series of every loaded engine, and
    prometheus_client's process and GC series), as vLLM's server serves it on /metrics."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    vllm_now = vllm_collectors()
    ours = [c for group in engine_collectors for c in group]
    others = [c for c in list(REGISTRY._collector_to_names) if c not in vllm_now and c not in ours]
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Merged(others + ours))
    return generate_latest(reg)
