"""Validate rendered Kubernetes objects against the real schemas, strictly.

- Built-in kinds: Kubernetes' own OpenAPI v3 spec (module k8s.io/kubernetes, api/openapi-spec/v3),
  the document of each group/version, found by `x-kubernetes-group-version-kind`.
- Custom resources: the `openAPIV3Schema` of each served version of the CRDs (Istio's from
  istio.io/api, ServiceMonitor and PrometheusRule from prometheus-operator), with the
  `apiVersion`/`kind`/`metadata` the API server adds to every CRD (metadata is the real ObjectMeta).

Strict, like `kubeconform -strict`: an object schema with `properties` and no
`additionalProperties` gets `additionalProperties: false`, so an unknown or misspelt field is an
error, except where the schema says `x-kubernetes-preserve-unknown-fields` (e.g. a WasmPlugin's
pluginConfig, an EnvoyFilter patch's value; tests check those another way). Not evaluated: CEL
rules (`x-kubernetes-validations`) and `format`s, which only an API server checks.

scripts/setup-chart-tools.sh fetches the schemas (SCHEMAS=…).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jsonschema
import yaml

OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# libyaml's loader where PyYAML has it: Istio's CRD file is 20,000 lines.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class SchemaError(AssertionError):
    """An object that its schema rejects; the message names the object and the field."""


def strict(node: Any) -> Any:
    """A copy of an OpenAPI schema in which objects reject properties they do not declare."""
    if isinstance(node, list):
        return [strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        # OpenAPI 3.0's nullable, in JSON Schema words.
        out["type"] = [out["type"], "null"]
    pattern = out.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^(?i)"):
        # Go's RE2 takes a flag group after ^; Python's re wants global flags first.
        out["pattern"] = "(?i)^" + pattern[len("^(?i)"):]
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class GVK:
    group: str
    version: str
    kind: str

    @classmethod
    def of(cls, obj: dict) -> "GVK":
        api = obj.get("apiVersion", "")
        group, _, version = api.rpartition("/")
        return cls(group, version, obj.get("kind", ""))

    def __str__(self) -> str:
        return f"{self.group + '/' if self.group else ''}{self.version} {self.kind}"


class SchemaSet:
    """The schemas under one SCHEMAS directory (kubernetes/*.json, crds/*.yaml)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._validators: dict[GVK, jsonschema.protocols.Validator] = {}

    def _k8s_doc(self, group: str, version: str) -> dict | None:
        name = f"api__{version}_openapi.json" if not group else f"apis__{group}__{version}_openapi.json"
        path = self.root / "kubernetes" / name
        return json.loads(path.read_text()) if path.exists() else None

    @cached_property
    def _core_components(self) -> dict:
        """The core/v1 document's components: ObjectMeta and what it refers to, for CRD metadata."""
        return strict(self._k8s_doc("", "v1")["components"])

    @cached_property
    def _crds(self) -> dict[GVK, dict]:
        out: dict[GVK, dict] = {}
        for path in sorted((self.root / "crds").glob("*.yaml")):
            for crd in yaml.load_all(path.read_text(), Loader=_Loader):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                spec = crd["spec"]
                for v in spec["versions"]:
                    if v.get("served") and "schema" in v:
                        out[GVK(spec["group"], v["name"], spec["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
        return out

    def validator(self, gvk: GVK) -> jsonschema.protocols.Validator:
        if gvk in self._validators:
            return self._validators[gvk]
        schema = self._builtin(gvk) or self._custom(gvk)
        if schema is None:
            raise SchemaError(f"no schema for {gvk}: not a Kubernetes {gvk.group or 'core'}/{gvk.version} kind, and no CRD defines it")
        v = jsonschema.Draft202012Validator(schema)
        self._validators[gvk] = v
        return v

    def _builtin(self, gvk: GVK) -> dict | None:
        doc = self._k8s_doc(gvk.group, gvk.version)
        if doc is None:
            return None
        for name, s in doc["components"]["schemas"].items():
            for g in s.get("x-kubernetes-group-version-kind", []):
                if (g["group"], g["version"], g["kind"]) == (gvk.group, gvk.version, gvk.kind):
                    return {"$ref": f"#/components/schemas/{name}", "components": strict(doc["components"])}
        return None

    def _custom(self, gvk: GVK) -> dict | None:
        s = self._crds.get(gvk)
        if s is None:
            return None
        s = strict(s)
        props = s.setdefault("properties", {})
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        # Some CRDs declare metadata as a bare object; the API server checks it as ObjectMeta.
        props["metadata"] = {"$ref": f"#/components/schemas/{OBJECT_META}"}
        s["additionalProperties"] = False
        s["components"] = self._core_components
        return s

    def validate(self, obj: dict) -> None:
        """Raise SchemaError naming the object and every offending field."""
        gvk = GVK.of(obj)
        v = self.validator(gvk)
        errors = sorted(v.iter_errors(obj), key=lambda e: list(e.absolute_path))
        if errors:
            name = (obj.get("metadata") or {}).get("name", "?")
            lines = [f"{gvk} {name}:"]
            for e in errors:
                path = ".".join(str(p) for p in e.absolute_path) or "(root)"
                lines.append(f"  {path}: {e.message}")
            raise SchemaError("\n".join(lines))
