"""Envoy's tracing parts (meshconfig/tracing.py): off by default (nothing in the config), on: the
HCM's OpenTelemetry tracer to the collector's cluster with the setting's sampling, the filter's
decision as tags, and the real Envoy binary accepts them (`--mode validate`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from google.protobuf import json_format

from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.envoy_resources import http_connection_manager, listener, rds_routes, state_clusters
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.tracing import COLLECTOR_CLUSTER, collector_cluster, hcm_tracing
from infermesh.meshconfig.xds_snapshot import build_snapshot
from infermesh.settings import TracingSettings

ON = TracingSettings(otlp_endpoint="127.0.0.1:4317", sample_ratio=0.25)


def test_off_by_default_adds_nothing():
    off = TracingSettings()
    assert hcm_tracing(off) is None and collector_cluster(off) is None
    b = bootstrap(LocalMeshPlan().listener(Path("/x.wasm")))
    assert "tracing" not in json.dumps(b) and COLLECTOR_CLUSTER not in json.dumps(b)


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


def test_the_listener_with_tracing_on_carries_both_in_the_bootstrap_and_the_snapshot():
    m = dataclasses.replace(LocalMeshPlan().listener(Path("/x.wasm")), tracing=ON)
    b = bootstrap(m)
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["tracing"] == hcm_tracing(ON)
    assert collector_cluster(ON) in b["static_resources"]["clusters"]
    # The control plane packs them into its protobuf snapshot (every typed config known).
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.listener.v3 import listener_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2

    packed = json_format.ParseDict(listener(m, http_connection_manager(m, rds_routes())), listener_pb2.Listener())
    proto = http_connection_manager_pb2.HttpConnectionManager()
    packed.filter_chains[0].filters[0].typed_config.Unpack(proto)
    assert proto.tracing.provider.name == "envoy.tracers.opentelemetry" and proto.tracing.random_sampling.value == 25.0
    assert [c["name"] for c in state_clusters(m, eds=True)][0] == COLLECTOR_CLUSTER
    json_format.ParseDict(collector_cluster(ON), cluster_pb2.Cluster())


def test_the_control_plane_serves_no_tracing_while_the_policy_has_none():
    from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
    from infermesh.meshconfig.xds_snapshot import MeshTarget

    target = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {"interactive": ("127.0.0.1", 8101, 8201), "batch": ("127.0.0.1", 8102, 8202)})
    snap = build_snapshot(load_policy(LOCAL_POLICY), target)
    assert "opentelemetry" not in str(snap.resources)


def test_a_policy_with_tracing_traces_in_envoy_the_control_plane_and_every_sidecar(tmp_path):
    from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
    from infermesh.meshconfig.xds_snapshot import MeshTarget
    from infermesh.sidecar.config import SidecarConfig

    path = tmp_path / "policy.yaml"
    path.write_text(LOCAL_POLICY.read_text() + "tracing: {otlp_endpoint: 127.0.0.1:4317, sample_ratio: 0.25}\n")
    policy = load_policy(path)
    assert policy.tracing == ON
    target = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {"interactive": ("127.0.0.1", 8101, 8201), "batch": ("127.0.0.1", 8102, 8202)})
    assert "opentelemetry" in str(build_snapshot(policy, target).resources)
    assert LocalMeshPlan(policy=policy).listener(Path("/x.wasm")).tracing == ON
    for pool in policy.pools:
        assert SidecarConfig.model_validate(policy.sidecar_config(pool, tmp_path)).tracing == ON
