"""The Istio objects of a policy for `kubectl apply` without a Helm release: the chart
(charts/infermesh) rendered by `helm template` for the policy and a release's options.

    infermesh policy render POLICY istio --wasm-url oci://… --wasm-sha256 HEX | kubectl apply -f -

The chart's templates are the one place an Istio object is laid out; nothing here builds one.
This module holds only what goes into the chart:

    IstioOptions    what a release adds to the policy (its name, namespace, ports, where the
                    module lives, the chart's switches), typed
    chart_values()  the policy and those options as the chart's values: `policy`, `generated`
                    (istio_parts: every decision the policy model makes for Istio) and the
                    release's own values
    resources()     the chart's Istio templates rendered with them (services, destination rules,
                    virtual services, the filter, the pools' EnvoyFilter; with `ingress`, the
                    Gateway and the gateway's edge AuthorizationPolicy), without Helm's
                    bookkeeping labels

Why the chart and not Python: a cluster installs the chart, which must render for any release,
namespace, ports and values, so its templates have to lay the objects out; a second layout here
could only be kept equal to them by tests (docs/istio.md). The price: this command needs a Helm
binary (`helm_binary()`; scripts/setup-chart-tools.sh builds one).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from infermesh import paths
from infermesh.settings import GRPC_PORT, HTTP_PORT

from .chart_values import DNS_LABEL, MODULE_URL, SHA256
from .istio_parts import (  # noqa: F401  (chart_parts, parts, route_parts, go_json, …: the CLI's and tests' names)
    SPILL_PANIC_THRESHOLD,
    IstioConfigError,
    chart_parts,
    check_policy,
    go_json,
    helm_values,
    parts,
    route_parts,
)
from .policy import Policy

CHART = paths.REPO_ROOT / "charts" / "infermesh"
ISTIO_TEMPLATES = ("service.yaml", "destinationrule.yaml", "virtualservice.yaml", "filter.yaml", "pools-envoyfilter.yaml")
"""The chart's templates of the Istio objects (gateway.yaml too with `ingress`, telemetry.yaml with
the policy's tracing: Helm refuses to show a template that renders nothing); the others hold the
pods and their security, which a release installs with the chart."""
HELM_LABELS = ("app.kubernetes.io/version", "app.kubernetes.io/managed-by", "helm.sh/chart")
"""Labels that say a Helm release manages the object: not true of objects applied without one."""
HELM_ENV = "INFERMESH_HELM"


class HelmMissing(IstioConfigError):
    """No Helm binary to render the chart with."""


@dataclass(frozen=True)
class IstioOptions:
    """What a Kubernetes deployment adds to the policy: each field is a chart value (`chart_values`),
    its default the chart's, except `ingress`."""

    wasm_url: str
    """Where proxies fetch the filter: `oci://REGISTRY/REPO:TAG`, `https://…` or `file://…` (filter.url)."""
    wasm_sha256: str
    """Hex SHA-256 of the module (of the image for `oci://`): the proxy refuses anything else (filter.sha256)."""
    name: str = "infermesh"
    """The Helm release name. Objects are named after the chart's full name: this name, or
    NAME-infermesh where it does not contain `infermesh` (at most 40 characters)."""
    namespace: str = "infermesh"
    """Namespace of the pools, their Services and the routing objects."""
    cluster_domain: str = "cluster.local"
    """The cluster's DNS domain (Service FQDNs in routes and DestinationRules; clusterDomain)."""
    http_port: int = HTTP_PORT
    """The sidecars' OpenAI HTTP front (ports.http)."""
    grpc_port: int = GRPC_PORT
    """The sidecars' gRPC front (infermesh.v1.Inference, grpc.health.v1; ports.grpc)."""
    fail_strategy: Literal["FAIL_OPEN", "FAIL_CLOSE"] = "FAIL_OPEN"
    """FAIL_OPEN as in plain Envoy: a broken filter sends traffic to the default pool instead of
    failing every request (and, not loaded at all, leaves client-sent x-infermesh-* headers in)."""
    filter_namespace: str = "istio-ingress"
    """Namespace of the proxies that classify (a WasmPlugin/EnvoyFilter acts in its own namespace)."""
    filter_selector: dict[str, str] = field(default_factory=dict)
    """Labels of those proxies' pods; empty: the chart's default (ISTIO_DECISIONS.default_selector)."""
    attach_to: Literal["gateway", "sidecar"] = "gateway"
    """`gateway`: the filter runs in ingress gateways; `sidecar`: in the outbound path of the
    selected client pods' sidecars."""
    ingress: bool = False
    """The chart's Gateway (on the filter's pods' labels by default) and a second VirtualService
    (`NAME-ingress`) with the same routes bound to it; with `attach_to: gateway` also the gateway's
    edge AuthorizationPolicy. Mesh clients always reach the pools through the front Service."""
    hosts: tuple[str, ...] = ("*",)
    """Host names clients use through that Gateway (ingress.hosts)."""
    ingress_port: int = 80
    """The Gateway's HTTP port (ingress.port)."""
    ingress_selector: dict[str, str] = field(default_factory=dict)
    """Labels of the ingress gateway's pods; empty: the chart's default (ingress.selector)."""
    tls_credential_name: str = ""
    """HTTPS on 443 with this Secret instead of HTTP (ingress.tlsCredentialName)."""
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
    tracing_provider: str = ""
    """With the policy's tracing on: the `opentelemetry` extensionProvider of Istio's MeshConfig
    that the filter's proxies send Envoy's spans to (the chart's values `tracing.istioProvider`;
    required then: docs/tracing.md, "Istio")."""


def check(policy: Policy, opts: IstioOptions) -> None:
    """Raise IstioConfigError, naming the policy's field or the option, for what the chart's schema
    would refuse with a message about its values (the chart itself refuses the rest by name)."""
    check_policy(policy)
    for pool in policy.pools:
        if not re.match(DNS_LABEL, pool):
            raise IstioConfigError(f"pools.{pool}: a pool name becomes a Kubernetes Service name: lower-case letters, digits and '-', starting with a letter")
    if not re.fullmatch(SHA256, opts.wasm_sha256):
        raise IstioConfigError("wasm_sha256: 64 lower-case hex digits (sha256sum of the module, or the image digest for oci://)")
    if not re.fullmatch(MODULE_URL, opts.wasm_url):
        raise IstioConfigError(f"wasm_url: {opts.wasm_url!r} must start with oci://, https://, http:// or file://")


def chart_values(policy: Policy, opts: IstioOptions, raw_policy: dict | None = None) -> dict:
    """The chart's values for the policy and a release's options. `raw_policy`: the policy as
    written (default: the fields the policy was given, as the model reads them)."""
    raw = raw_policy if raw_policy is not None else policy.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return helm_values(policy, raw) | {
        "clusterDomain": opts.cluster_domain,
        "ports": {"http": opts.http_port, "grpc": opts.grpc_port},
        "filter": {"url": opts.wasm_url, "sha256": opts.wasm_sha256, "failStrategy": opts.fail_strategy,
                   "imagePullPolicy": opts.image_pull_policy, "imagePullSecret": opts.image_pull_secret,
                   "attachTo": opts.attach_to, "namespace": opts.filter_namespace, "selector": dict(opts.filter_selector)},
        "ingress": {"enabled": opts.ingress, "hosts": list(opts.hosts), "port": opts.ingress_port,
                    "selector": dict(opts.ingress_selector), "tlsCredentialName": opts.tls_credential_name},
        "trafficPolicy": opts.traffic_policy,
        "retryBudget": opts.retry_budget,
        "tracing": {"istioProvider": opts.tracing_provider},
    }


def helm_binary() -> str:
    """The Helm that renders the chart: $INFERMESH_HELM, else the newest one
    scripts/setup-chart-tools.sh built (INFERMESH_HOME/bin/helm-VERSION-…), else `helm` on PATH."""
    if os.environ.get(HELM_ENV):
        return os.environ[HELM_ENV]
    built = sorted(paths.home().glob("bin/helm-v3*"), key=lambda p: p.stat().st_mtime)
    if built:
        return str(built[-1])
    if found := shutil.which("helm"):
        return found
    raise HelmMissing(f"the Istio objects are the Helm chart's ({CHART}), rendered with Helm 3, and none was found: "
                      f"install Helm 3 on PATH, set {HELM_ENV}, or run scripts/setup-chart-tools.sh")


def _helm_error(stderr: str) -> str:
    """Helm's message without its prefix ("Error: execution error at (TEMPLATE:LINE:COL): ") and
    its advice to debug the chart."""
    out = re.sub(r"^Error: (execution error at \([^)]*\): )?", "", stderr.strip())
    return out.removesuffix("Use --debug flag to render out invalid YAML").strip()


def resources(policy: Policy, opts: IstioOptions, *, raw_policy: dict | None = None, helm: str | None = None) -> list[dict]:
    """Every Istio object of the chart for the policy and options, in the chart's order (Services,
    DestinationRules, VirtualServices, the filter, the pools' EnvoyFilter; with `ingress` the
    Gateway and the edge AuthorizationPolicy), without Helm's bookkeeping labels."""
    check(policy, opts)
    values = chart_values(policy, opts, raw_policy)
    templates = ISTIO_TEMPLATES + (("gateway.yaml",) if opts.ingress else ()) + (("telemetry.yaml",) if policy.tracing.on else ())
    args = [helm or helm_binary(), "template", opts.name, str(CHART), "--namespace", opts.namespace, "--values", "-"]
    for t in templates:
        args += ["--show-only", f"templates/{t}"]
    r = subprocess.run(args, input=json.dumps(values), capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise IstioConfigError(_helm_error(r.stderr))
    objects = [o for o in yaml.safe_load_all(r.stdout) if o]
    for o in objects:
        for label in HELM_LABELS:
            o["metadata"]["labels"].pop(label, None)
    return objects


def module_sha256(path: Path) -> str:
    """The hex SHA-256 of a built module (what `wasm_sha256` pins for https:// and file:// URLs)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def render_yaml(policy: Policy, opts: IstioOptions, *, raw_policy: dict | None = None) -> str:
    """Every object as one multi-document YAML stream (`kubectl apply -f -`)."""
    return yaml.safe_dump_all(resources(policy, opts, raw_policy=raw_policy), sort_keys=False, width=120)
