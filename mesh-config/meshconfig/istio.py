"""Generate the Istio resources for a policy: the Kubernetes form of what envoy_bootstrap.py
gives plain Envoy.

    per pool      a Service (OpenAI HTTP front + gRPC) and a DestinationRule
    once          a front Service clients address, a VirtualService that routes on the
                  filter's `x-infermesh-pool` header (and one for the ingress gateways), and
                  the filter itself: a WasmPlugin when every rule decides on headers, an
                  EnvoyFilter when some rule reads the body

    infermesh policy render POLICY istio --wasm-url oci://… --wasm-sha256 HEX | kubectl apply -f -

The same policy routes the same request to the same pool here and in plain Envoy: one route per
pool on the pool header, then a default route to the default class's pool (tests compare both
generators, and the Helm chart in charts/infermesh, which renders these objects from the same
policy). What the local control plane does at run time (spill and shed while a pool is degraded)
has no Istio counterpart here; docs/kubernetes.md says why.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from .envoy_bootstrap import POOL_HEADER, REQUEST_BUFFER_LIMIT_BYTES
from .policy import Policy

WASM_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
GRPC_CONTENT_TYPE_PREFIX = "application/grpc"

# The per-pool limits and outlier detection of envoy_bootstrap's pool clusters, in Istio's
# vocabulary (tests check the two agree). The connection limits sit far above what a sidecar
# admits (it sheds with 429 first); they stop a runaway client from piling onto a GPU pool.
CONNECTION_POOL = {
    "tcp": {"maxConnections": 4096, "connectTimeout": "1s"},
    "http": {"http1MaxPendingRequests": 4096, "http2MaxRequests": 4096, "maxRetries": 64},
}
# Eject an endpoint only for failures of its own making at the connection level (refused,
# reset, timed out). 5xx counting is off (`consecutive5xxErrors: 0`) and gateway errors are
# left unset (off): both count 503, and a sidecar answering 429/503 is shedding on purpose —
# ejecting it would move its load onto the pool's other replicas, which are just as full.
OUTLIER_DETECTION = {
    "splitExternalLocalOriginErrors": True,
    "consecutiveLocalOriginFailures": 5,
    "consecutive5xxErrors": 0,
    "interval": "2s",
    "baseEjectionTime": "10s",
    "maxEjectionPercent": 50,
}
# Retry only where no response has begun (a refused or reset connection: a dead or restarting
# sidecar), as envoy_bootstrap's routes do. A 503 / UNAVAILABLE is a pool refusing work
# (shedding, draining); retrying it would defeat the shedding.
RETRIES = {"attempts": 2, "retryOn": "connect-failure,refused-stream,reset"}

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class IstioConfigError(ValueError):
    """A policy or option that cannot become Istio resources; the message names the field."""


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

    def fqdn(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc.{self.cluster_domain}"


def pool_order(policy: Policy) -> list[str]:
    """Pools by name: the order Helm's templates iterate a map in, so both renderings agree.
    (The per-pool routes match disjoint header values, so their order does not change routing.)"""
    return sorted(policy.pools)


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


def services(policy: Policy, opts: IstioOptions) -> list[dict]:
    """The front Service, then one Service per pool.

    The front Service is the name clients call; the VirtualService decides the pool. It selects
    the default pool's pods, so a caller whose proxy applies no route lands where a request
    without a pool header lands in plain Envoy.
    """
    out = [_service(opts, opts.name, labels(opts, policy.default_pool), {"app.kubernetes.io/component": "front"})]
    for pool in pool_order(policy):
        out.append(_service(opts, pool_service_name(opts, pool), labels(opts, pool),
                            {"app.kubernetes.io/component": "sidecar", "infermesh.io/pool": pool}))
    return out


def _route(opts: IstioOptions, name: str, pool: str, grpc: bool, pool_header: str | None) -> dict:
    headers: dict[str, dict] = {}
    if pool_header is not None:
        headers[POOL_HEADER] = {"exact": pool_header}
    if grpc:
        headers["content-type"] = {"prefix": GRPC_CONTENT_TYPE_PREFIX}
    route: dict = {"name": name + ("-grpc" if grpc else "")}
    if headers:
        route["match"] = [{"headers": headers}]
    route["route"] = [{"destination": {"host": opts.fqdn(pool_service_name(opts, pool)),
                                       "port": {"number": opts.grpc_port if grpc else opts.http_port}}}]
    # No route timeout: a streamed completion may run for minutes (the plain-Envoy routes say 0s too).
    route["timeout"] = "0s"
    route["retries"] = dict(RETRIES)
    return route


def http_routes(policy: Policy, opts: IstioOptions) -> list[dict]:
    """The VirtualService's routes, in order: per pool on the pool header, then the default.

    Each comes twice: gRPC (content-type application/grpc…) goes to the pool's gRPC port and
    everything else to its HTTP front, whichever front port the request arrived on. Route names
    are those of envoy_bootstrap (`class-pool-POOL`, `default-pool`), `-grpc` marking the gRPC twin.
    """
    routes = []
    for pool in pool_order(policy):
        for grpc in (True, False):
            routes.append(_route(opts, f"class-pool-{pool}", pool, grpc, pool))
    for grpc in (True, False):
        routes.append(_route(opts, "default-pool", policy.default_pool, grpc, None))
    return routes


def virtual_services(policy: Policy, opts: IstioOptions) -> list[dict]:
    """The mesh's VirtualService (the front Service's name), and one for the gateways if any.

    Two objects because Istio refuses a wildcard host on a VirtualService bound to the mesh.
    """
    def vs(name: str, hosts: list[str], gateways: list[str]) -> dict:
        return {
            "apiVersion": "networking.istio.io/v1",
            "kind": "VirtualService",
            "metadata": _meta(name, opts.namespace, opts),
            "spec": {"hosts": hosts, "gateways": gateways, "http": http_routes(policy, opts)},
        }

    out = [vs(opts.name, [opts.fqdn(opts.name)], ["mesh"])]
    if opts.gateways:
        out.append(vs(f"{opts.name}-ingress", list(opts.hosts), list(opts.gateways)))
    return out


def destination_rules(policy: Policy, opts: IstioOptions) -> list[dict]:
    out = []
    for pool in pool_order(policy):
        name = pool_service_name(opts, pool)
        out.append({
            "apiVersion": "networking.istio.io/v1",
            "kind": "DestinationRule",
            "metadata": _meta(name, opts.namespace, opts, {"infermesh.io/pool": pool}),
            "spec": {
                "host": opts.fqdn(name),
                "trafficPolicy": {"connectionPool": json.loads(json.dumps(CONNECTION_POOL)), "outlierDetection": dict(OUTLIER_DETECTION)},
            },
        })
    return out


def filter_object_name(opts: IstioOptions) -> str:
    return f"{opts.name}-filter"


def wasm_plugin(policy: Policy, opts: IstioOptions) -> dict:
    """The filter as a WasmPlugin: for policies whose rules decide on headers only."""
    spec: dict = {
        "selector": {"matchLabels": dict(opts.filter_selector)},
        "url": opts.wasm_url,
        "sha256": opts.wasm_sha256,
        "imagePullPolicy": opts.image_pull_policy,
        **({"imagePullSecret": opts.image_pull_secret} if opts.image_pull_secret else {}),
        "pluginName": "infermesh",
        "failStrategy": opts.fail_strategy,
        "type": "HTTP",
        # No phase: Istio then inserts it right before the router, after authentication and
        # authorization, so a request that is refused anyway is never classified.
        "pluginConfig": policy.filter_config(),
    }
    if opts.attach_to == "sidecar":
        spec["match"] = [{"mode": "CLIENT"}]
    return {
        "apiVersion": "extensions.istio.io/v1alpha1",
        "kind": "WasmPlugin",
        "metadata": _meta(filter_object_name(opts), opts.filter_namespace, opts),
        "spec": spec,
    }


def wasm_filter_config(policy: Policy, opts: IstioOptions) -> dict:
    """The Wasm HTTP filter (envoy.extensions.filters.http.wasm.v3.Wasm) the EnvoyFilter delivers.

    The same settings as envoy_bootstrap's filter; only the code source differs: `remote`, which
    the Istio agent fetches (HTTP or OCI), checks against the sha256 and hands Envoy as a file.
    """
    return {
        "@type": WASM_TYPE_URL,
        "config": {
            "name": "infermesh",
            "root_id": "infermesh",
            "failure_policy": "FAIL_OPEN" if opts.fail_strategy == "FAIL_OPEN" else "FAIL_CLOSED",
            # What WasmPlugin cannot say (see module docstring): lets the filter pause in the
            # headers callback and decide on the body; without it such requests hang.
            "allow_on_headers_stop_iteration": True,
            "configuration": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                # Keys sorted, as the chart's toJson writes them: the same policy, the same bytes.
                "value": json.dumps(policy.filter_config(), separators=(",", ":"), sort_keys=True),
            },
            "vm_config": {
                "vm_id": "infermesh",
                "runtime": "envoy.wasm.runtime.v8",
                "code": {"remote": {"http_uri": {"uri": opts.wasm_url, "timeout": "30s"}, "sha256": opts.wasm_sha256}},
            },
        },
    }


def envoy_filter(policy: Policy, opts: IstioOptions) -> dict:
    """The filter as an EnvoyFilter: for policies with body rules.

    Three kinds of patches: the Wasm filter config as an extension config (ECDS, so the agent can
    fetch the module); the filter itself, inserted before the router and pointing at that config;
    and, per route of the VirtualService, a request buffer big enough for the filter to hold a
    body of `body.max_bytes` plus one more read (as envoy_bootstrap sets on its virtual host).
    """
    context = "GATEWAY" if opts.attach_to == "gateway" else "SIDECAR_OUTBOUND"
    ecds_name = f"{opts.filter_namespace}.{filter_object_name(opts)}"
    patches: list[dict] = [
        {"applyTo": "EXTENSION_CONFIG",
         "patch": {"operation": "ADD", "value": {"name": ecds_name, "typed_config": wasm_filter_config(policy, opts)}}},
        {"applyTo": "HTTP_FILTER",
         "match": {"context": context, "listener": {"filterChain": {"filter": {
             "name": "envoy.filters.network.http_connection_manager",
             "subFilter": {"name": "envoy.filters.http.router"}}}}},
         "patch": {"operation": "INSERT_BEFORE", "value": {
             "name": ecds_name,
             # initial_fetch_timeout 0s: a listener waits for the filter instead of serving
             # its first requests without it.
             "config_discovery": {"config_source": {"ads": {}, "initial_fetch_timeout": "0s"}, "type_urls": [WASM_TYPE_URL]}}}},
    ]
    for route in http_routes(policy, opts):
        patches.append({
            "applyTo": "HTTP_ROUTE",
            "match": {"context": context, "routeConfiguration": {"vhost": {"route": {"name": route["name"]}}}},
            "patch": {"operation": "MERGE", "value": {"per_request_buffer_limit_bytes": REQUEST_BUFFER_LIMIT_BYTES}},
        })
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": _meta(filter_object_name(opts), opts.filter_namespace, opts),
        "spec": {"workloadSelector": {"labels": dict(opts.filter_selector)}, "configPatches": patches},
    }


def filter_object(policy: Policy, opts: IstioOptions) -> dict:
    """WasmPlugin when every rule decides on headers, EnvoyFilter when one needs the body."""
    return envoy_filter(policy, opts) if needs_body(policy) else wasm_plugin(policy, opts)


def resources(policy: Policy, opts: IstioOptions) -> list[dict]:
    """Every object, in a stable order: Services, DestinationRules, VirtualServices, the filter."""
    check(policy, opts)
    return [*services(policy, opts), *destination_rules(policy, opts), *virtual_services(policy, opts), filter_object(policy, opts)]


def module_sha256(path: Path) -> str:
    """The hex SHA-256 of a built module (what `wasm_sha256` pins for https:// and file:// URLs)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def render_yaml(policy: Policy, opts: IstioOptions) -> str:
    """Every object as one multi-document YAML stream (`kubectl apply -f -`)."""
    return yaml.safe_dump_all(resources(policy, opts), sort_keys=False, width=120)
