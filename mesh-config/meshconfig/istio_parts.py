"""The Istio objects' first job: what the policy model decides for Istio, release-independent.

Two kinds of decision, each made here and nowhere else:

- per policy, the typed parts (`IstioParts`, from `parts()`): envoy_resources' typed route table
  (`Route`) in Istio's vocabulary (per-pool header routes where some route runs the filter, native
  header-rule routes, the default; the edge's 404), the Wasm filter without the module's URL,
  digest and failure policy, the filter's form, the pool limits, the pools' CLUSTER and
  HTTP_ROUTE patches, spill. `IstioParts.values()` is the chart's `generated` values, written with
  the policy by `infermesh policy render POLICY helm-values` (files/default-generated.json for the
  bundled policy);
- per option of a release (`ISTIO_DECISIONS`): the Istio names of a pool's clusters
  (`outbound|PORT||HOST`, the spill aggregate's `infermesh-spill|PORT||HOST`), the patch context
  of each `attach_to`, the Wasm failure policy of each fail strategy, the default selector of the
  filter's proxies, the circuit-breaker threshold istiod builds from a DestinationRule, the
  module's code for a `file://` URL. The chart includes them as files/istio-decisions.json,
  which `python -m infermesh.meshconfig.istio_parts > charts/infermesh/files/istio-decisions.json`
  writes and charts/tests checks is current.

The chart's templates, the objects' one layout, take both and add only names, namespaces, ports
and where the module lives; istio.py (`infermesh policy render POLICY istio`) renders the chart
(docs/istio.md).
"""

from __future__ import annotations

import copy
import dataclasses
import decimal
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .envoy_resources import (
    GRPC_HEADER,
    NOT_FOUND_BODY,
    NOT_FOUND_ROUTE,
    ORCA_HEADER,
    POOL_LIMITS,
    REQUEST_BUFFER_LIMIT_BYTES,
    STRIP_CLIENT_HEADERS,
    WASM_FILTER,
    WASM_OFF,
    WEIGHTED_ROUND_ROBIN,
    HeaderCondition,
    MeshListener,
    PoolEndpoint,
    Retries,
    Route,
    RouteMatch,
    Routing,
    circuit_breakers,
    common_lb_config,
    edge_routes,
    health_checks,
    hedge_policy,
    local_code,
    remote_code,
    routes,
    uses_native_rules,
    wasm_filter_config,
)
from .policy import Policy
from .tracing import DECISION_TAGS


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


# -- per option of a release: the chart's files/istio-decisions.json ----------------------------

AttachTo = Literal["gateway", "sidecar"]
FailStrategy = Literal["FAIL_OPEN", "FAIL_CLOSE"]


@dataclass(frozen=True)
class IstioDecisions:
    """What an Istio object takes from a release's options, decided once. Cluster names are
    patterns with `{port}` and `{host}` (the Service's FQDN); `local_code` has `{path}`."""

    outbound_cluster: str = "outbound|{port}||{host}"
    """The Envoy cluster Istio gives a Service's port."""
    spill_cluster: str = "infermesh-spill|{port}||{host}"
    """A spilling pool's aggregate cluster of one front (an ADDed cluster: Istio applies no
    CLUSTER MERGE to it, though its name parses as the pool's)."""
    context: tuple[tuple[str, str], ...] = (("gateway", "GATEWAY"), ("sidecar", "SIDECAR_OUTBOUND"))
    """The EnvoyFilter patch context of each `attach_to`."""
    wasm_plugin_match: tuple[tuple[str, tuple[dict, ...]], ...] = (("gateway", ()), ("sidecar", ({"mode": "CLIENT"},)))
    """A WasmPlugin's `match` of each `attach_to` (none: every traffic of the gateway)."""
    failure_policy: tuple[tuple[str, str], ...] = (("FAIL_OPEN", "FAIL_OPEN"), ("FAIL_CLOSE", "FAIL_CLOSED"))
    """The Wasm filter's failure_policy (EnvoyFilter form) of each WasmPlugin failStrategy."""
    default_selector: tuple[tuple[str, str], ...] = (("istio", "ingress"),)
    """Labels of the filter's (and the ingress gateway's) pods when none are given: Istio's gateway
    chart labels its pods `istio: <release>`."""
    threshold_from_connection_pool: tuple[tuple[str, tuple[str, str]], ...] = (
        ("max_connections", ("tcp", "maxConnections")), ("max_pending_requests", ("http", "http1MaxPendingRequests")),
        ("max_requests", ("http", "http2MaxRequests")), ("max_retries", ("http", "maxRetries")))
    """The pool clusters' circuit-breaker threshold as istiod builds it from a DestinationRule's
    connectionPool; the pools' EnvoyFilter adds the retry budget and `threshold_set`."""
    threshold_set: tuple[tuple[str, bool], ...] = (("track_remaining", True),)
    local_scheme: str = "file://"
    """A module URL on the proxy's disk: Envoy reads it (the Istio agent fetches only http(s) and
    oci, and Envoy refuses a remote without a cluster), as Istio does for a WasmPlugin's."""

    def cluster(self, pattern: str, port: int, host: str) -> str:
        return pattern.replace("{port}", str(port)).replace("{host}", host)

    def context_of(self, attach_to: AttachTo) -> str:
        return dict(self.context)[attach_to]

    def threshold(self, connection_pool: dict, retry_budget: dict | None) -> dict:
        out = {k: connection_pool[a][b] for k, (a, b) in self.threshold_from_connection_pool}
        return out | ({"retry_budget": copy.deepcopy(retry_budget)} if retry_budget is not None else {}) | dict(self.threshold_set)

    def code(self, url: str, remote: dict) -> dict:
        """The filter's vm_config code for a module URL: `remote` (with the URL) or, for a file on
        the proxy's disk, a local file."""
        return local_code(url.removeprefix(self.local_scheme)) if url.startswith(self.local_scheme) else remote

    def values(self) -> dict:
        """As the chart reads them (files/istio-decisions.json)."""
        return {
            "outboundCluster": self.outbound_cluster,
            "spillCluster": self.spill_cluster,
            "context": dict(self.context),
            "wasmPluginMatch": {k: [dict(m) for m in v] for k, v in self.wasm_plugin_match},
            "failurePolicy": dict(self.failure_policy),
            "defaultSelector": dict(self.default_selector),
            "thresholdFromConnectionPool": {k: list(path) for k, path in self.threshold_from_connection_pool},
            "thresholdSet": dict(self.threshold_set),
            "localScheme": self.local_scheme,
            "localCode": local_code("{path}"),
        }


ISTIO_DECISIONS = IstioDecisions()


def decisions_file() -> str:
    """charts/infermesh/files/istio-decisions.json."""
    return json.dumps(ISTIO_DECISIONS.values(), indent=2) + "\n"


# -- per policy: the typed parts (the chart's `generated` values) --------------------------------


@dataclass(frozen=True)
class PoolPart:
    """What the chart's Deployments take from a pool."""

    replicas: int
    gpu_type: str | None
    gpu_count: int
    models: tuple[str, ...]
    local_models: bool
    """Some model has no path: an init container builds it."""

    def values(self) -> dict:
        return {"replicas": self.replicas, "gpu": {"type": self.gpu_type, "count": self.gpu_count},
                "models": list(self.models), "localModels": self.local_models}


@dataclass(frozen=True)
class FilterPart:
    form: Literal["EnvoyFilter", "WasmPlugin"]
    wasm: dict
    """The Wasm filter config without the module's URL and digest and without a failure policy."""
    early_header_mutation: list
    """The HCM patch that strips client x-infermesh-* headers before routing (native rules only)."""

    def values(self) -> dict:
        return {"form": self.form, "wasm": copy.deepcopy(self.wasm), "earlyHeaderMutation": copy.deepcopy(self.early_header_mutation)}


@dataclass(frozen=True)
class RoutePart:
    """One route of the VirtualService: `http` is its HTTPRoute without the destination (the
    pool's Service, named per release, and its port); `envoy_route` the pools' EnvoyFilter's
    HTTP_ROUTE MERGE of it (retries, hedging)."""

    pool: str
    grpc: bool
    wasm: bool
    """The filter runs on it (in the EnvoyFilter form it is turned off on the others)."""
    http: dict
    envoy_route: dict

    @property
    def name(self) -> str:
        return self.http["name"]

    def values(self) -> dict:
        return {"pool": self.pool, "grpc": self.grpc, "wasm": self.wasm, "http": copy.deepcopy(self.http),
                "envoyRoute": copy.deepcopy(self.envoy_route)}


@dataclass(frozen=True)
class SpillPart:
    """A pool with `when_degraded.spill_to`: the spill pool, the level, and per front (http,
    grpc) the CLUSTER MERGE of its cluster (the state health check, panic mode at 1 %)."""

    to: str
    at_level: int
    cluster: dict[str, dict]

    def values(self) -> dict:
        return {"to": self.to, "atLevel": self.at_level, "cluster": copy.deepcopy(self.cluster)}


@dataclass(frozen=True)
class IstioParts:
    """Everything the Istio objects take from the policy, with no release, namespace or port in it.

        default_pool   the default class's pool (the front Service selects its pods)
        pools          per pool: replicas, GPU, the model ladder's names, whether it has local models
        filter         form (EnvoyFilter | WasmPlugin), the Wasm filter, the early header mutation
        routes         the VirtualService's routes, in the order of the plain-Envoy route table
        edge_paths     the only paths any route serves (envoy_resources.EDGE_PATHS; the gateway's
                       AuthorizationPolicy denies the others, the pools' admits only these from
                       allowedNamespaces)
        not_found      the VirtualService's last route, a JSON 404
        route_settings what every route gets in the EnvoyFilter form (the body buffer)
        wasm_off       the per-route config that turns the filter off
        traffic_policy the DestinationRules' connection limits and outlier detection
        pool_cluster   the pools' EnvoyFilter's CLUSTER patch: the load-balancing policy
        retry_budget   the plain-Envoy clusters' retry budget (a circuit-breaker threshold's)
        spill          per pool with `when_degraded.spill_to`
        spill_cluster  the aggregate cluster of a spilling pool's front, without its name and its
                       two clusters (the pool's, then the spill pool's; release-dependent)
        tracing        the Telemetry resource's tracing, less its provider (the cluster's MeshConfig
                       names the collector): the policy's sampling and the filter's decision as
                       tags; empty with the policy's tracing off
    """

    default_pool: str
    pools: dict[str, PoolPart]
    filter: FilterPart
    routes: tuple[RoutePart, ...]
    edge_paths: tuple[str, ...]
    not_found: dict
    route_settings: dict
    wasm_off: dict
    traffic_policy: dict
    pool_cluster: dict
    retry_budget: dict
    spill: dict[str, SpillPart]
    spill_cluster: dict
    tracing: dict

    def values(self) -> dict:
        """The chart's `generated` values (without the policy digest)."""
        return {
            "defaultPool": self.default_pool,
            "pools": {name: p.values() for name, p in self.pools.items()},
            "filter": self.filter.values(),
            "routes": [r.values() for r in self.routes],
            "edge": {"paths": list(self.edge_paths), "notFound": copy.deepcopy(self.not_found)},
            "routeSettings": copy.deepcopy(self.route_settings),
            "wasmOff": copy.deepcopy(self.wasm_off),
            "trafficPolicy": copy.deepcopy(self.traffic_policy),
            "poolCluster": copy.deepcopy(self.pool_cluster),
            "retryBudget": copy.deepcopy(self.retry_budget),
            "spill": {pool: s.values() for pool, s in self.spill.items()},
            "spillCluster": copy.deepcopy(self.spill_cluster),
            "tracing": copy.deepcopy(self.tracing),
        }


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


def _string_match(h: HeaderCondition) -> dict | None:
    if h.kind == "regex":
        return {"regex": h.value}
    if h.ignore_case:
        return None
    return {h.kind: h.value}


def http_match(match: RouteMatch) -> dict | None:
    """A route's match as an Istio HTTPMatchRequest ({}: every request); None when Istio cannot
    say it (two conditions on one header: a VirtualService match keys them by name)."""
    out: dict[str, Any] = {}
    if match.path_kind == "exact":
        out["uri"] = {"exact": match.path}
    elif match.path_kind == "regex":
        out["uri"] = {"regex": match.path}  # istiod: Envoy's safe_regex, the path without the query
    elif match.path != "/":
        out["uri"] = {"prefix": match.path}
    headers: dict[str, dict] = {}
    without: dict[str, dict] = {}
    for h in match.headers:
        name = h.name
        if name in headers or name in without or (name == ":method" and "method" in out):
            return None
        if name == ":method":
            out["method"] = {"regex": _method_regex(h.value)} if h.ignore_case else _string_match(h)
        elif h.kind in ("present", "absent"):
            # An empty StringMatch is Istio's presence match; under withoutHeaders, absence.
            (headers if h.kind == "present" else without)[name] = {}
        else:
            sm = _string_match(h)
            if sm is None:
                return None
            headers[name] = sm
    if headers:
        out["headers"] = headers
    if without:
        out["withoutHeaders"] = without
    return out


def _route_part(r: Route) -> RoutePart | None:
    """One plain-Envoy route in Istio's vocabulary; None when Istio cannot say its match."""
    match = http_match(r.match)
    if match is None:
        return None
    http: dict[str, Any] = {"name": r.name, **({"match": [match]} if match else {})}
    # Istio's `add` is Envoy's APPEND_IF_EXISTS_OR_ADD, `set` its OVERWRITE_IF_EXISTS_OR_ADD: each
    # header keeps the plain-Envoy route's action (an overwrite first looks the header up).
    request: dict[str, dict] = {}
    for h in r.request_headers():
        request.setdefault("add" if h.append else "set", {})[h.key] = h.value
    # The replicas' load reports are Envoy's alone (the plain-Envoy route table removes them on
    # its virtual host; the router reads them before either removal); a route decided without the
    # filter also drops the sidecars' internal headers the filter would have read and stripped.
    remove = [ORCA_HEADER, *r.response_headers_to_remove()]
    http["headers"] = {**({"request": request} if request else {}), "response": {"remove": remove}}
    # No route timeout (a streamed completion may run for minutes) is Istio's default; istiod's
    # validation refuses an explicit "0s" (durations must be >= 1ms), so the field stays out.
    if r.timeout != "0s":
        http["timeout"] = r.timeout
    retries = r.retries
    http["retries"] = {"attempts": retries.num_retries}
    if retries.num_retries:  # attempts 0: Istio emits no retry policy at all (the patch adds it)
        http["retries"] |= {"retryOn": retries.retry_on,
                            **({"perTryTimeout": retries.per_try_timeout} if retries.per_try_timeout is not None else {})}
    return RoutePart(pool=r.pool, grpc=r.grpc, wasm=r.runs_filter, http=http, envoy_route=envoy_route_patch(r))


def envoy_route_patch(r: Route) -> dict:
    """What the VirtualService cannot say of a route's retries, as an HTTP_ROUTE MERGE: the
    whole plain-Envoy retry policy (previous_priorities with its update frequency, the host
    selection attempts, the back-off's maximum; with a deadline the per-try timeout even where
    Istio drops the policy, at 0 attempts) and the hedge policy. Not the previous_hosts predicate
    where Istio emits its own (any attempts): a MERGE appends lists, and one is enough."""
    out: dict[str, Any] = {"retry_policy": r.retries.envoy(previous_hosts=not r.retries.num_retries)}
    if r.hedges:
        out["hedge_policy"] = hedge_policy()
    return {"route": out}


def routes_of(policy: Policy) -> tuple[RoutePart, ...]:
    """The VirtualService's routes, in the order of the plain-Envoy route table.

    A route Istio cannot express ends the list with a catch-all pair that runs the filter (it
    decides with every rule, so the first match still wins), as the plain-Envoy table does for
    a rule only the filter can judge. Where no route runs the filter, the pool-header routes are
    left out: with native rules the early header mutation removes a client's pool header and
    nothing sets one before routing, so no request can reach them, and each would cost every
    request its header lookups (docs/filter-benchmark.md, the Istio header-only form)."""
    m = envoy_form(policy)
    out: list[tuple[bool, RoutePart]] = []  # (the route matches on the pool header, its part)
    for r in routes(m):  # (the edge's 404, `not_found_part`, comes after them)
        part = _route_part(r)
        if part is None:
            base = r.name.removesuffix("-grpc").removeprefix("rule-")
            catch_all = [Route(f"filter-{base}{suffix}", match, policy.default_pool, grpc, Retries())
                         for suffix, grpc, match in (("-grpc", True, RouteMatch(headers=(GRPC_HEADER,))), ("", False, RouteMatch()))]
            out += [(False, _route_part(c)) for c in edge_routes(catch_all, m.public_paths)]
            break
        out.append((r.on_pool_header, part))
    if uses_native_rules(m) and not any(part.wasm for on_pool_header, part in out if not on_pool_header):
        out = [x for x in out if not x[0]]
    merged: list[RoutePart] = []
    for _, part in out:  # a route narrowed to several path patterns: one HTTPRoute, one match each
        if merged and merged[-1].name == part.name:
            last = merged[-1]
            merged[-1] = dataclasses.replace(last, http=last.http | {"match": last.http["match"] + part.http["match"]})
        else:
            merged.append(part)
    return tuple(merged)


def route_parts(policy: Policy) -> list[dict]:
    """The routes as the chart's values hold them (`generated.routes`)."""
    return [r.values() for r in routes_of(policy)]




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


def parts(policy: Policy) -> IstioParts:
    """The policy's Istio parts (IstioParts)."""
    check_policy(policy)
    m = envoy_form(policy)
    native = uses_native_rules(m)
    # No probe clusters here: their names hold the release and namespace (the chart's filter.yaml
    # adds them). The filter's degraded_routing lists only pools that shed;
    # spill is Envoy's (the `spill` parts: health check and aggregate cluster).
    wasm = wasm_filter_config(policy.filter_config(probe_clusters={}), remote_code("", ""))
    del wasm["config"]["failure_policy"]
    return IstioParts(
        default_pool=policy.default_pool,
        pools={name: PoolPart(replicas=p.replicas, gpu_type=p.gpu.type, gpu_count=p.gpu.count, models=tuple(x.name for x in p.models),
                              local_models=any(x.path is None for x in p.models))
               for name, p in sorted(policy.pools.items())},
        # Only an EnvoyFilter can set allow_on_headers_stop_iteration (body rules) and names the
        # filter itself, so routes can turn it off (a WasmPlugin's name in the chain is Istio's own
        # and changes between versions).
        filter=FilterPart(form="EnvoyFilter" if policy.needs_body or native else "WasmPlugin", wasm=wasm,
                          early_header_mutation=copy.deepcopy(STRIP_CLIENT_HEADERS) if native else []),
        routes=routes_of(policy),
        edge_paths=tuple(m.public_paths),
        not_found=not_found_part(),
        route_settings={"per_request_buffer_limit_bytes": REQUEST_BUFFER_LIMIT_BYTES} if policy.needs_body else {},
        wasm_off=copy.deepcopy(WASM_OFF[WASM_FILTER]),
        traffic_policy=traffic_policy(),
        pool_cluster={"load_balancing_policy": WEIGHTED_ROUND_ROBIN.policy()},
        retry_budget=circuit_breakers(POOL_LIMITS)["thresholds"][0]["retry_budget"],
        spill=spill_parts(policy),
        spill_cluster=copy.deepcopy(SPILL_CLUSTER),
        tracing=telemetry_tracing(policy),
    )


def telemetry_tracing(policy: Policy) -> dict:
    """The tracing of the chart's Telemetry resource, as plain Envoy's HCM has it
    (tracing.hcm_tracing): the policy's sampling, the filter's decision as tags read from the
    request headers it wrote. istiod sets spawn_upstream_span itself on a gateway (a `router`
    proxy), so a hedge's attempts show as plain Envoy's do. Empty with the policy's tracing off."""
    if not policy.tracing.on:
        return {}
    return {"randomSamplingPercentage": policy.tracing.sample_ratio * 100,
            "customTags": {tag: {"header": {"name": header}} for tag, header in DECISION_TAGS.items()}}


def chart_parts(policy: Policy) -> dict:
    """The parts as the chart's `generated` values hold them (without the policy digest)."""
    return parts(policy).values()


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
router takes from the aggregate too (templates/pools-envoyfilter.yaml gives it the pools' threshold)."""


def spill_parts(policy: Policy) -> dict[str, SpillPart]:
    """Per pool with `when_degraded.spill_to`: the spill pool, the level, and the CLUSTER MERGE
    of its HTTP and gRPC clusters (envoy_resources' state health checks, panic mode at 1 %)."""
    levels = policy.spill_levels()
    return {pool: SpillPart(to=to, at_level=levels[pool],
                            cluster={front: {"health_checks": health_checks(grpc, below_level=levels[pool]),
                                             "common_lb_config": common_lb_config(SPILL_PANIC_THRESHOLD)}
                                     for front, grpc in (("http", False), ("grpc", True))})
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
    return {"policy": raw_policy, "generated": {"policySha256": policy_digest(raw_policy), **parts(policy).values()}}


if __name__ == "__main__":
    print(decisions_file(), end="")
