"""Envoy's part of the mesh's traces (docs/tracing.md): the HTTP connection manager's `tracing`
block and the cluster of the OpenTelemetry Collector it exports to, as plain dicts, from the same
setting the sidecars read (infermesh.settings.TracingSettings).

Envoy's OpenTelemetry tracer starts (or joins: a client's W3C `traceparent`) each request's
trace, samples it by `sample_ratio`, and spawns one upstream span per attempt (`spawn_upstream_span`),
so a hedged request shows its two attempts side by side; the `traceparent` it forwards makes the
sidecar's span a child of the attempt's. The filter's decision is on the span as tags read from
the request headers it wrote (class, rule, pool). Spans go over OTLP/gRPC to COLLECTOR_CLUSTER.

    hcm["tracing"] = hcm_tracing(settings)          # None: tracing off, no block at all
    clusters.append(collector_cluster(settings))

envoy_resources.py puts them in where MeshListener.tracing is on: the HCM of both assemblies
(the static bootstrap, the control plane's snapshot) and the cluster beside the state clusters.
"""

from __future__ import annotations

import copy
import ipaddress

from infermesh.settings import TracingSettings

COLLECTOR_CLUSTER = "opentelemetry_collector"
SERVICE_NAME = "infermesh-envoy"
EXPORT_TIMEOUT = "0.25s"
"""One OTLP export call's limit: a slow collector costs spans, never requests."""

DECISION_TAGS = {"infermesh.class": "x-infermesh-class", "infermesh.rule": "x-infermesh-rule", "infermesh.pool": "x-infermesh-pool"}
"""The filter's decision, as the request headers it wrote (filter/src/config.rs HEADER_*)."""

HTTP2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "explicit_http_config": {"http2_protocol_options": {}},
}}


def hcm_tracing(settings: TracingSettings) -> dict | None:
    """The HCM's `tracing` field (None: tracing off)."""
    if not settings.on:
        return None
    # The typed config must be known to protobuf's descriptor pool before the control plane's
    # snapshot (xds_snapshot.py) packs the listener into an Any.
    from envoy.config.trace.v3 import opentelemetry_pb2  # noqa: F401

    return {
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": COLLECTOR_CLUSTER}, "timeout": EXPORT_TIMEOUT},
                "service_name": SERVICE_NAME,
            },
        },
        # Percent of the requests that start a trace here; a client's traceparent decides for its own.
        "random_sampling": {"value": settings.sample_ratio * 100},
        "spawn_upstream_span": True,
        "custom_tags": [{"tag": tag, "request_header": {"name": header}} for tag, header in DECISION_TAGS.items()],
    }


def collector_cluster(settings: TracingSettings) -> dict | None:
    """The OTLP/gRPC collector's cluster (None: tracing off): a static address, or a name Envoy resolves."""
    if not settings.on:
        return None
    host, port = settings.otlp_host, settings.otlp_port
    try:
        ipaddress.ip_address(host)
        kind = "STATIC"
    except ValueError:
        kind = "STRICT_DNS"
    return {
        "name": COLLECTOR_CLUSTER,
        "type": kind,
        "connect_timeout": "1s",
        "typed_extension_protocol_options": copy.deepcopy(HTTP2),
        "load_assignment": {"cluster_name": COLLECTOR_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}]},
    }

