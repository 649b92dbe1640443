"""e2e: one trace per request across the mesh, received by a real OpenTelemetry Collector (built
from its Go modules, scripts/setup-otelcol.sh; OTLP in, JSON lines out).

The mesh: the e2e policy's two real vLLM sidecars with tracing on at 100 % (the config's
`tracing`), and the real Envoy with the compiled filter in front of them, from the mesh's static
bootstrap with tracing on (MeshListener.tracing: meshconfig/tracing.py's parts). A chat sent with the `openai` SDK
and a client `traceparent` must come back as one trace in the collector's file: Envoy's server
span (the filter's class, rule and pool as tags) and its upstream attempt, the sidecar's span
(GenAI attributes, class, pool, served_by) with its queue, prefill and decode, and vLLM's own
`llm_request`, each the child of the one before, every one with a duration; a gRPC Generate
likewise, its context in the call's metadata. A chat spilled to the batch pool (the interactive
pool down to critical-only) shows as spilled. And in Istio: real istiod turns the chart's
Telemetry (the policy's tracing) into the gateway's tracer, whose spans join the same trace.

The local mesh's own Envoy (over the control plane) runs beside it untraced: the policy model
carries no `tracing` yet (docs/tracing.md, "What is left"), so the traced Envoy runs the static
bootstrap, the same resources the control plane serves.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import yaml

from infermesh import paths
from infermesh.chart_render import setup_outputs
from infermesh.launcher import LocalMesh, free_ports, plan_on_free_ports, wait_until
from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.tracing import DECISION_TAGS
from infermesh.settings import TracingSettings
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

from .conftest import E2E_POLICY

pytestmark = pytest.mark.e2e

SERVER, CLIENT = 2, 3
"""OTLP's span kinds."""


class Collector:
    """The real collector: OTLP/gRPC and HTTP on loopback, every span batch a JSON line in `out`."""

    def __init__(self, binary: str, work: Path):
        grpc_port, http_port = free_ports(2)
        self.endpoint = f"127.0.0.1:{grpc_port}"
        self.out = work / "traces.jsonl"
        config = work / "otelcol.yaml"
        config.write_text(json.dumps({
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": self.endpoint}, "http": {"endpoint": f"127.0.0.1:{http_port}"}}}},
            "exporters": {"file": {"path": str(self.out), "flush_interval": "100ms"}},
            "service": {"telemetry": {"metrics": {"level": "none"}},
                        "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}}},
        }))
        self.log = work / "otelcol.log"
        self.proc = subprocess.Popen([binary, "--config", str(config)], stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        wait_until(lambda: "Everything is ready" in self.log.read_text() or self.proc.poll() is not None, 30, what="the collector")
        assert self.proc.poll() is None, self.log.read_text()

    def spans(self, trace_id: str) -> list[dict]:
        """The trace's spans received so far, each with its resource's `service` and its
        attributes as a plain dict."""
        out = []
        if not self.out.exists():
            return out
        # The file exporter may be mid-way through a line: only the lines it has ended are read.
        text = self.out.read_text()
        for line in text[:text.rfind("\n") + 1].splitlines():
            for rs in json.loads(line).get("resourceSpans", []):
                service = attrs(rs["resource"].get("attributes", [])).get("service.name")
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        if s["traceId"] == trace_id:
                            out.append(s | {"service": service, "attrs": attrs(s.get("attributes", [])),
                                            "ms": (int(s["endTimeUnixNano"]) - int(s["startTimeUnixNano"])) / 1e6})
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def attrs(kvs: list[dict]) -> dict:
    return {kv["key"]: next(iter(kv["value"].values()), None) if kv.get("value") else None for kv in kvs}


@dataclasses.dataclass
class TracedPlan(LocalMeshPlan):
    """The e2e plan, its sidecars' configs with tracing on (the policy model has no `tracing` yet)."""

    tracing: TracingSettings = TracingSettings()

    def sidecar_config(self, pool, models_dir: Path) -> dict:
        return super().sidecar_config(pool, models_dir) | {"tracing": self.tracing.model_dump()}


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    c = Collector(setup_outputs("setup-otelcol.sh")["OTELCOL"], tmp_path_factory.mktemp("otelcol"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def traced(collector, tmp_path_factory):
    """(mesh, base URL of the traced Envoy)."""
    work = tmp_path_factory.mktemp("traced-mesh")
    settings = TracingSettings(otlp_endpoint=collector.endpoint, sample_ratio=1.0)
    base = plan_on_free_ports(E2E_POLICY)
    plan = TracedPlan(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, tracing=settings)
    # Spans leave each process within 0.2 s instead of the SDK's 5 s (the sidecars inherit it).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        mesh = LocalMesh(plan, work, paths.models_dir(), paths.filter_wasm())
        mesh.start(timeout=420, progress=lambda m: print(f"[mesh] {m}", flush=True))
    listen, admin = free_ports(2)
    listener = dataclasses.replace(plan.listener(paths.filter_wasm()), listen_port=listen, admin_port=admin, tracing=settings)
    boot = work / "envoy-traced.json"
    boot.write_text(json.dumps(bootstrap(listener)))
    log = work / "envoy-traced.log"
    envoy = subprocess.Popen([str(paths.envoy_binary()), "-c", str(boot), "--use-dynamic-base-id", "--concurrency", "1", "--log-level", "warn"],
                             stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: envoy.poll() is not None or healthy(f"http://127.0.0.1:{admin}"), 60, every=0.2, what="the traced Envoy")
        assert envoy.poll() is None, log.read_text()[-3000:]
        yield mesh, f"http://127.0.0.1:{listen}"
    finally:
        envoy.terminate()
        envoy.wait(timeout=10)
        mesh.stop()


def healthy(admin_url: str) -> bool:
    try:
        text = urllib.request.urlopen(admin_url + "/clusters", timeout=2).read().decode()
    except OSError:
        return False
    flags = [line for line in text.splitlines() if "::health_flags::" in line and line.startswith("pool_")]
    return bool(flags) and all(line.endswith("::healthy") for line in flags)


def traceparent() -> tuple[str, str, str]:
    """A client's (header, trace id, span id), sampled."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def chat(base: str, header: str):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0)
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                                            stream=True, extra_headers={"traceparent": header})
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def whole_trace(collector: Collector, trace_id: str, names: set[str]) -> list[dict]:
    """The trace once both Envoy spans and the spans `names` have been exported (each process
    exports on its own schedule: Envoy every 5 s or 5 spans)."""
    def complete():
        spans = collector.spans(trace_id)
        envoy = sum(s["service"] == "infermesh-envoy" for s in spans)
        return spans if envoy >= 2 and {s["name"] for s in spans} >= names else None
    return wait_until(complete, 20, every=0.2, what=f"trace {trace_id} with {sorted(names)}")


def show(spans: list[dict]) -> None:
    by_id = {s["spanId"]: s for s in spans}

    def depth(s):
        return 0 if s.get("parentSpanId") not in by_id else 1 + depth(by_id[s["parentSpanId"]])
    for s in sorted(spans, key=lambda s: int(s["startTimeUnixNano"])):
        print(f"[trace] {'  ' * depth(s)}{s['service']}: {s['name']} {s['ms']:.1f} ms")


def start(span: dict) -> int:
    return int(span["startTimeUnixNano"])


def end(span: dict) -> int:
    return int(span["endTimeUnixNano"])


def one(spans: list[dict], pred) -> dict:
    found = [s for s in spans if pred(s)]
    assert len(found) == 1, [(s["service"], s["name"]) for s in spans]
    return found[0]


def test_a_chat_is_one_trace_from_envoy_through_the_sidecar_to_vllm(collector, traced):
    mesh, base = traced
    header, trace_id, client_span = traceparent()
    assert chat(base, header)
    spans = whole_trace(collector, trace_id, {"chat tiny-llama", "infermesh.decode", "llm_request"})
    show(spans)
    edge = one(spans, lambda s: s["service"] == "infermesh-envoy" and s["kind"] == SERVER)
    assert edge["parentSpanId"] == client_span, "the client's traceparent is the trace's root"
    assert edge["attrs"]["infermesh.class"] == "interactive" and edge["attrs"]["infermesh.rule"] == "chat"
    assert edge["attrs"]["infermesh.pool"] == "interactive"
    attempt = one(spans, lambda s: s["service"] == "infermesh-envoy" and s["kind"] == CLIENT)
    assert attempt["parentSpanId"] == edge["spanId"]
    sidecar = one(spans, lambda s: s["service"] == "infermesh-sidecar" and s["kind"] == SERVER)
    assert sidecar["parentSpanId"] == attempt["spanId"], "Envoy's attempt forwarded its own context"
    assert sidecar["name"] == "chat tiny-llama"
    a = sidecar["attrs"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny-llama"
    assert a["gen_ai.response.model"] == "tiny-llama-large" and int(a["gen_ai.usage.output_tokens"]) >= 1
    assert int(a["gen_ai.usage.input_tokens"]) > 1 and a["gen_ai.server.time_to_first_token"] > 0
    assert a["infermesh.class"] == "interactive" and a["infermesh.rule"] == "chat" and a["infermesh.pool"] == "interactive"
    assert a["infermesh.served_by"] == "interactive/0" and a["infermesh.degraded"] is False and a["infermesh.outcome"] == "ok"
    assert a["infermesh.ladder_model"] == "tiny-llama-large"
    for phase in ("infermesh.queue", "infermesh.prefill", "infermesh.decode"):
        assert one(spans, lambda s, p=phase: s["name"] == p)["parentSpanId"] == sidecar["spanId"]
    vllm = one(spans, lambda s: s["name"] == "llm_request")
    assert vllm["parentSpanId"] == sidecar["spanId"] and vllm["service"] == "vllm", "vLLM's own span joins under the sidecar's"
    assert int(vllm["attrs"]["gen_ai.usage.completion_tokens"]) == int(a["gen_ai.usage.output_tokens"])
    # Every hop has its duration and starts inside the one above it; the last token came before
    # Envoy's attempt ended (the sidecar's span itself ends at the request's release, just after
    # its last byte went out, so it may outlast the attempt by a moment).
    assert all(s["ms"] > 0 for s in (edge, attempt, sidecar, vllm))
    decode = one(spans, lambda s: s["name"] == "infermesh.decode")
    assert start(edge) <= start(attempt) <= start(sidecar) <= start(vllm)
    # Not end(attempt) <= end(edge): Envoy finishes its upstream span after the downstream one
    # (0.5 ms later in two clean-clone runs on 89e6993 and ee57dfc), both its own clock's.
    assert end(decode) <= end(attempt) and end(decode) <= end(edge)


def test_a_grpc_generate_carries_the_trace_in_its_metadata(collector, traced):
    """gRPC through the same listener: the client's traceparent in the call's metadata, Envoy's
    attempt's in the sidecar's, and the sidecar's handed to vLLM."""
    _, base = traced
    header, trace_id, client_span = traceparent()
    with grpc.insecure_channel(base.removeprefix("http://")) as ch:
        msgs = list(pb_grpc.InferenceStub(ch).Generate(
            pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hi")]), max_tokens=6, temperature=0),
            metadata=(("traceparent", header),), timeout=60))
    assert msgs[-1].final.usage.completion_tokens == 6
    # Named `{operation} {requested model}`, and this call names no model.
    spans = whole_trace(collector, trace_id, {"chat", "infermesh.decode", "llm_request"})
    show(spans)
    edge = one(spans, lambda s: s["service"] == "infermesh-envoy" and s["kind"] == SERVER)
    assert edge["parentSpanId"] == client_span and edge["attrs"]["infermesh.rule"] == "grpc-generate"
    sidecar = one(spans, lambda s: s["service"] == "infermesh-sidecar" and s["kind"] == SERVER)
    a = sidecar["attrs"]
    assert a["infermesh.front"] == "grpc" and a["infermesh.status"] == "OK" and int(a["gen_ai.usage.output_tokens"]) == 6
    assert a["infermesh.rule"] == "grpc-generate" and a["infermesh.class"] == "interactive"
    assert one(spans, lambda s: s["name"] == "llm_request")["parentSpanId"] == sidecar["spanId"]


def test_a_spilled_chat_shows_as_spilled(collector, traced):
    """The interactive pool down to critical-only: Envoy's health check of its state endpoint
    sends chats to the batch pool, and the trace says so."""
    mesh, base = traced
    admin = mesh.admin_url("interactive")
    try:
        httpx.put(admin + "/admin/faults/error_rate", json={"value": 0.9, "duration_s": 30}, timeout=5)
        wait_until(lambda: mesh.admin_state("interactive")["level"] == 3, 15, every=0.05, what="critical-only")
        spans = None

        def spilled():
            nonlocal spans
            header, trace_id, _ = traceparent()
            chat(base, header)
            time.sleep(0.3)
            spans = whole_trace(collector, trace_id, {"chat tiny-llama", "infermesh.decode"})
            return one(spans, lambda s: s["service"] == "infermesh-sidecar" and s["kind"] == SERVER)["attrs"]["infermesh.pool"] == "batch"
        wait_until(spilled, 30, every=0.1, what="a chat served by the batch pool")
    finally:
        httpx.delete(admin + "/admin/faults", timeout=5)
    show(spans)
    a = one(spans, lambda s: s["service"] == "infermesh-sidecar" and s["kind"] == SERVER)["attrs"]
    assert a["infermesh.served_by"] == "batch/0" and a["infermesh.class"] == "interactive"
    assert a["infermesh.routed_pool"] == "interactive" and a["infermesh.spilled"] is True
    edge = one(spans, lambda s: s["service"] == "infermesh-envoy" and s["kind"] == SERVER)
    assert edge["attrs"]["infermesh.pool"] == "interactive", "the filter's decision; Envoy's failover served it elsewhere"


# -- Istio: the chart's Telemetry, through real istiod -------------------------------------------

COLLECTOR_HOST = "otel-collector.observability.svc.cluster.local"
ISTIO_PROVIDER = "infermesh-otel"


def test_istiod_gives_the_gateway_the_charts_tracing_and_its_spans_join_the_trace(collector, traced, tmp_path_factory):
    """The chart's default policy with `tracing` on, rendered with `tracing.istioProvider`
    naming an `opentelemetry` extensionProvider of istiod's MeshConfig (the collector as a
    ServiceEntry, as its Service would be): istiod gives the gateway's listener Envoy's
    OpenTelemetry tracer at the policy's sampling with the filter's decision as tags, and a chat
    through the gateway is one trace from the gateway's span to the traced sidecar's."""
    from infermesh.chart_render import Helm
    from infermesh.istiod_gateway import DEFAULT_POLICY, Form, istiod_binary, on_loopback, pool_service_entries, render, start_gateway

    mesh, _ = traced
    # After the spill test: the interactive pool back to normal service first.
    wait_until(lambda: mesh.admin_state("interactive")["level"] == 0, 60, every=0.2, what="the interactive pool's normal service")
    policy = yaml.safe_load(DEFAULT_POLICY.read_text())
    policy["tracing"] = {"otlp_endpoint": f"{COLLECTOR_HOST}:4317", "sample_ratio": 1.0}
    form = Form("tracing", policy, "EnvoyFilter", body_rules=True, native=True)
    work = tmp_path_factory.mktemp("istiod-tracing")
    (port,) = free_ports(1)
    objects = render(Helm.from_tools(setup_outputs("setup-chart-tools.sh")), form, port, work, sets=[f"tracing.istioProvider={ISTIO_PROVIDER}"])
    (telemetry,) = [o for o in objects if o["kind"] == "Telemetry"]
    assert telemetry["spec"]["tracing"][0]["providers"] == [{"name": ISTIO_PROVIDER}]
    collector_port = int(collector.endpoint.rsplit(":", 1)[1])
    collector_entry = {
        "apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
        "metadata": {"name": "otel-collector", "namespace": "observability"},
        "spec": {"hosts": [COLLECTOR_HOST], "location": "MESH_INTERNAL", "resolution": "STATIC",
                 "ports": [{"name": "grpc-otlp", "number": 4317, "protocol": "GRPC"}],
                 "endpoints": [{"address": "127.0.0.1", "ports": {"grpc-otlp": collector_port}}]},
    }
    config = on_loopback(objects, port) + pool_service_entries(objects, mesh.plan.pools) + [collector_entry]
    mesh_config = {"extensionProviders": [{"name": ISTIO_PROVIDER, "opentelemetry": {"service": COLLECTOR_HOST, "port": 4317}}]}
    gw = start_gateway(istiod_binary(), form, objects, config, work, port, mesh=mesh_config)
    try:
        dump = gw.config_dump()
        listeners = [e["active_state"]["listener"] for c in dump["configs"] if c["@type"].endswith("ListenersConfigDump")
                     for e in c.get("dynamic_listeners", []) if "active_state" in e]
        (listener,) = [lst for lst in listeners if lst["address"]["socket_address"].get("port_value") == port]
        (chain,) = listener["filter_chains"]
        hcm = next(f for f in chain["filters"] if f["name"] == "envoy.filters.network.http_connection_manager")["typed_config"]
        tracing = hcm["tracing"]
        assert tracing["provider"]["name"] == "envoy.tracers.opentelemetry", tracing
        assert tracing["provider"]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == f"outbound|4317||{COLLECTOR_HOST}"
        assert tracing["random_sampling"]["value"] == 100 and tracing.get("spawn_upstream_span") is True
        tags = {t["tag"]: t.get("request_header", {}).get("name") for t in tracing.get("custom_tags", [])}
        assert {k: tags.get(k) for k in DECISION_TAGS} == DECISION_TAGS, tags

        header, trace_id, client_span = traceparent()
        assert chat(gw.base_url, header)

        def joined():
            spans = collector.spans(trace_id)
            gateway = [s for s in spans if s["kind"] == SERVER and s["parentSpanId"] == client_span]
            sidecar = [s for s in spans if s["service"] == "infermesh-sidecar" and s["kind"] == SERVER]
            return (spans, gateway, sidecar) if gateway and sidecar else None
        spans, (edge,), (sidecar,) = wait_until(joined, 20, every=0.2, what=f"trace {trace_id} from the gateway to the sidecar")
        show(spans)
        assert edge["service"] != "infermesh-envoy", "the gateway's span, not the traced static Envoy's"
        assert edge["attrs"]["infermesh.class"] == "interactive" and edge["attrs"]["infermesh.pool"] == "interactive"
        attempt = one(spans, lambda s: s["kind"] == CLIENT and s["parentSpanId"] == edge["spanId"])
        assert sidecar["parentSpanId"] == attempt["spanId"], "the gateway's attempt forwarded its own context"
        assert sidecar["attrs"]["infermesh.served_by"] == "interactive/0"
    finally:
        gw.stop()
