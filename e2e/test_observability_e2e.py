"""e2e: what an operator sees, checked against a real Prometheus (Debian's, scripts/setup.sh).

The real local mesh (Envoy + compiled filter + control plane + vLLM sidecars) serves mixed traffic
through the real `openai` SDK, streamed chats and batch completions, while three breakers trip
through the sidecars' fault endpoint: the interactive pool's KV cache (its chats go to the fallback
model), the batch pool's CPU (the batch sidecar sheds batch work), then the interactive pool's
error rate (critical-only: chats spill to the batch pool and the filter sheds batch at the edge).
A Prometheus of the mesh's own (infermesh/observe.py, as `infermesh up --observe` runs it) scrapes
Envoy's /stats/prometheus, the control plane and every sidecar's /metrics every second. Then:

- every panel query of every dashboard the chart ships, and every alert expression of its
  PrometheusRule, is evaluated over the run through Prometheus' HTTP API and must return data
  (a value that is not NaN at some step): no panel silently empty. An alert that compares with a
  threshold (`x > 0.9`) is rightly empty while its pool is healthy, so its expression is evaluated
  without the comparison (the series it watches must exist), and the alerts of the trip
  (degraded, critical-only, breaker open) must fire in full during it;
- the trip is visible: the interactive pool's degradation level is 0 before it, 2 and then 3
  during it, and its breakers' state series reach open;
- Envoy's JSON access log has exactly one line per request, whose fields match what the client got
  (status, served-by, model, degraded, shed-by) and what the mesh decided (class, rule, pool); no
  internal header reaches the client.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from infermesh.chart_render import Helm, setup_outputs
from infermesh.launcher import wait_until
from infermesh.observe import NAMESPACE, panel_queries, without_threshold
from infermesh.paths import REPO_ROOT

pytestmark = pytest.mark.e2e

PIN = REPO_ROOT / "charts" / "tests" / "values" / "filter-pin.yaml"
RATE = "10s"  # $__rate_interval: ten scrapes at the 1 s interval
VARIABLES = {"namespace": NAMESPACE, "pool": ".*", "class": ".*"}
INTERNAL = ("x-infermesh-pool-level", "x-infermesh-load", "x-infermesh-class", "x-infermesh-rule", "x-infermesh-pool", "endpoint-load-metrics")
TRIP_ALERTS = {"InfermeshPoolDegraded", "InfermeshPoolCriticalOnly", "InfermeshBreakerOpen"}


@pytest.fixture(scope="module")
def chart():
    """The chart's dashboards and alert rules, as Helm renders them with monitoring on."""
    helm = Helm.from_tools(setup_outputs("setup-chart-tools.sh"))
    rendered = helm.template([PIN], sets=["metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true"])
    cm = next(o for o in rendered.of("ConfigMap") if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1")
    dashboards = [json.loads(text) for _, text in sorted(cm["data"].items())]
    alerts = [r for g in rendered.one("PrometheusRule")["spec"]["groups"] for r in g["rules"] if "alert" in r]
    return dashboards, alerts


class Traffic:
    """Streamed chats and batch completions through the mesh, each with a traceparent of its own,
    recording what the client got."""

    def __init__(self, mesh):
        self.client = openai.OpenAI(base_url=mesh.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)
        self.seen: list[dict] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def _record(self, kind: str, trace: str, status: int, headers) -> None:
        with self.lock:
            self.seen.append({"kind": kind, "traceparent": trace, "status": status, "headers": {k.lower(): v for k, v in headers.items()}})

    def chat(self) -> None:
        trace = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
        try:
            raw = self.client.chat.completions.with_raw_response.create(
                model="tiny-llama", messages=[{"role": "user", "content": "Name three colours."}], stream=True, max_tokens=12,
                stream_options={"include_usage": True}, extra_headers={"traceparent": trace})
            chunks = list(raw.parse())
            # Counted by the usage chunk, not by chunks: vLLM merges the deltas its consumer has not
            # taken yet (RequestOutputCollector), so on a busy machine the small model's 12 tokens
            # came in one chunk (suite order, 2026-12-05).
            text = "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
            usage = next((chunk.usage for chunk in reversed(chunks) if chunk.usage is not None), None)
            if usage is None or usage.completion_tokens < 2 or not text:
                self.errors.append(f"chat streamed {usage.completion_tokens if usage else None} tokens: {text!r}")
            self._record("chat", trace, raw.status_code, raw.headers)
        except openai.APIStatusError as e:
            self._record("chat", trace, e.status_code, e.response.headers)

    def completion(self) -> None:
        trace = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
        try:
            raw = self.client.completions.with_raw_response.create(model="tiny-llama", prompt="The sea is", max_tokens=6,
                                                                   extra_headers={"traceparent": trace})
            raw.parse()
            self._record("completion", trace, raw.status_code, raw.headers)
        except openai.APIStatusError as e:
            self._record("completion", trace, e.status_code, e.response.headers)

    def loop(self, send) -> None:
        while not self.stop.is_set():
            try:
                send()
            except openai.APIError as e:  # a connection error: not an answer the mesh gave
                self.errors.append(repr(e))
            time.sleep(0.15)

    def __enter__(self) -> "Traffic":
        self.threads = [threading.Thread(target=self.loop, args=(f,), daemon=True) for f in (self.chat, self.chat, self.completion)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def count(self, pred) -> int:
        with self.lock:
            return sum(1 for s in self.seen if pred(s))


def fault(mesh, pool: str, signal: str, value: float) -> None:
    r = httpx.put(mesh.admin_url(pool) + f"/admin/faults/{signal}", json={"value": value, "duration_s": 120}, timeout=5)
    assert r.status_code == 200, r.text


def level(mesh, pool: str) -> int:
    return mesh.admin_state(pool)["level"]


def has_data(series: list[dict]) -> bool:
    return any(not math.isnan(float(v)) for s in series for _, v in s["values"])


def peak(series: list[dict]) -> float:
    return max((float(v) for s in series for _, v in s["values"]), default=float("nan"))


def access_lines(path: Path, traces: set[str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {t: [] for t in traces}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("traceparent") in out:
            out[entry["traceparent"]].append(entry)
    return out


LEVEL = 'max(infermesh_pool_degradation_level{pool="interactive"})'
# The trip at its worst, as the pools dashboard shows it: critical-only, open breakers.
TRIP_WORST = {LEVEL: 3,
              'max(infermesh_breaker_state{pool="interactive", breaker="errors"})': 2,
              'max(infermesh_breaker_state{pool="batch", breaker="cpu"})': 2}


def test_every_panel_and_alert_has_data_and_the_trip_shows(local_mesh, chart):
    mesh = local_mesh
    dashboards, alerts = chart
    t0 = time.monotonic()
    # The pools' CPU breakers read the whole machine's load, which other work on a shared machine
    # moves: their readings are the test's for the run (low; batch's high for the trip, then low).
    for pool in ("interactive", "batch"):
        fault(mesh, pool, "cpu_load", 0.1)
    for pool in ("interactive", "batch"):
        mesh.wait_at_rest(60, [pool], why="before the run")
    prom = mesh.start_prometheus()  # returns once every target was scraped
    try:
        start = time.time()
        with Traffic(mesh) as traffic:
            # Healthy: both pools serve.
            wait_until(lambda: traffic.count(lambda s: s["kind"] == "chat") >= 6 and traffic.count(lambda s: s["kind"] == "completion") >= 3,
                       30, every=0.2, what="healthy traffic")
            # A few 1 s scrapes of the healthy pools before the trip (the level-0 check below): on
            # the suite's warm mesh the healthy traffic above takes under a second.
            time.sleep(max(0.0, start + 4.0 - time.time()))
            tripped = time.time()
            # The interactive pool's KV cache and the batch pool's CPU over their thresholds.
            fault(mesh, "interactive", "kv_cache", 0.99)
            fault(mesh, "batch", "cpu_load", 0.99)
            wait_until(lambda: traffic.count(lambda s: s["headers"].get("x-infermesh-degraded") == "true") >= 2, 20, every=0.2,
                       what="chats served by the fallback model")
            wait_until(lambda: traffic.count(lambda s: s["status"] == 429 and "x-infermesh-shed-by" not in s["headers"]) >= 2, 20,
                       every=0.2, what="the batch sidecar to shed batch work")
            # Then its error rate: critical-only, chats spill to batch and the edge sheds batch.
            fault(mesh, "interactive", "error_rate", 0.9)
            wait_until(lambda: traffic.count(lambda s: s["headers"].get("x-infermesh-served-by") == "batch/0" and s["kind"] == "chat") >= 2,
                       15, every=0.2, what="chats spilled to the batch pool")
            wait_until(lambda: traffic.count(lambda s: s["headers"].get("x-infermesh-shed-by") == "mesh") >= 2, 10, every=0.2,
                       what="batch shed at the edge")
            # The trip at its worst is in a scrape before the faults go: scraped every second, a
            # shorter level 3 fell between two scrapes in a clean-clone run (peak 2 of 3 asserted).
            wait_until(lambda: all((r := prom.query(e)) and float(r[0]["value"][1]) == v for e, v in TRIP_WORST.items()), 10, every=0.2,
                       what="Prometheus to scrape the trip at its worst")
            for signal in ("kv_cache", "error_rate"):
                httpx.delete(mesh.admin_url("interactive") + f"/admin/faults/{signal}", timeout=5)
            fault(mesh, "batch", "cpu_load", 0.1)
            cleared = time.time()
            for pool in ("interactive", "batch"):
                mesh.wait_at_rest(45, [pool], why="after the faults were cleared")
            print(f"[observe] both pools recovered {time.time() - cleared:.1f}s after the faults were cleared", flush=True)
            served_again = traffic.count(lambda s: s["headers"].get("x-infermesh-served-by") == "interactive/0")
            wait_until(lambda: traffic.count(lambda s: s["headers"].get("x-infermesh-served-by") == "interactive/0") > served_again,
                       10, every=0.2, what="chats back on the interactive pool")
        time.sleep(2.5)  # the last scrapes
        end = time.time()
        assert not traffic.errors, traffic.errors[:5]

        # Every panel query of every dashboard returns data over the run.
        empty = []
        queries = [q for d in dashboards for q in panel_queries(d, RATE, VARIABLES)]
        for q in queries:
            if not has_data(prom.query_range(q.expr, start, end, 1)):
                empty.append(f"{q.dashboard} / {q.panel} / {q.ref}: {q.expr}")
        # Every alert: the series it watches exist; the trip's alerts fire in full during the trip.
        for a in alerts:
            inner = without_threshold(a["expr"])
            if not has_data(prom.query_range(inner, start, end, 1)):
                empty.append(f"alert {a['alert']} (without its threshold): {inner}")
            if a["alert"] in TRIP_ALERTS and not prom.query_range(a["expr"], tripped, end, 1):
                empty.append(f"alert {a['alert']} did not fire during the trip: {a['expr']}")
        print(f"[observe] {len(queries)} panel queries of {len(dashboards)} dashboards, {len(alerts)} alerts, "
              f"{traffic.count(lambda s: True)} requests, run {end - start:.0f}s, test {time.monotonic() - t0:.0f}s")
        assert not empty, "\n".join(empty)
        assert {a["alert"] for a in alerts} >= TRIP_ALERTS

        # The trip as the pools dashboard shows it: level 0 before, 3 at its worst, open breakers.
        assert peak(prom.query_range(LEVEL, start, tripped - 1, 1)) == 0
        for expr, value in TRIP_WORST.items():
            assert peak(prom.query_range(expr, tripped, cleared + 1, 1)) == value, expr
        assert has_data(prom.query_range('sum(rate(infermesh_sidecar_spilled_in_requests_total{pool="batch", bound_for="interactive"}[10s])) > 0',
                                         tripped, end, 1))
    finally:
        httpx.delete(mesh.admin_url("interactive") + "/admin/faults", timeout=5)
        httpx.delete(mesh.admin_url("batch") + "/admin/faults", timeout=5)
        mesh.stop_child("prometheus")

    # Envoy's access log: one line per request, matching what the client got.
    seen = traffic.seen
    lines = wait_until(lambda: (got := access_lines(mesh.access_log, {s["traceparent"] for s in seen}))
                       and all(got.values()) and got, 5, every=0.25, what="Envoy to flush its access log")
    sidecars = {f"{mesh.plan.host}:{p.http_port}": f"{p.name}/{p.replica}" for p in mesh.plan.pools}
    for s in seen:
        entry, = lines[s["traceparent"]]
        h = s["headers"]
        assert not set(INTERNAL) & set(h), f"internal headers reached the client: {set(INTERNAL) & set(h)}"
        assert entry["status"] == s["status"] and entry["method"] == "POST"
        assert entry["path"] == ("/v1/chat/completions" if s["kind"] == "chat" else "/v1/completions")
        assert entry["request_id"] and entry["start_time"].endswith("Z")
        assert entry["served_by"] == h.get("x-infermesh-served-by") and entry["model"] == h.get("x-infermesh-model")
        assert entry["degraded"] == h.get("x-infermesh-degraded") and entry["shed_by"] == h.get("x-infermesh-shed-by")
        assert 0 <= entry["duration_ms"]
        if h.get("x-infermesh-shed-by") == "mesh":
            # Shed by the filter: answered before any upstream, and before it wrote its decision
            # on the request (docs/observability.md; the class is in infermesh_shed_requests_total).
            assert entry["upstream_host"] is None and entry["status"] == 429 and entry["class"] is None
            continue
        assert entry["class"] == ("interactive" if s["kind"] == "chat" else "batch")
        assert entry["rule"] == ("chat" if s["kind"] == "chat" else "default")
        assert entry["pool"] == entry["class"]
        # The replica Envoy sent it to is the one that answered (a sidecar's own refusal, 429 with
        # Retry-After, carries no served-by header: the address still says which).
        served = sidecars[entry["upstream_host"]]
        # The cluster is the decided pool's; a spill is the other pool's replica behind it.
        assert served == h.get("x-infermesh-served-by", served) and entry["upstream_cluster"] == f"pool_{entry['pool']}"
        assert entry["attempts"] >= 1 and entry["first_byte_ms"] <= entry["duration_ms"]
    spilled = [s for s in seen if s["kind"] == "chat" and s["headers"].get("x-infermesh-served-by") == "batch/0"]
    assert spilled and all(lines[s["traceparent"]][0]["pool"] == "interactive" for s in spilled), "a spill: bound for interactive, served by batch"
