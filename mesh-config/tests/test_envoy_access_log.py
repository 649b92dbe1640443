"""Envoy's JSON access log on the mesh listener (envoy_resources.access_log): on only where a path
is given (the local mesh's launcher gives the control plane one through its environment), the
fields of docs/observability.md, accepted by the real Envoy and by the control plane's snapshot,
and nothing else of the listener or its routes changed by it. The e2e check of the lines Envoy
writes is e2e/test_observability_e2e.py."""

from __future__ import annotations

import copy
from pathlib import Path

from infermesh import paths
from infermesh.meshconfig.envoy_resources import (ACCESS_LOG_ENV, ACCESS_LOG_FORMAT, MeshListener, PoolEndpoint, cluster,
                                                  http_connection_manager, inline_routes, pool_clusters, rds_routes, route_config)
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
from infermesh.meshconfig.xds_snapshot import LISTENER_TYPE, MeshTarget, build_snapshot

POLICY = load_policy(LOCAL_POLICY)
TARGET = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {"interactive": ("127.0.0.1", 8101, 8201), "batch": ("127.0.0.1", 8102, 8202)})
CONFIG = {"version": 1, "default_class": "batch",
          "classes": {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}},
          "rules": [{"name": "chat", "class": "interactive", "match": {"path": {"exact": "/v1/chat/completions"}}}]}


def mesh(wasm: Path = Path("/x.wasm"), **kw) -> MeshListener:
    return MeshListener("127.0.0.1", 8080, 9901, wasm, copy.deepcopy(CONFIG),
                        [PoolEndpoint("interactive", "127.0.0.1", 8101), PoolEndpoint("batch", "127.0.0.1", 8102)], "batch", **kw)


def test_no_path_no_access_log(monkeypatch):
    monkeypatch.delenv(ACCESS_LOG_ENV, raising=False)
    assert mesh().access_log_path is None
    assert "access_log" not in http_connection_manager(mesh(), rds_routes())


def test_the_path_comes_from_the_environment_or_the_caller(monkeypatch):
    monkeypatch.setenv(ACCESS_LOG_ENV, "/tmp/run/envoy-access.log")
    assert mesh().access_log_path == "/tmp/run/envoy-access.log"
    assert mesh(access_log_path="/dev/stdout").access_log_path == "/dev/stdout"
    logger, = http_connection_manager(mesh(), rds_routes())["access_log"]
    assert logger["name"] == "envoy.access_loggers.file"
    assert logger["typed_config"]["path"] == "/tmp/run/envoy-access.log"
    assert logger["typed_config"]["log_format"] == {"json_format": ACCESS_LOG_FORMAT}


def test_the_fields_say_what_served_the_request_and_how():
    f = ACCESS_LOG_FORMAT
    # The decision as the filter (or a native route) wrote it on the request for the upstream.
    assert (f["class"], f["rule"], f["pool"]) == ("%REQ(X-INFERMESH-CLASS)%", "%REQ(X-INFERMESH-RULE)%", "%REQ(X-INFERMESH-POOL)%")
    # The sidecar's public identity headers on the response.
    assert (f["served_by"], f["model"], f["degraded"]) == (
        "%RESP(X-INFERMESH-SERVED-BY)%", "%RESP(X-INFERMESH-MODEL)%", "%RESP(X-INFERMESH-DEGRADED)%")
    assert f["request_id"] == "%REQ(X-REQUEST-ID)%" and f["traceparent"] == "%REQ(TRACEPARENT)%"
    assert f["first_byte_ms"] == "%RESPONSE_DURATION%" and f["duration_ms"] == "%DURATION%"
    assert f["upstream_host"] == "%UPSTREAM_HOST%" and f["attempts"] == "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"
    assert {"start_time", "method", "path", "status", "response_flags"} <= set(f)
    # Never the internal headers: the pool level and the load report are removed before the client.
    assert not any("POOL-LEVEL" in v or "ENDPOINT-LOAD-METRICS" in v for v in f.values())


def test_the_access_log_changes_nothing_else(monkeypatch):
    monkeypatch.delenv(ACCESS_LOG_ENV, raising=False)
    on, off = mesh(access_log_path="/dev/stdout"), mesh()
    with_log, without = http_connection_manager(on, inline_routes(on)), http_connection_manager(off, inline_routes(off))
    del with_log["access_log"]
    assert with_log == without
    # The routes keep removing the internal response headers, the access log or not.
    assert route_config(on) == route_config(off)


def test_envoy_accepts_the_access_log(envoy_accepts, tmp_path):
    m = mesh(paths.filter_wasm(), access_log_path=str(tmp_path / "access.log"))
    envoy_accepts(http_connection_manager(m, inline_routes(m)), [cluster(m, p, grpc, eds=False) for p, grpc in pool_clusters(m)])


def test_the_control_plane_serves_it(monkeypatch):
    monkeypatch.setenv(ACCESS_LOG_ENV, "/tmp/run/envoy-access.log")
    with_log = build_snapshot(POLICY, TARGET)
    monkeypatch.delenv(ACCESS_LOG_ENV)
    without = build_snapshot(POLICY, TARGET)
    assert with_log.version != without.version
    listener = with_log.resources[LISTENER_TYPE][0]
    assert "envoy.access_loggers.file" in str(listener) and "/tmp/run/envoy-access.log" in str(listener)
