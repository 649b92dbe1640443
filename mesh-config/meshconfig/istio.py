"""The Istio objects' second job: the policy's parts (istio_parts.py) with a release's names,
namespaces, ports and the module's location, as Kubernetes objects.

    per pool      a Service (OpenAI HTTP front + gRPC) and a DestinationRule
    once          a front Service clients address, a VirtualService (and one for the ingress
                  gateways), and the filter: an EnvoyFilter when a rule reads the body or native
                  header rules decide some requests, a WasmPlugin otherwise; and the pools'
                  EnvoyFilter (`NAME-pools`): what a DestinationRule and a VirtualService cannot
                  say about many replicas (client-side weighted round robin on the replicas' ORCA
                  reports, the retry budget, hedging past a TTFT deadline; docs/replicas.md)

    infermesh policy render POLICY istio --wasm-url oci://… --wasm-sha256 HEX | kubectl apply -f -

Nothing is decided here: every value comes from the typed parts (`IstioParts`) or from
`ISTIO_DECISIONS` (cluster names, patch context, failure policy, default selector, thresholds,
`file://` code), both in istio_parts.py. The Helm chart (charts/infermesh) lays out the same
objects from the same two sources (its `generated` values and files/istio-decisions.json);
charts/tests proves the two layouts give the same objects (docs/istio.md).

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
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from infermesh.settings import GRPC_PORT, HTTP_PORT

from .istio_parts import (  # noqa: F401  (chart_parts, route_parts, helm_values, …: the CLI's and tests' names)
    ISTIO_DECISIONS,
    SPILL_PANIC_THRESHOLD,
    IstioConfigError,
    IstioParts,
    chart_parts,
    check_policy,
    go_json,
    helm_values,
    parts,
    policy_digest,
    route_parts,
)
from .policy import Policy

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


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
    http_port: int = HTTP_PORT
    """The sidecars' OpenAI HTTP front."""
    grpc_port: int = GRPC_PORT
    """The sidecars' gRPC front (infermesh.v1.Inference, grpc.health.v1)."""
    fail_strategy: Literal["FAIL_OPEN", "FAIL_CLOSE"] = "FAIL_OPEN"
    """FAIL_OPEN as in plain Envoy: a broken filter sends traffic to the default pool instead of
    failing every request (and, not loaded at all, leaves client-sent x-infermesh-* headers in)."""
    filter_namespace: str = "istio-ingress"
    """Namespace of the proxies that classify (a WasmPlugin/EnvoyFilter acts in its own namespace)."""
    filter_selector: dict[str, str] = field(default_factory=lambda: dict(ISTIO_DECISIONS.default_selector))
    """Labels of those proxies' pods (ISTIO_DECISIONS.default_selector)."""
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

    @property
    def context(self) -> str:
        """The EnvoyFilter patches' context."""
        return ISTIO_DECISIONS.context_of(self.attach_to)


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


# -- names: the release's -------------------------------------------------------------------------


def outbound_cluster(opts: IstioOptions, pool: str, grpc: bool = False) -> str:
    """The Envoy cluster Istio gives a pool's port."""
    return ISTIO_DECISIONS.cluster(ISTIO_DECISIONS.outbound_cluster, opts.grpc_port if grpc else opts.http_port,
                                   opts.fqdn(pool_service_name(opts, pool)))


def spill_cluster_name(opts: IstioOptions, pool: str, grpc: bool = False) -> str:
    """A spilling pool's aggregate cluster of one front."""
    return ISTIO_DECISIONS.cluster(ISTIO_DECISIONS.spill_cluster, opts.grpc_port if grpc else opts.http_port,
                                   opts.fqdn(pool_service_name(opts, pool)))


def probe_cluster(opts: IstioOptions, pool: str) -> str:
    """The Envoy cluster Istio gives a pool's HTTP port (the filter's state probe calls it). For
    a pool that also spills, the cluster health-checks the state: with every replica out of
    rotation its panic threshold (SPILL_PANIC_THRESHOLD) still lets the probe reach them; while
    some are in, the probe reaches those only."""
    return outbound_cluster(opts, pool)


def filter_object_name(opts: IstioOptions) -> str:
    return f"{opts.name}-filter"


def filter_chain_name(opts: IstioOptions) -> str:
    """The EnvoyFilter form's name for the filter in the chain (and of its extension config)."""
    return f"{opts.filter_namespace}.{filter_object_name(opts)}"


def _meta(name: str, namespace: str, opts: IstioOptions, extra_labels: dict[str, str] | None = None) -> dict:
    base = {"app.kubernetes.io/name": "infermesh", "app.kubernetes.io/instance": opts.name}
    return {"name": name, "namespace": namespace, "labels": base | (extra_labels or {})}


def _merged(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base` map by map (Helm's mergeOverwrite)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _route_match(opts: IstioOptions, route: str) -> dict:
    return {"context": opts.context, "routeConfiguration": {"vhost": {"route": {"name": route}}}}


# -- the objects ------------------------------------------------------------------------------------


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


def services(p: IstioParts, opts: IstioOptions) -> list[dict]:
    """The front Service, then one Service per pool.

    The front Service is the name clients call; the VirtualService decides the pool. It selects
    the default pool's pods, so a caller whose proxy applies no route lands where a request
    without a pool header lands in plain Envoy.
    """
    out = [_service(opts, opts.name, labels(opts, p.default_pool), {"app.kubernetes.io/component": "front"})]
    for pool in p.pools:
        out.append(_service(opts, pool_service_name(opts, pool), labels(opts, pool),
                            {"app.kubernetes.io/component": "sidecar", "infermesh.io/pool": pool}))
    return out


def http_routes(p: IstioParts, opts: IstioOptions) -> list[dict]:
    """The VirtualService's routes: each route part with its pool's Service and port. Route
    names are envoy_resources' (`class-pool-POOL`, `rule-RULE`, `filter-RULE`, `default-pool`),
    `-grpc` marking the gRPC twin, which goes to the pool's gRPC port."""
    out = []
    for route in p.routes:
        port = opts.grpc_port if route.grpc else opts.http_port
        dest = {"destination": {"host": opts.fqdn(pool_service_name(opts, route.pool)), "port": {"number": port}}}
        out.append(copy.deepcopy(route.http) | {"route": [dest]})
    return out + [copy.deepcopy(p.not_found)]


def virtual_services(p: IstioParts, opts: IstioOptions) -> list[dict]:
    """The mesh's VirtualService (the front Service's name), and one for the gateways if any.

    Two objects because Istio refuses a wildcard host on a VirtualService bound to the mesh.
    """
    def vs(name: str, hosts: list[str], gateways: list[str]) -> dict:
        return {
            "apiVersion": "networking.istio.io/v1",
            "kind": "VirtualService",
            "metadata": _meta(name, opts.namespace, opts),
            "spec": {"hosts": hosts, "gateways": gateways, "http": http_routes(p, opts)},
        }

    out = [vs(opts.name, [opts.fqdn(opts.name)], ["mesh"])]
    if opts.gateways:
        out.append(vs(f"{opts.name}-ingress", list(opts.hosts), list(opts.gateways)))
    return out


def destination_rules(p: IstioParts, opts: IstioOptions) -> list[dict]:
    out = []
    for pool in p.pools:
        name = pool_service_name(opts, pool)
        out.append({
            "apiVersion": "networking.istio.io/v1",
            "kind": "DestinationRule",
            "metadata": _meta(name, opts.namespace, opts, {"infermesh.io/pool": pool}),
            "spec": {"host": opts.fqdn(name), "trafficPolicy": _merged(p.traffic_policy, opts.traffic_policy)},
        })
    return out


def pool_thresholds(p: IstioParts, opts: IstioOptions, *, retry_budget: bool = True) -> list[dict]:
    """The pool clusters' circuit-breaker thresholds as istiod builds them from the
    DestinationRule's connectionPool (values overrides included), plus the retry budget: a
    threshold list replaces Istio's (Envoy reads only the first threshold of a priority)."""
    pool = _merged(p.traffic_policy, opts.traffic_policy)["connectionPool"]
    return [ISTIO_DECISIONS.threshold(pool, p.retry_budget if retry_budget else None)]


def spill_clusters(p: IstioParts, opts: IstioOptions) -> list[dict]:
    """Per spilling pool and front, its aggregate cluster: the pool's Istio cluster, then the
    spill pool's; the pools' circuit-breaker threshold (the router counts retries and hedges
    against the aggregate's max_retries as well, Envoy's default 3 otherwise)."""
    threshold = pool_thresholds(p, opts, retry_budget=opts.retry_budget)
    out = []
    for pool, spill in p.spill.items():
        for grpc in (False, True):
            c = {"name": spill_cluster_name(opts, pool, grpc), **copy.deepcopy(p.spill_cluster)}
            c["cluster_type"]["typed_config"]["clusters"] = [outbound_cluster(opts, pool, grpc), outbound_cluster(opts, spill.to, grpc)]
            c["circuit_breakers"] = {"thresholds": copy.deepcopy(threshold)}
            out.append(c)
    return out


def pools_envoy_filter(p: IstioParts, opts: IstioOptions) -> dict:
    """The pools' EnvoyFilter, in the proxies that route (the filter's): per pool its clusters'
    load-balancing policy (client-side weighted round robin on the replicas' ORCA reports: a
    DestinationRule's loadBalancer has no such choice) and the retry budget (its connectionPool
    has none); per route the retry and hedge policy the VirtualService cannot say. Per pool with
    `when_degraded.spill_to` (Envoy spills, not the filter): the state endpoint's health check on
    its two clusters (`port_number` picks the front), an aggregate cluster per front, and its
    routes sent to that aggregate (the VirtualService can only name the pool's Service)."""
    patches: list[dict] = []
    for pool in p.pools:
        match = {"context": opts.context, "cluster": {"service": opts.fqdn(pool_service_name(opts, pool))}}
        patches.append({"applyTo": "CLUSTER", "match": match, "patch": {"operation": "MERGE", "value": copy.deepcopy(p.pool_cluster)}})
        if opts.retry_budget:
            patches.append({"applyTo": "CLUSTER", "match": copy.deepcopy(match), "patch": {
                "operation": "MERGE_AND_REPLACE_LIST", "value": {"circuit_breakers": {"thresholds": pool_thresholds(p, opts)}}}})
        if pool in p.spill:
            for front, port in (("http", opts.http_port), ("grpc", opts.grpc_port)):
                patches.append({"applyTo": "CLUSTER", "match": {"context": opts.context, "cluster": {**match["cluster"], "portNumber": port}},
                                "patch": {"operation": "MERGE", "value": copy.deepcopy(p.spill[pool].cluster[front])}})
    for c in spill_clusters(p, opts):
        patches.append({"applyTo": "CLUSTER", "match": {"context": opts.context}, "patch": {"operation": "ADD", "value": c}})
    for route in p.routes:
        value = copy.deepcopy(route.envoy_route)
        if route.pool in p.spill:
            value["route"]["cluster"] = spill_cluster_name(opts, route.pool, route.grpc)
        patches.append({"applyTo": "HTTP_ROUTE", "match": _route_match(opts, route.name), "patch": {"operation": "MERGE", "value": value}})
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": _meta(f"{opts.name}-pools", opts.filter_namespace, opts),
        "spec": {"workloadSelector": {"labels": dict(opts.filter_selector)}, "configPatches": patches},
    }


def plugin_config(p: IstioParts, opts: IstioOptions) -> dict:
    """The filter's own JSON config (Policy.filter_config()), as the Wasm filter carries it, with
    the probe cluster of each pool degraded-mode routing watches."""
    cfg = json.loads(p.filter.wasm["config"]["configuration"]["value"])
    for pool, c in cfg.get("degraded_routing", {}).get("pools", {}).items():
        c["probe_cluster"] = probe_cluster(opts, pool)
    return cfg


def wasm_plugin(p: IstioParts, opts: IstioOptions) -> dict:
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
        "pluginConfig": plugin_config(p, opts),
    }
    if match := dict(ISTIO_DECISIONS.wasm_plugin_match)[opts.attach_to]:
        spec["match"] = [dict(m) for m in match]
    return {
        "apiVersion": "extensions.istio.io/v1alpha1",
        "kind": "WasmPlugin",
        "metadata": _meta(filter_object_name(opts), opts.filter_namespace, opts),
        "spec": spec,
    }


def wasm_extension_config(p: IstioParts, opts: IstioOptions) -> dict:
    """The Wasm filter the EnvoyFilter delivers: envoy_resources' filter with remote code, which
    the Istio agent fetches (HTTP or OCI), checks against the sha256 and hands Envoy as a file."""
    wasm = copy.deepcopy(p.filter.wasm)
    wasm["config"]["failure_policy"] = dict(ISTIO_DECISIONS.failure_policy)[opts.fail_strategy]
    cfg = plugin_config(p, opts)
    if "degraded_routing" in cfg:  # written again, as the chart's toJson writes it
        wasm["config"]["configuration"]["value"] = go_json(cfg)
    remote = wasm["config"]["vm_config"]["code"]["remote"]
    remote["http_uri"]["uri"], remote["sha256"] = opts.wasm_url, opts.wasm_sha256
    wasm["config"]["vm_config"]["code"] = ISTIO_DECISIONS.code(opts.wasm_url, wasm["config"]["vm_config"]["code"])
    return wasm


def envoy_filter(p: IstioParts, opts: IstioOptions) -> dict:
    """The filter as an EnvoyFilter, with what the VirtualService cannot say.

    The Wasm filter config as an extension config (ECDS, so the agent can fetch the module); the
    filter itself, inserted before the router and pointing at that config; with native rules,
    the HCM's early header mutation that strips client x-infermesh-* headers before a route is
    chosen; and per route, the body buffer (body rules) and, on natively decided routes, the
    filter turned off.
    """
    name = filter_chain_name(opts)
    hcm_match = {"context": opts.context, "listener": {"filterChain": {"filter": {"name": HCM}}}}
    patches: list[dict] = [
        {"applyTo": "EXTENSION_CONFIG",
         "patch": {"operation": "ADD", "value": {"name": name, "typed_config": wasm_extension_config(p, opts)}}},
        {"applyTo": "HTTP_FILTER",
         "match": {"context": opts.context, "listener": {"filterChain": {"filter": {"name": HCM, "subFilter": {"name": "envoy.filters.http.router"}}}}},
         "patch": {"operation": "INSERT_BEFORE", "value": {
             "name": name,
             # initial_fetch_timeout 0s: a listener waits for the filter instead of serving
             # its first requests without it.
             "config_discovery": {"config_source": {"ads": {}, "initial_fetch_timeout": "0s"},
                                  "type_urls": [p.filter.wasm["@type"]]}}}},
    ]
    if p.filter.early_header_mutation:
        patches.append({"applyTo": "NETWORK_FILTER", "match": hcm_match, "patch": {"operation": "MERGE", "value": {
            "typed_config": {"@type": HCM_TYPE_URL, "early_header_mutation_extensions": copy.deepcopy(p.filter.early_header_mutation)}}}})
    for route in p.routes:
        value = copy.deepcopy(p.route_settings)
        if not route.wasm:
            value["typed_per_filter_config"] = {name: copy.deepcopy(p.wasm_off)}
        if value:
            patches.append({"applyTo": "HTTP_ROUTE", "match": _route_match(opts, route.name), "patch": {"operation": "MERGE", "value": value}})
    # The edge's 404: never classified, buffered or shed, as in plain Envoy.
    patches.append({"applyTo": "HTTP_ROUTE", "match": _route_match(opts, p.not_found["name"]),
                    "patch": {"operation": "MERGE", "value": {"typed_per_filter_config": {name: copy.deepcopy(p.wasm_off)}}}})
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": _meta(filter_object_name(opts), opts.filter_namespace, opts),
        "spec": {"workloadSelector": {"labels": dict(opts.filter_selector)}, "configPatches": patches},
    }


def edge_authorization_policies(p: IstioParts, opts: IstioOptions) -> list[dict]:
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
                 "rules": [{"to": [{"operation": {"hosts": list(opts.hosts), "notPaths": list(p.edge_paths)}}]}]},
    }]


def filter_object(p: IstioParts, opts: IstioOptions) -> dict:
    return envoy_filter(p, opts) if p.filter.form == "EnvoyFilter" else wasm_plugin(p, opts)


def resources(policy: Policy, opts: IstioOptions) -> list[dict]:
    """Every object, in a stable order: Services, DestinationRules, VirtualServices, the filter,
    the pools' EnvoyFilter, the gateway's edge AuthorizationPolicy."""
    check(policy, opts)
    p = parts(policy)
    return [*services(p, opts), *destination_rules(p, opts), *virtual_services(p, opts), filter_object(p, opts),
            pools_envoy_filter(p, opts), *edge_authorization_policies(p, opts)]


def module_sha256(path: Path) -> str:
    """The hex SHA-256 of a built module (what `wasm_sha256` pins for https:// and file:// URLs)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def render_yaml(policy: Policy, opts: IstioOptions) -> str:
    """Every object as one multi-document YAML stream (`kubectl apply -f -`)."""
    return yaml.safe_dump_all(resources(policy, opts), sort_keys=False, width=120)
