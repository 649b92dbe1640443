"""The Helm chart's values.schema.json (charts/infermesh), generated.

Its `policy` part comes from the policy model itself (`Policy.model_json_schema()`): classes,
typed rules (with the filter's own limits, mesh-config/meshconfig/policy.py), pools, models,
serving limits and breakers, so the chart accepts what `infermesh policy check` accepts (but
`filter.runtime: native`, which Istio's proxy cannot load), short
of the checks a schema cannot express (cross references, regex syntax: the policy model
itself, when `infermesh policy render POLICY helm-values` writes the chart's values). Two things are added here: pool names must be DNS labels
(they become Service names), and every map of names rejects names that do not fit. The rest
describes the chart's own settings. Every object rejects unknown keys (`additionalProperties:
false`), so a typo in values fails `helm install` instead of being ignored.

    python -m infermesh.meshconfig.chart_values > charts/infermesh/values.schema.json

A test keeps the committed file equal to this output.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .policy import Policy

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MODULE_URL = r"(oci|https?|file)://.+"
"""Where proxies fetch the filter (filter.url; istio.check names the option with the same pattern)."""
SHA256 = r"[a-f0-9]{64}"
"""The module's digest (filter.sha256)."""


def obj(properties: dict[str, Any], required: tuple[str, ...] = (), description: str | None = None) -> dict:
    """A closed object: only these properties."""
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        out["required"] = list(required)
    if description:
        out["description"] = description
    return out


def string_map(description: str | None = None) -> dict:
    out: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
    return out | ({"description": description} if description else {})


def string_or_number_map() -> dict:
    """Resource quantities: "8Gi" or 8."""
    return {"type": "object", "additionalProperties": {"type": ["string", "number"]}}


# Free-form Kubernetes objects the chart passes through unchanged (the API server validates them).
K8S_PASSTHROUGH = {"type": "object"}

def _tidy(node: Any) -> Any:
    """Drop pydantic's generated titles; close maps of names to names that fit their pattern."""
    if isinstance(node, dict):
        out = {k: _tidy(v) for k, v in node.items() if k != "title" or not isinstance(v, str)}
        if "patternProperties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_tidy(v) for v in node]
    return node


def policy_schema() -> tuple[dict, dict]:
    """(the schema of `policy`, the definitions it refers to as #/$defs/NAME)."""
    s = _tidy(Policy.model_json_schema())
    defs = s.pop("$defs")
    pools = s["properties"]["pools"]
    (pattern, pool_ref), = pools["patternProperties"].items()
    pools["patternProperties"] = {DNS_LABEL: pool_ref}
    pools["description"] = "The GPU pools; a pool name becomes a Service name (lower-case letters, digits, '-')."
    s["description"] = "The mesh policy (mesh-config/policies/*.yaml; `infermesh policy check` validates a file of it)."
    # Istio's proxy loads the filter as Wasm only (istio.check_policy refuses the same).
    defs["FilterSpec"]["properties"]["runtime"] = {"const": "wasm", "default": "wasm",
                                                   "description": "Istio runs the filter as Wasm; `native` is for plain Envoy only"}
    return s, defs


def chart_schema(policy: dict) -> dict:
    """The chart's own values, around the policy's schema."""
    port = {"type": "integer", "minimum": 1, "maximum": 65535}
    positive = {"type": "integer", "minimum": 1}
    duration = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "infermesh chart values",
        **obj({
            # if/then rather than anyOf: an error in a given policy is reported as itself.
            "policy": {"type": "object", "description": "empty: the chart's files/default-policy.yaml",
                       "if": {"minProperties": 1}, "then": policy},
            # Checked by the templates against the policy's digest (its shape is istio_parts.IstioParts.values()).
            "generated": {"type": "object", "description": "written with the policy by `infermesh policy render POLICY helm-values`, never by hand; "
                                                           "empty with an empty policy: the chart's files/default-generated.json"},
            "image": obj({
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string", "description": "default: the chart's appVersion"},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            }, required=("repository",)),
            "imagePullSecrets": {"type": "array", "items": obj({"name": {"type": "string", "minLength": 1}}, required=("name",))},
            "clusterDomain": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
            "ports": obj({"http": port, "grpc": port, "admin": port, "adminGrpc": port}, required=("http", "grpc", "admin", "adminGrpc")),
            "admin": obj({"allowFaults": {"type": "boolean",
                                          "description": "let PUT /admin/faults inject readings and stalls (drills); off in production"}},
                         required=("allowFaults",)),
            "filter": obj({
                "url": {"type": "string", "pattern": f"^$|^{MODULE_URL}",
                        "description": "required: oci://REGISTRY/REPO:TAG, https://…/infermesh_filter.wasm or file://…"},
                "sha256": {"type": "string", "pattern": f"^$|^{SHA256}$",
                           "description": "required: hex SHA-256 of the module (the image digest for oci://)"},
                "failStrategy": {"enum": ["FAIL_OPEN", "FAIL_CLOSE"]},
                "imagePullPolicy": {"enum": ["IfNotPresent", "Always"]},
                "imagePullSecret": {"type": "string"},
                "attachTo": {"enum": ["gateway", "sidecar"]},
                "namespace": {"type": "string", "pattern": DNS_LABEL},
                "selector": string_map("labels of the pods the filter runs in"),
            }, required=("url", "sha256", "attachTo", "namespace", "selector")),
            "ingress": obj({
                "enabled": {"type": "boolean"},
                "selector": string_map("labels of the ingress gateway pods"),
                "hosts": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                "port": port,
                "tlsCredentialName": {"type": "string"},
            }, required=("enabled",)),
            "tracing": obj({
                "istioProvider": {"type": "string", "pattern": r"^$|^[A-Za-z0-9][-A-Za-z0-9_.]{0,252}$",
                                  "description": "the `opentelemetry` extensionProvider of Istio's MeshConfig that Envoy's spans go to; "
                                                 "required when the policy's tracing is on"},
            }, required=("istioProvider",)),
            "trafficPolicy": obj({
                "connectionPool": obj({
                    "tcp": obj({"maxConnections": positive, "connectTimeout": duration}),
                    "http": obj({"http1MaxPendingRequests": positive, "http2MaxRequests": positive,
                                 "maxRetries": {"type": "integer", "minimum": 0}}),
                }),
                "outlierDetection": obj({
                    "splitExternalLocalOriginErrors": {"type": "boolean"},
                    "consecutiveLocalOriginFailures": positive,
                    "consecutive5xxErrors": {"type": "integer", "minimum": 0,
                                             "description": "keep 0: a sidecar answering 503 is shedding on purpose"},
                    "interval": duration,
                    "baseEjectionTime": duration,
                    "maxEjectionPercent": {"type": "integer", "minimum": 0, "maximum": 100},
                }),
            }),
            "retryBudget": {"type": "boolean", "description": "the pool clusters' retry budget (an EnvoyFilter MERGE_AND_REPLACE_LIST "
                                                              "patch: recent Istio only); false: trafficPolicy's maxRetries"},
            "security": obj({
                "peerAuthentication": {"type": "boolean", "description": "STRICT mTLS for the pools"},
                "allowedPrincipals": {"type": "array", "items": {"type": "string", "pattern": "^[^/]+/ns/[^/]+/sa/[^/]+$"},
                                      "description": "SPIFFE ids without spiffe://, e.g. cluster.local/ns/istio-ingress/sa/istio-ingress"},
                "allowedNamespaces": {"type": "array", "items": {"type": "string", "pattern": DNS_LABEL}},
            }),
            "drain": obj({
                "graceSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
                "preStopSleepSeconds": {"type": "integer", "minimum": 0, "maximum": 300},
                "shutdownMarginSeconds": {"type": "integer", "minimum": 0, "maximum": 600},
            }, required=("graceSeconds", "preStopSleepSeconds", "shutdownMarginSeconds")),
            "probes": obj({
                kind: obj({"periodSeconds": positive, "failureThreshold": positive}, required=("periodSeconds", "failureThreshold"))
                for kind in ("startup", "readiness", "liveness")
            }),
            "models": obj({
                "mountPath": {"type": "string", "pattern": "^/"},
                "volume": {"type": "object", "maxProperties": 1,
                           "description": "one Kubernetes volume source (persistentVolumeClaim, …); empty: an emptyDir"},
            }, required=("mountPath", "volume")),
            "gpuNodeSelectors": {"type": "object", "additionalProperties": string_map(),
                                 "description": "GPU type (policy pools.<name>.gpu.type) -> node labels"},
            "gpuTolerations": {"type": "array", "items": K8S_PASSTHROUGH},
            "poolDefaults": _pool_settings(),
            "pools": {"type": "object", "propertyNames": {"pattern": DNS_LABEL}, "additionalProperties": _pool_settings(),
                      "description": "per pool of the policy: overrides of poolDefaults"},
            "podDisruptionBudget": obj({"enabled": {"type": "boolean"}, "maxUnavailable": positive}),
            "metrics": obj({
                "serviceMonitor": obj({"enabled": {"type": "boolean"}, "interval": duration, "labels": string_map()}),
                "prometheusRule": obj({
                    "enabled": {"type": "boolean"},
                    "labels": string_map(),
                    "coldStartSeconds": {"type": "number", "exclusiveMinimum": 0},
                    "kvCacheUsage": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                    "shedRatio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                    "degradedFor": duration,
                }),
            }),
        }, required=("image", "clusterDomain", "ports", "filter")),
    }


def _pool_settings() -> dict:
    return obj({
        "resources": obj({"requests": string_or_number_map(), "limits": string_or_number_map()}),
        "nodeSelector": string_map(),
        "tolerations": {"type": "array", "items": K8S_PASSTHROUGH},
        "affinity": K8S_PASSTHROUGH,
        "podAnnotations": string_map(),
        "extraEnv": {"type": "array", "items": K8S_PASSTHROUGH},
    })


def values_schema() -> dict:
    """The whole values.schema.json."""
    policy, defs = policy_schema()
    return chart_schema(policy) | {"$defs": defs}


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
