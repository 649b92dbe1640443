"""Envoy's tracing parts (meshconfig/tracing.py): off by default (nothing in the config), on: the
HCM's OpenTelemetry tracer to the collector's cluster with the setting's sampling, the filter's
decision as tags, and the real Envoy binary accepts them (`--mode validate`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.tracing import COLLECTOR_CLUSTER, collector_cluster, hcm_tracing, with_tracing
from infermesh.settings import TracingSettings

ON = TracingSettings(otlp_endpoint="127.0.0.1:4317", sample_ratio=0.25)


def test_off_by_default_adds_nothing():
    off = TracingSettings()
    assert hcm_tracing(off) is None and collector_cluster(off) is None
    b = bootstrap(LocalMeshPlan().listener(Path("/x.wasm")))
    assert with_tracing(copy.deepcopy(b), off) == b


def test_on_the_hcm_traces_to_the_collector_cluster_with_the_settings_sampling():
    t = hcm_tracing(ON)
    cfg = t["provider"]["typed_config"]
    assert t["provider"]["name"] == "envoy.tracers.opentelemetry"
    assert cfg["grpc_service"]["envoy_grpc"]["cluster_name"] == COLLECTOR_CLUSTER and cfg["service_name"] == "infermesh-envoy"
    assert t["random_sampling"] == {"value": 25.0}
    assert t["spawn_upstream_span"] is True, "one span per attempt: a hedge shows as two"
    assert {c["tag"]: c["request_header"]["name"] for c in t["custom_tags"]} == {
        "infermesh.class": "x-infermesh-class", "infermesh.rule": "x-infermesh-rule", "infermesh.pool": "x-infermesh-pool"}
    c = collector_cluster(ON)
    assert c["name"] == COLLECTOR_CLUSTER and c["type"] == "STATIC"
    assert c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1", "port_value": 4317}
    assert "http2_protocol_options" in json.dumps(c), "OTLP/gRPC needs HTTP/2"
    named = collector_cluster(TracingSettings(otlp_endpoint="otel-collector.observability:4317"))
    assert named["type"] == "STRICT_DNS"
    assert collector_cluster(TracingSettings(otlp_endpoint="[::1]:4317"))["type"] == "STATIC"


def test_envoy_accepts_the_tracing_block_and_the_cluster(envoy_accepts):
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "t", "route_config": {}, "tracing": hcm_tracing(ON),
           "http_filters": [{"name": "envoy.filters.http.router",
                             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    envoy_accepts(hcm, [collector_cluster(ON)])


def test_a_static_bootstrap_with_tracing():
    b = with_tracing(bootstrap(LocalMeshPlan().listener(Path("/x.wasm"))), ON)
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["tracing"] == hcm_tracing(ON)
    assert b["static_resources"]["clusters"][-1] == collector_cluster(ON)
