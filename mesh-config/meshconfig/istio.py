"""The Istio resources of a policy: the plain-Envoy parts of envoy_resources.py in Istio's
vocabulary.

    per pool      a Service (OpenAI HTTP front + gRPC) and a DestinationRule
    once          a front Service clients address, a VirtualService (and one for the ingress
                  gateways), and the filter: an EnvoyFilter when a rule reads the body or native
                  header rules decide some requests, a WasmPlugin otherwise; and the pools'
                  EnvoyFilter (`NAME-pools`): what a DestinationRule and a VirtualService cannot
                  say about many replicas (client-side weighted round robin on the replicas' ORCA
                  reports, the retry budget, hedging past a TTFT deadline; docs/replicas.md)

    infermesh policy render POLICY istio --wasm-url oci://… --wasm-sha256 HEX | kubectl apply -f -

Nothing is decided here. `chart_parts()` translates what envoy_resources decides (the route table
in order: per-pool header routes (where some route runs the filter), native header-rule routes,
the default; the Wasm filter; the pool limits and retries) into release-independent Istio
pieces; `resources()` and the Helm chart (charts/infermesh reads the same pieces from its `generated` values, which `infermesh policy
render POLICY helm-values` writes) only add names, ports and where the module lives. charts/tests
proves that the two assemblies give the same objects.

Degraded-mode routing (`when_degraded`) splits as in plain Envoy. Spill is Envoy's: the pools'
EnvoyFilter gives a pool with `spill_to` the state endpoint's health check (`health_checks(grpc,
below_level=at_level)`) on its two Istio clusters, adds per front an aggregate cluster
(`infermesh-spill|PORT||HOST`: the pool's cluster, then the spill pool's) and points the pool's
routes at it, so a replica at the level leaves rotation and Envoy's priority load sends its share
to the spill pool. Shed is the filter's, which probes the pool's state through `outbound|PORT||HOST`
(probe_cluster); Istio turns panic mode off on its clusters (healthy_panic_threshold 0 with
outlier detection), so the patch sets 1 %: with every replica out of rotation the probe still
reaches them. docs/kubernetes.md, "Degraded-mode routing (`when_degraded`) in Istio".
"""

from __future__ import annotations

import copy
import decimal
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .envoy_resources import (
    EDGE_PATHS,
    GRPC_CONTENT_TYPE,
    NOT_FOUND_BODY,
    NOT_FOUND_ROUTE,
    ORCA_HEADER,
    POOL_LIMITS,
    REQUEST_BUFFER_LIMIT_BYTES,
    STRIP_CLIENT_HEADERS,
    WASM_FILTER,
    WASM_OFF,
    WEIGHTED_ROUND_ROBIN,
    MeshListener,
    PoolEndpoint,
    Routing,
    circuit_breakers,
    cluster_name,
    common_lb_config,
    edge_routes,
    health_checks,
    is_not_found,
    local_code,
    on_pool_header,
    remote_code,
    retry_policy,
    routes,
    uses_native_rules,
    wasm_filter_config,
)
from .policy import Policy

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


class IstioConfigError(ValueError):
    """A policy or option that cannot become Istio resources; the message names the field
    (`field`: its path in the policy, when the policy is at fault, for the file's line)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def check_policy(policy: Policy) -> None:
    """Raise IstioConfigError for a policy Istio's proxy cannot run."""
    if policy.filter.runtime != "wasm":
        # istio-proxy loads extensions as Wasm; a dynamic module is tied to one Envoy build's ABI.
        raise IstioConfigError("filter.runtime: Istio's proxy runs the filter as Wasm only (a native dynamic module is "
                               "for plain Envoy, docs/filter-native-module.md): use `runtime: wasm`", field="filter.runtime")


@dataclass(frozen=True)
class IstioOptions:
    """What a Kubernetes deployment adds to the policy. The defaults are the chart's, except
    `gateways`: with `ingress.enabled` the chart binds the routes to a Gateway of its own."""

    wasm_url: str
    """Where proxies fetch the filter: `oci://REGISTRY/REPO:TAG`, `https://…` or `file://…`."""
    wasm_sha256: str
    """Hex SHA-256 of the module (of the image for `oci://`): the proxy refuses anything else."""
    name: str = "infermesh"
    """Prefix of every object (the Helm release's full name)."""
    namespace: str = "infermesh"
    """Namespace of the pools, their Services and the routing objects."""
    cluster_domain: str = "cluster.local"
    """The cluster's DNS domain (Service FQDNs in routes and DestinationRules)."""
    http_port: int = 8000
    """The sidecars' OpenAI HTTP front."""
    grpc_port: int = 50051
    """The sidecars' gRPC front (infermesh.v1.Inference, grpc.health.v1)."""
    fail_strategy: Literal["FAIL_OPEN", "FAIL_CLOSE"] = "FAIL_OPEN"
    """FAIL_OPEN as in plain Envoy: a broken filter sends traffic to the default pool instead of
    failing every request (and, not loaded at all, leaves client-sent x-infermesh-* headers in)."""
    filter_namespace: str = "istio-ingress"
    """Namespace of the proxies that classify (a WasmPlugin/EnvoyFilter acts in its own namespace)."""
    filter_selector: dict[str, str] = field(default_factory=lambda: {"istio": "ingress"})
    """Labels of those proxies' pods (Istio's gateway chart labels its pods `istio: <release>`)."""
    attach_to: Literal["gateway", "sidecar"] = "gateway"
    """`gateway`: the filter runs in ingress gateways; `sidecar`: in the outbound path of the
    selected client pods' sidecars."""
    gateways: tuple[str, ...] = ()
    """Istio Gateways (`namespace/name`) of a second VirtualService (`NAME-ingress`) with the same
    routes; mesh clients always reach the pools through the front Service's name."""
    hosts: tuple[str, ...] = ("*",)
    """Host names clients use through those gateways."""
    image_pull_policy: Literal["IfNotPresent", "Always"] = "IfNotPresent"
    image_pull_secret: str = ""
    """Secret (in filter_namespace) with credentials for a private OCI registry."""
    traffic_policy: dict = field(default_factory=dict)
    """Overrides of the pools' DestinationRule trafficPolicy, merged key by key over the model's
    (the chart's values `trafficPolicy`)."""
    retry_budget: bool = True
    """Give the pool clusters the plain-Envoy retry budget (the chart's values `retryBudget`): a
    CLUSTER patch with MERGE_AND_REPLACE_LIST, which Istio's EnvoyFilter API has only in recent
    versions (the pinned 1.31 line has it); off, the clusters keep the fixed `maxRetries`."""

    def fqdn(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc.{self.cluster_domain}"


def pool_service_name(opts: IstioOptions, pool: str) -> str:
    return f"{opts.name}-{pool}"


def labels(opts: IstioOptions, pool: str | None = None) -> dict[str, str]:
    """The labels of the sidecar pods (of one pool, or of all)."""
    out = {"app.kubernetes.io/name": "infermesh", "app.kubernetes.io/instance": opts.name, "app.kubernetes.io/component": "sidecar"}
    return out | ({"infermesh.io/pool": pool} if pool is not None else {})


def needs_body(policy: Policy) -> bool:
    """Whether any rule reads the request body (then the filter must be able to pause)."""
    return policy.needs_body


def check(policy: Policy, opts: IstioOptions) -> None:
    """Raise IstioConfigError for what Kubernetes or Istio would refuse."""
    check_policy(policy)
    for pool in policy.pools:
        if not _DNS_LABEL.match(pool):
            raise IstioConfigError(f"pools.{pool}: a pool name becomes a Kubernetes Service name: lower-case letters, digits and '-', starting with a letter")
        name = pool_service_name(opts, pool)
        if len(name) > 63:
            raise IstioConfigError(f"pools.{pool}: the Service name {name!r} is longer than 63 characters")
    if not re.fullmatch(r"[a-f0-9]{64}", opts.wasm_sha256):
        raise IstioConfigError("wasm_sha256: 64 lower-case hex digits (sha256sum of the module, or the image digest for oci://)")
    if not re.match(r"^(oci|https?|file)://", opts.wasm_url):
        raise IstioConfigError(f"wasm_url: {opts.wasm_url!r} must start with oci://, https://, http:// or file://")


# -- the parts: envoy_resources' decisions in Istio's vocabulary, release-independent -----------


def envoy_form(policy: Policy) -> MeshListener:
    """The plain-Envoy listener whose routes the VirtualService translates. Hosts, ports and the
    module path are placeholders: only the route table's shape is read. A pool with `spill_to`
    has its failover pool behind it as in plain Envoy (the pools' EnvoyFilter's aggregate cluster
    puts the spill pool's cluster after the pool's), so its hedges count that priority too; for
    any other pool a DestinationRule cannot add another Service's endpoints, so hedges go to the
    pool's other replicas only (docs/replicas.md, "Istio")."""
    return MeshListener(
        listen_host="0.0.0.0", listen_port=0, admin_port=0, wasm_path=Path("infermesh.wasm"),
        filter_config=policy.filter_config(),
        # every pool has both fronts here, and its replicas (they count the attempts of a hedge)
        pools=[PoolEndpoint.of(name, [("0.0.0.0", 1, 2)] * p.replicas) for name, p in policy.pools.items()],
        default_pool=policy.default_pool,
        routing=Routing.from_policy(policy),
        failover=policy.failover(),
        spill_levels=policy.spill_levels(),
    )


def _method_regex(method: str) -> str:
    """`exact` with `ignore_case` (Istio's StringMatch has no ignore_case) as an RE2 pattern that
    folds ASCII case only, as the filter's comparison does."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else re.escape(c) for c in method)


def _string_match(sm: dict) -> dict | None:
    if "safe_regex" in sm:
        return {"regex": sm["safe_regex"]["regex"]}
    if sm.get("ignore_case"):
        return None
    kind, = (k for k in ("exact", "prefix") if k in sm)
    return {kind: sm[kind]}


def http_match(match: dict) -> dict | None:
    """An Envoy RouteMatch as an Istio HTTPMatchRequest ({}: every request); None when Istio
    cannot say it (two conditions on one header: a VirtualService match keys them by name)."""
    out: dict[str, Any] = {}
    if "path" in match:
        out["uri"] = {"exact": match["path"]}
    elif "safe_regex" in match:
        out["uri"] = {"regex": match["safe_regex"]["regex"]}  # istiod: Envoy's safe_regex, the path without the query
    elif match.get("prefix", "/") != "/":
        out["uri"] = {"prefix": match["prefix"]}
    headers: dict[str, dict] = {}
    without: dict[str, dict] = {}
    for h in match.get("headers", []):
        name = h["name"]
        if name in headers or name in without or (name == ":method" and "method" in out):
            return None
        if name == ":method":
            sm = h["string_match"]
            out["method"] = {"regex": _method_regex(sm["exact"])} if sm.get("ignore_case") else _string_match(sm)
        elif "present_match" in h:
            # An empty StringMatch is Istio's presence match; under withoutHeaders, absence.
            (headers if h["present_match"] else without)[name] = {}
        else:
            sm = _string_match(h["string_match"])
            if sm is None:
                return None
            headers[name] = sm
    if headers:
        out["headers"] = headers
    if without:
        out["withoutHeaders"] = without
    return out


def _route_part(r: dict, pools: dict[str, tuple[str, bool]]) -> dict | None:
    """One Envoy route as {pool, grpc, wasm, http}: `http` is the VirtualService HTTPRoute
    without its destination (the pool's Service, named per release, and its port)."""
    match = http_match(r["match"])
    if match is None:
        return None
    pool, grpc = pools[r["route"]["cluster"]]
    retry = r["route"]["retry_policy"]
    http: dict[str, Any] = {"name": r["name"], **({"match": [match]} if match else {})}
    # Istio's `add` is Envoy's APPEND_IF_EXISTS_OR_ADD, `set` its OVERWRITE_IF_EXISTS_OR_ADD: each
    # header keeps the plain-Envoy route's action (an overwrite first looks the header up).
    request: dict[str, dict] = {}
    for h in r.get("request_headers_to_add", []):
        op = "add" if h.get("append_action") == "APPEND_IF_EXISTS_OR_ADD" else "set"
        request.setdefault(op, {})[h["header"]["key"]] = h["header"]["value"]
    # The replicas' load reports are Envoy's alone (the plain-Envoy route table removes them on
    # its virtual host; the router reads them before either removal).
    http["headers"] = {**({"request": request} if request else {}), "response": {"remove": [ORCA_HEADER]}}
    # No route timeout (a streamed completion may run for minutes) is Istio's default; istiod's
    # validation refuses an explicit "0s" (durations must be >= 1ms), so the field stays out.
    if r["route"]["timeout"] != "0s":
        http["timeout"] = r["route"]["timeout"]
    http["retries"] = {"attempts": retry["num_retries"]}
    if retry["num_retries"]:  # attempts 0: Istio emits no retry policy at all (the patch adds it)
        http["retries"] |= {"retryOn": retry["retry_on"], **({"perTryTimeout": retry["per_try_timeout"]} if "per_try_timeout" in retry else {})}
    return {"pool": pool, "grpc": grpc, "wasm": WASM_FILTER not in r.get("typed_per_filter_config", {}), "http": http,
            "envoyRoute": envoy_route_patch(r["route"])}


def envoy_route_patch(action: dict) -> dict:
    """What the VirtualService cannot say of a route's retries, as an HTTP_ROUTE MERGE: the
    whole plain-Envoy retry policy (previous_priorities with its update frequency, the host
    selection attempts, the back-off's maximum; with a deadline the per-try timeout even where
    Istio drops the policy, at 0 attempts) and the hedge policy. Not the previous_hosts predicate
    where Istio emits its own (any attempts): a MERGE appends lists, and one is enough."""
    retry = copy.deepcopy(action["retry_policy"])
    if retry["num_retries"]:
        del retry["retry_host_predicate"]
    out: dict[str, Any] = {"retry_policy": retry}
    if "hedge_policy" in action:
        out["hedge_policy"] = copy.deepcopy(action["hedge_policy"])
    return {"route": out}


def route_parts(policy: Policy) -> list[dict]:
    """The VirtualService's routes, in the order of the plain-Envoy route table.

    A route Istio cannot express ends the list with a catch-all pair that runs the filter (it
    decides with every rule, so the first match still wins), as the plain-Envoy table does for
    a rule only the filter can judge. Where no route runs the filter, the pool-header routes are
    left out: with native rules the early header mutation removes a client's pool header and
    nothing sets one before routing, so no request can reach them, and each would cost every
    request its header lookups (docs/filter-benchmark.md, the Istio header-only form)."""
    m = envoy_form(policy)
    pools = {cluster_name(p, grpc): (p, grpc) for p in policy.pools for grpc in (False, True)}
    out: list[tuple[bool, dict]] = []  # (the route matches on the pool header, its part)
    for r in routes(m):
        if is_not_found(r):
            break  # the edge's 404 (`not_found_part`), after the routes
        part = _route_part(r, pools)
        if part is None:
            base = r["name"].removesuffix("-grpc").removeprefix("rule-")
            catch_all = [{"name": f"filter-{base}{suffix}", "match": match,
                          "route": {"cluster": cluster_name(policy.default_pool, grpc), "timeout": "0s", "retry_policy": retry_policy()}}
                         for suffix, grpc, match in (("-grpc", True, {"prefix": "/", "headers": [GRPC_CONTENT_TYPE]}),
                                                     ("", False, {"prefix": "/"}))]
            out += [(False, _route_part(c, pools)) for c in edge_routes(catch_all, m.public_paths)]
            break
        out.append((on_pool_header(r), part))
    if uses_native_rules(m) and not any(part["wasm"] for on_pool_header, part in out if not on_pool_header):
        out = [x for x in out if not x[0]]
    merged: list[dict] = []
    for _, part in out:  # a route narrowed to several path patterns: one HTTPRoute, one match each
        if merged and merged[-1]["http"]["name"] == part["http"]["name"]:
            merged[-1]["http"]["match"] += part["http"]["match"]
        else:
            merged.append(part)
    return merged


def not_found_part() -> dict:
    """The VirtualService's last route: plain Envoy's `not_found_route`, Envoy's JSON 404 for any
    path the edge does not serve (the filter turned off on it in the EnvoyFilter form)."""
    return {"name": NOT_FOUND_ROUTE, "directResponse": {"status": 404, "body": {"string": NOT_FOUND_BODY}},
            "headers": {"response": {"set": {"content-type": "application/json"}}}}


def traffic_policy() -> dict:
    """envoy_resources' pool limits and outlier detection as a DestinationRule trafficPolicy.
    5xx counting off (`consecutive5xxErrors: 0`) and gateway errors unset (off): a sidecar
    answering 429/503 is shedding on purpose."""
    lim = POOL_LIMITS
    return {
        "connectionPool": {
            "tcp": {"maxConnections": lim.max_connections, "connectTimeout": lim.connect_timeout},
            "http": {"http1MaxPendingRequests": lim.max_pending_requests, "http2MaxRequests": lim.max_requests, "maxRetries": lim.max_retries},
        },
        "outlierDetection": {
            "splitExternalLocalOriginErrors": True,
            "consecutiveLocalOriginFailures": lim.consecutive_local_origin_failures,
            "consecutive5xxErrors": 0,
            "interval": lim.ejection_interval,
            "baseEjectionTime": lim.base_ejection_time,
            "maxEjectionPercent": lim.max_ejection_percent,
        },
    }


def chart_parts(policy: Policy) -> dict:
    """Everything the Istio objects take from the policy, with no release, namespace or port in
    it: the chart's `generated` values (without the policy digest) and what resources() builds on.

        defaultPool   the default class's pool (the front Service selects its pods)
        pools         per pool: replicas, GPU, the model ladder's names, whether it has local models
        filter        form (EnvoyFilter | WasmPlugin), the Wasm filter config without the
                      module's URL and digest and without a failure policy, the HCM patch that
                      strips client x-infermesh-* headers before routing (native rules only)
        routes        the VirtualService's routes: {pool, grpc, wasm (the filter runs), http,
                      envoyRoute (the pools' EnvoyFilter's HTTP_ROUTE patch: retries, hedging)}
        edge          paths: the only paths any route serves (envoy_resources.EDGE_PATHS; the
                      gateway's AuthorizationPolicy denies the others, the pools' admits only
                      these from allowedNamespaces); notFound: the last route, a JSON 404
        routeSettings what every route gets in the EnvoyFilter form (the body buffer)
        wasmOff       the per-route config that turns the filter off
        trafficPolicy the DestinationRules' connection limits and outlier detection
        poolCluster   the pools' EnvoyFilter's CLUSTER patch: the load-balancing policy
        retryBudget   the plain-Envoy clusters' retry budget (a circuit-breaker threshold's)
        spill         per pool with `when_degraded.spill_to`: {to (the spill pool), atLevel,
                      cluster: {http, grpc} (the CLUSTER MERGE of its two clusters: the state
                      endpoint's health check from atLevel on, panic mode back on at 1 %)}
        spillCluster  the aggregate cluster of a spilling pool's front, without its name and
                      its two clusters (the pool's, then the spill pool's; release-dependent)
    """
    check_policy(policy)
    m = envoy_form(policy)
    native = uses_native_rules(m)
    # No probe clusters here: their names hold the release and namespace (plugin_config below,
    # the chart's filter.yaml adds the same). The filter's degraded_routing lists only pools that
    # shed; spill is Envoy's (the `spill` parts: health check and aggregate cluster).
    wasm = wasm_filter_config(policy.filter_config(probe_clusters={}), remote_code("", ""))
    del wasm["config"]["failure_policy"]
    return {
        "defaultPool": policy.default_pool,
        "pools": {name: {"replicas": p.replicas, "gpu": {"type": p.gpu.type, "count": p.gpu.count},
                         "models": [x.name for x in p.models], "localModels": any(x.path is None for x in p.models)}
                  for name, p in sorted(policy.pools.items())},
        "filter": {
            # Only an EnvoyFilter can set allow_on_headers_stop_iteration (body rules) and names
            # the filter itself, so routes can turn it off (a WasmPlugin's name in the chain is
            # Istio's own and changes between versions).
            "form": "EnvoyFilter" if policy.needs_body or native else "WasmPlugin",
            "wasm": wasm,
            "earlyHeaderMutation": copy.deepcopy(STRIP_CLIENT_HEADERS) if native else [],
        },
        "routes": route_parts(policy),
        "edge": {"paths": list(m.public_paths), "notFound": not_found_part()},
        "routeSettings": {"per_request_buffer_limit_bytes": REQUEST_BUFFER_LIMIT_BYTES} if policy.needs_body else {},
        "wasmOff": copy.deepcopy(WASM_OFF[WASM_FILTER]),
        "trafficPolicy": traffic_policy(),
        "poolCluster": {"load_balancing_policy": WEIGHTED_ROUND_ROBIN.policy()},
        "retryBudget": circuit_breakers(POOL_LIMITS)["thresholds"][0]["retry_budget"],
        "spill": spill_parts(policy),
        "spillCluster": copy.deepcopy(SPILL_CLUSTER),
    }


SPILL_PANIC_THRESHOLD = 1
"""healthy_panic_threshold (%) of a spilling pool's clusters. Istio sets 0 (panic off) where
outlier detection is on; then, with every replica failing the state health check, the filter's
probe through `outbound|PORT||HOST` would find no host and both pools down would fail every
request. 1 %: panic (every host, healthy or not) only once no replica is in rotation (fewer than
1 in 100), which is exactly when the aggregate cluster sends the pool nothing unless the spill pool
is out too. Envoy rounds the percentage to an integer: 1 is the least that is not off."""

SPILL_CLUSTER = {
    "connect_timeout": POOL_LIMITS.connect_timeout,
    "lb_policy": "CLUSTER_PROVIDED",
    "cluster_type": {"name": "envoy.clusters.aggregate",
                     "typed_config": {"@type": "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig"}},
}
"""A spilling pool's aggregate cluster, less its name and clusters: Envoy balances over the
priorities of the two clusters as over one cluster's (the pool's at priority 0, the spill pool's
next, with the overprovisioning factor 1.4) and picks the host with the chosen cluster's own load
balancer; connections, limits and stats are the chosen cluster's, except max_retries, which the
router takes from the aggregate too (pools_envoy_filter gives it the pools' threshold)."""


def spill_parts(policy: Policy) -> dict:
    """Per pool with `when_degraded.spill_to`: the spill pool, the level, and the CLUSTER MERGE
    of its HTTP and gRPC clusters (envoy_resources' state health checks, panic mode at 1 %)."""
    levels = policy.spill_levels()
    return {pool: {"to": to, "atLevel": levels[pool],
                   "cluster": {front: {"health_checks": health_checks(grpc, below_level=levels[pool]),
                                       "common_lb_config": common_lb_config(SPILL_PANIC_THRESHOLD)}
                               for front, grpc in (("http", False), ("grpc", True))}}
            for pool, to in sorted(policy.failover().items())}


def go_json(value: Any) -> str:
    """`value` as Helm's toJson writes it (Go's encoding/json: keys sorted, no spaces, <, > and &
    escaped, numbers as float64), so a digest taken here equals one the chart takes."""
    def number(x: int | float) -> str:
        if isinstance(x, int) or (x.is_integer() and abs(x) < 1e21):
            return str(int(x))
        if 1e-6 <= abs(x) < 1e21:
            return format(decimal.Decimal(repr(x)), "f")
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(x))

    def enc(v: Any) -> str:
        if v is None or isinstance(v, (bool, str)):
            return json.dumps(v, ensure_ascii=False)
        if isinstance(v, (int, float)):
            return number(v)
        if isinstance(v, dict):
            return "{" + ",".join(f"{enc(str(k))}:{enc(v[k])}" for k in sorted(v, key=str)) + "}"
        return "[" + ",".join(enc(x) for x in v) + "]"

    out = enc(value)
    for c, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        out = out.replace(c, esc)
    return out


def policy_digest(raw_policy: dict) -> str:
    """SHA-256 of the policy as Helm sees it (`sha256sum (toJson .Values.policy)`): the chart
    refuses generated values whose policy was edited after they were written."""
    return hashlib.sha256(go_json(raw_policy).encode()).hexdigest()


def helm_values(policy: Policy, raw_policy: dict) -> dict:
    """The chart values for a policy: the policy as written, and what the chart takes from the
    policy model (`infermesh policy render POLICY helm-values`)."""
    return {"policy": raw_policy, "generated": {"policySha256": policy_digest(raw_policy), **chart_parts(policy)}}


# -- the objects: the parts, with names, ports and the module's location added -----------------
# (charts/infermesh/templates assemble the same parts the same way.)


def _meta(name: str, namespace: str, opts: IstioOptions, extra_labels: dict[str, str] | None = None) -> dict:
    base = {"app.kubernetes.io/name": "infermesh", "app.kubernetes.io/instance": opts.name}
    return {"name": name, "namespace": namespace, "labels": base | (extra_labels or {})}


def _service(opts: IstioOptions, name: str, selector: dict[str, str], extra_labels: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, opts.namespace, opts, extra_labels),
        "spec": {
            "selector": selector,
            # appProtocol tells Istio the protocol without relying on port names.
            "ports": [
                {"name": "http", "port": opts.http_port, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"},
                {"name": "grpc", "port": opts.grpc_port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
            ],
        },
    }


def services(parts: dict, opts: IstioOptions) -> list[dict]:
    """The front Service, then one Service per pool.

    The front Service is the name clients call; the VirtualService decides the pool. It selects
    the default pool's pods, so a caller whose proxy applies no route lands where a request
    without a pool header lands in plain Envoy.
    """
    out = [_service(opts, opts.name, labels(opts, parts["defaultPool"]), {"app.kubernetes.io/component": "front"})]
    for pool in parts["pools"]:
        out.append(_service(opts, pool_service_name(opts, pool), labels(opts, pool),
                            {"app.kubernetes.io/component": "sidecar", "infermesh.io/pool": pool}))
    return out


def http_routes(parts: dict, opts: IstioOptions) -> list[dict]:
    """The VirtualService's routes: each route part with its pool's Service and port. Route
    names are envoy_resources' (`class-pool-POOL`, `rule-RULE`, `filter-RULE`, `default-pool`),
    `-grpc` marking the gRPC twin, which goes to the pool's gRPC port."""
    out = []
    for part in parts["routes"]:
        port = opts.grpc_port if part["grpc"] else opts.http_port
        dest = {"destination": {"host": opts.fqdn(pool_service_name(opts, part["pool"])), "port": {"number": port}}}
        out.append(copy.deepcopy(part["http"]) | {"route": [dest]})
    return out + [copy.deepcopy(parts["edge"]["notFound"])]


def pool_thresholds(parts: dict, opts: IstioOptions) -> list[dict]:
    """The pool clusters' circuit-breaker thresholds as istiod builds them from the
    DestinationRule's connectionPool (values overrides included), plus the retry budget: a
    threshold list replaces Istio's (Envoy reads only the first threshold of a priority)."""
    pool = _merged(parts["trafficPolicy"], opts.traffic_policy)["connectionPool"]
    return [{"max_connections": pool["tcp"]["maxConnections"], "max_pending_requests": pool["http"]["http1MaxPendingRequests"],
             "max_requests": pool["http"]["http2MaxRequests"], "max_retries": pool["http"]["maxRetries"],
             "retry_budget": copy.deepcopy(parts["retryBudget"]), "track_remaining": True}]


def outbound_cluster(opts: IstioOptions, pool: str, grpc: bool = False) -> str:
    """The Envoy cluster Istio gives a pool's port: `outbound|PORT||HOST`."""
    return f"outbound|{opts.grpc_port if grpc else opts.http_port}||{opts.fqdn(pool_service_name(opts, pool))}"


def spill_cluster_name(opts: IstioOptions, pool: str, grpc: bool = False) -> str:
    """A spilling pool's aggregate cluster of one front: `infermesh-spill|PORT||HOST` (an ADDed
    cluster: Istio applies no CLUSTER MERGE to it, though its name parses as the pool's)."""
    return "infermesh-spill" + outbound_cluster(opts, pool, grpc).removeprefix("outbound")


def spill_clusters(parts: dict, opts: IstioOptions) -> list[dict]:
    """Per spilling pool and front, its aggregate cluster: the pool's Istio cluster, then the
    spill pool's; the pools' circuit-breaker threshold (the router counts retries and hedges
    against the aggregate's max_retries as well, Envoy's default 3 otherwise)."""
    threshold = pool_thresholds(parts, opts)
    if not opts.retry_budget:
        del threshold[0]["retry_budget"]
    out = []
    for pool, spill in parts["spill"].items():
        for grpc in (False, True):
            c = {"name": spill_cluster_name(opts, pool, grpc), **copy.deepcopy(parts["spillCluster"])}
            c["cluster_type"]["typed_config"]["clusters"] = [outbound_cluster(opts, pool, grpc), outbound_cluster(opts, spill["to"], grpc)]
            c["circuit_breakers"] = {"thresholds": copy.deepcopy(threshold)}
            out.append(c)
    return out


def pools_envoy_filter(parts: dict, opts: IstioOptions) -> dict:
    """The pools' EnvoyFilter, in the proxies that route (the filter's): per pool its clusters'
    load-balancing policy (client-side weighted round robin on the replicas' ORCA reports: a
    DestinationRule's loadBalancer has no such choice) and the retry budget (its connectionPool
    has none); per route the retry and hedge policy the VirtualService cannot say. Per pool with
    `when_degraded.spill_to` (Envoy spills, not the filter): the state endpoint's health check on
    its two clusters (`port_number` picks the front), an aggregate cluster per front, and its
    routes sent to that aggregate (the VirtualService can only name the pool's Service)."""
    context = "GATEWAY" if opts.attach_to == "gateway" else "SIDECAR_OUTBOUND"
    patches: list[dict] = []
    for pool in parts["pools"]:
        match = {"context": context, "cluster": {"service": opts.fqdn(pool_service_name(opts, pool))}}
        patches.append({"applyTo": "CLUSTER", "match": match, "patch": {"operation": "MERGE", "value": copy.deepcopy(parts["poolCluster"])}})
        if opts.retry_budget:
            patches.append({"applyTo": "CLUSTER", "match": copy.deepcopy(match), "patch": {
                "operation": "MERGE_AND_REPLACE_LIST", "value": {"circuit_breakers": {"thresholds": pool_thresholds(parts, opts)}}}})
        if pool in parts["spill"]:
            for front, port in (("http", opts.http_port), ("grpc", opts.grpc_port)):
                patches.append({"applyTo": "CLUSTER", "match": {"context": context, "cluster": {**match["cluster"], "portNumber": port}},
                                "patch": {"operation": "MERGE", "value": copy.deepcopy(parts["spill"][pool]["cluster"][front])}})
    for c in spill_clusters(parts, opts):
        patches.append({"applyTo": "CLUSTER", "match": {"context": context}, "patch": {"operation": "ADD", "value": c}})
    for route in parts["routes"]:
        value = copy.deepcopy(route["envoyRoute"])
        if route["pool"] in parts["spill"]:
            value["route"]["cluster"] = spill_cluster_name(opts, route["pool"], route["grpc"])
        patches.append({"applyTo": "HTTP_ROUTE",
                        "match": {"context": context, "routeConfiguration": {"vhost": {"route": {"name": route["http"]["name"]}}}},
                        "patch": {"operation": "MERGE", "value": value}})
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": _meta(f"{opts.name}-pools", opts.filter_namespace, opts),
        "spec": {"workloadSelector": {"labels": dict(opts.filter_selector)}, "configPatches": patches},
    }


def virtual_services(parts: dict, opts: IstioOptions) -> list[dict]:
    """The mesh's VirtualService (the front Service's name), and one for the gateways if any.

    Two objects because Istio refuses a wildcard host on a VirtualService bound to the mesh.
    """
    def vs(name: str, hosts: list[str], gateways: list[str]) -> dict:
        return {
            "apiVersion": "networking.istio.io/v1",
            "kind": "VirtualService",
            "metadata": _meta(name, opts.namespace, opts),
            "spec": {"hosts": hosts, "gateways": gateways, "http": http_routes(parts, opts)},
        }

    out = [vs(opts.name, [opts.fqdn(opts.name)], ["mesh"])]
    if opts.gateways:
        out.append(vs(f"{opts.name}-ingress", list(opts.hosts), list(opts.gateways)))
    return out


def _merged(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base` map by map (Helm's mergeOverwrite)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def destination_rules(parts: dict, opts: IstioOptions) -> list[dict]:
    out = []
    for pool in parts["pools"]:
        name = pool_service_name(opts, pool)
        out.append({
            "apiVersion": "networking.istio.io/v1",
            "kind": "DestinationRule",
            "metadata": _meta(name, opts.namespace, opts, {"infermesh.io/pool": pool}),
            "spec": {"host": opts.fqdn(name), "trafficPolicy": _merged(parts["trafficPolicy"], opts.traffic_policy)},
        })
    return out


def filter_object_name(opts: IstioOptions) -> str:
    return f"{opts.name}-filter"


def filter_chain_name(opts: IstioOptions) -> str:
    """The EnvoyFilter form's name for the filter in the chain (and of its extension config)."""
    return f"{opts.filter_namespace}.{filter_object_name(opts)}"


def probe_cluster(opts: IstioOptions, pool: str) -> str:
    """The Envoy cluster Istio gives a pool's HTTP port: `outbound|PORT||HOST` (the filter's
    state probe calls it). For a pool that also spills, the cluster health-checks the state: with
    every replica out of rotation its panic threshold (SPILL_PANIC_THRESHOLD) still lets the probe
    reach them; while some are in, the probe reaches those only."""
    return outbound_cluster(opts, pool)


def plugin_config(parts: dict, opts: IstioOptions) -> dict:
    """The filter's own JSON config (Policy.filter_config()), as the Wasm filter carries it, with
    the probe cluster of each pool degraded-mode routing watches."""
    cfg = json.loads(parts["filter"]["wasm"]["config"]["configuration"]["value"])
    for pool, p in cfg.get("degraded_routing", {}).get("pools", {}).items():
        p["probe_cluster"] = probe_cluster(opts, pool)
    return cfg


def wasm_plugin(parts: dict, opts: IstioOptions) -> dict:
    """The filter as a WasmPlugin: policies whose rules decide on headers and that the filter
    decides on every request (native rules off: trusted sources)."""
    spec: dict = {
        "selector": {"matchLabels": dict(opts.filter_selector)},
        "url": opts.wasm_url,
        "sha256": opts.wasm_sha256,
        "imagePullPolicy": opts.image_pull_policy,
        **({"imagePullSecret": opts.image_pull_secret} if opts.image_pull_secret else {}),
        "pluginName": "infermesh",
        "failStrategy": opts.fail_strategy,
        "type": "HTTP",
        # No phase: Istio then inserts it after authentication and authorization (before its own
        # stats, fault and CORS filters), so a request that is refused anyway is never classified.
        "pluginConfig": plugin_config(parts, opts),
    }
    if opts.attach_to == "sidecar":
        spec["match"] = [{"mode": "CLIENT"}]
    return {
        "apiVersion": "extensions.istio.io/v1alpha1",
        "kind": "WasmPlugin",
        "metadata": _meta(filter_object_name(opts), opts.filter_namespace, opts),
        "spec": spec,
    }


def wasm_extension_config(parts: dict, opts: IstioOptions) -> dict:
    """The Wasm filter the EnvoyFilter delivers: envoy_resources' filter with remote code, which
    the Istio agent fetches (HTTP or OCI), checks against the sha256 and hands Envoy as a file."""
    wasm = copy.deepcopy(parts["filter"]["wasm"])
    wasm["config"]["failure_policy"] = "FAIL_OPEN" if opts.fail_strategy == "FAIL_OPEN" else "FAIL_CLOSED"
    cfg = plugin_config(parts, opts)
    if "degraded_routing" in cfg:  # written again, as the chart's toJson writes it
        wasm["config"]["configuration"]["value"] = go_json(cfg)
    remote = wasm["config"]["vm_config"]["code"]["remote"]
    remote["http_uri"]["uri"], remote["sha256"] = opts.wasm_url, opts.wasm_sha256
    if opts.wasm_url.startswith("file://"):  # on the proxy's disk: Envoy reads it (the agent would refuse it)
        wasm["config"]["vm_config"]["code"] = local_code(opts.wasm_url.removeprefix("file://"))
    return wasm


def envoy_filter(parts: dict, opts: IstioOptions) -> dict:
    """The filter as an EnvoyFilter, with what the VirtualService cannot say.

    The Wasm filter config as an extension config (ECDS, so the agent can fetch the module); the
    filter itself, inserted before the router and pointing at that config; with native rules,
    the HCM's early header mutation that strips client x-infermesh-* headers before a route is
    chosen; and per route, the body buffer (body rules) and, on natively decided routes, the
    filter turned off.
    """
    context = "GATEWAY" if opts.attach_to == "gateway" else "SIDECAR_OUTBOUND"
    name = filter_chain_name(opts)
    hcm_match = {"context": context, "listener": {"filterChain": {"filter": {"name": HCM}}}}
    patches: list[dict] = [
        {"applyTo": "EXTENSION_CONFIG",
         "patch": {"operation": "ADD", "value": {"name": name, "typed_config": wasm_extension_config(parts, opts)}}},
        {"applyTo": "HTTP_FILTER",
         "match": {"context": context, "listener": {"filterChain": {"filter": {"name": HCM, "subFilter": {"name": "envoy.filters.http.router"}}}}},
         "patch": {"operation": "INSERT_BEFORE", "value": {
             "name": name,
             # initial_fetch_timeout 0s: a listener waits for the filter instead of serving
             # its first requests without it.
             "config_discovery": {"config_source": {"ads": {}, "initial_fetch_timeout": "0s"},
                                  "type_urls": [parts["filter"]["wasm"]["@type"]]}}}},
    ]
    if parts["filter"]["earlyHeaderMutation"]:
        patches.append({"applyTo": "NETWORK_FILTER", "match": hcm_match, "patch": {"operation": "MERGE", "value": {
            "typed_config": {"@type": HCM_TYPE_URL, "early_header_mutation_extensions": copy.deepcopy(parts["filter"]["earlyHeaderMutation"])}}}})
    for route in parts["routes"]:
        value = copy.deepcopy(parts["routeSettings"])
        if not route["wasm"]:
            value["typed_per_filter_config"] = {name: copy.deepcopy(parts["wasmOff"])}
        if value:
            patches.append({"applyTo": "HTTP_ROUTE",
                            "match": {"context": context, "routeConfiguration": {"vhost": {"route": {"name": route["http"]["name"]}}}},
                            "patch": {"operation": "MERGE", "value": value}})
    # The edge's 404: never classified, buffered or shed, as in plain Envoy.
    patches.append({"applyTo": "HTTP_ROUTE",
                    "match": {"context": context, "routeConfiguration": {"vhost": {"route": {"name": parts["edge"]["notFound"]["name"]}}}},
                    "patch": {"operation": "MERGE", "value": {"typed_per_filter_config": {name: copy.deepcopy(parts["wasmOff"])}}}})
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": _meta(filter_object_name(opts), opts.filter_namespace, opts),
        "spec": {"workloadSelector": {"labels": dict(opts.filter_selector)}, "configPatches": patches},
    }


def edge_authorization_policies(parts: dict, opts: IstioOptions) -> list[dict]:
    """With the routes bound to a gateway and the filter in it (`attach_to: gateway`; then
    `filter_namespace`/`filter_selector` are the gateway's pods): a DENY in the gateway for every
    path of the VirtualService's hosts that the edge does not serve. Istio's RBAC runs before the
    routes, so the gateway answers those 403; the VirtualService's own 404 is for mesh clients
    and any proxy this policy does not select. Scoped to the hosts: a gateway shared with other
    applications keeps serving theirs (with `hosts: ["*"]` it covers every host of those pods)."""
    if not opts.gateways or opts.attach_to != "gateway":
        return []
    return [{
        "apiVersion": "security.istio.io/v1",
        "kind": "AuthorizationPolicy",
        "metadata": _meta(f"{opts.name}-edge", opts.filter_namespace, opts),
        "spec": {"selector": {"matchLabels": dict(opts.filter_selector)}, "action": "DENY",
                 "rules": [{"to": [{"operation": {"hosts": list(opts.hosts), "notPaths": list(parts["edge"]["paths"])}}]}]},
    }]


def filter_object(parts: dict, opts: IstioOptions) -> dict:
    return envoy_filter(parts, opts) if parts["filter"]["form"] == "EnvoyFilter" else wasm_plugin(parts, opts)


def resources(policy: Policy, opts: IstioOptions) -> list[dict]:
    """Every object, in a stable order: Services, DestinationRules, VirtualServices, the filter,
    the pools' EnvoyFilter, the gateway's edge AuthorizationPolicy."""
    check(policy, opts)
    parts = chart_parts(policy)
    return [*services(parts, opts), *destination_rules(parts, opts), *virtual_services(parts, opts), filter_object(parts, opts),
            pools_envoy_filter(parts, opts), *edge_authorization_policies(parts, opts)]


def module_sha256(path: Path) -> str:
    """The hex SHA-256 of a built module (what `wasm_sha256` pins for https:// and file:// URLs)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def render_yaml(policy: Policy, opts: IstioOptions) -> str:
    """Every object as one multi-document YAML stream (`kubectl apply -f -`)."""
    return yaml.safe_dump_all(resources(policy, opts), sort_keys=False, width=120)
