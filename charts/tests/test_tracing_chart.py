"""The chart's half of the mesh's traces (issue 33, docs/tracing.md "Istio"): a policy with
`tracing` on gives the filter's proxies a Telemetry resource (the policy's sampling, the filter's
decision as tags, the MeshConfig provider that `tracing.istioProvider` names); off, none. The
sidecar pods read the policy's `tracing` from the policy itself. istiod turning the Telemetry
into the gateway's tracer: e2e/test_tracing_e2e.py."""

from __future__ import annotations

import json

import pytest
import yaml
from helm_render import CHART, HERE, NAMESPACE, RELEASE

from infermesh.meshconfig import istio
from infermesh.meshconfig.policy import parse_policy
from infermesh.meshconfig.tracing import DECISION_TAGS

PIN = HERE / "values" / "filter-pin.yaml"
PROVIDER = "infermesh-otel"


def traced_values(tmp_path, sample_ratio: float = 0.25) -> tuple[dict, object]:
    raw = yaml.safe_load((CHART / "files" / "default-policy.yaml").read_text())
    raw["tracing"] = {"otlp_endpoint": "otel-collector.observability.svc.cluster.local:4317", "sample_ratio": sample_ratio}
    policy = parse_policy(yaml.safe_dump(raw), "traced.yaml")
    values = tmp_path / "traced-values.json"
    values.write_text(json.dumps(istio.helm_values(policy, raw)))
    return raw, values


def test_tracing_off_renders_no_telemetry(helm):
    assert not [o for o in helm.template([PIN]).objects if o["kind"] == "Telemetry"]


def test_the_policys_tracing_gives_the_filters_proxies_a_telemetry(helm, schemas, tmp_path):
    _, values = traced_values(tmp_path)
    rendered = helm.template([values, PIN], sets=[f"tracing.istioProvider={PROVIDER}"])
    for o in rendered.objects:
        schemas.validate(o)
    t = rendered.one("Telemetry", f"{RELEASE}-tracing")
    assert t["apiVersion"] == "telemetry.istio.io/v1" and t["metadata"]["namespace"] == "istio-ingress"
    assert t["spec"]["selector"] == {"matchLabels": {"istio": "ingress"}}, "the filter's proxies (filter.selector's default)"
    (tracing,) = t["spec"]["tracing"]
    assert tracing["providers"] == [{"name": PROVIDER}]
    assert tracing["randomSamplingPercentage"] == 25
    assert tracing["customTags"] == {tag: {"header": {"name": header}} for tag, header in DECISION_TAGS.items()}
    # The sidecar pods trace from the policy they are given.
    (cm,) = [o for o in rendered.objects if o["kind"] == "ConfigMap" and "policy.yaml" in o.get("data", {})]
    assert yaml.safe_load(cm["data"]["policy.yaml"])["tracing"]["sample_ratio"] == 0.25


def test_the_telemetry_follows_the_filters_proxies(helm, tmp_path):
    _, values = traced_values(tmp_path)
    rendered = helm.template([values, PIN], sets=[f"tracing.istioProvider={PROVIDER}", "filter.namespace=apps", "filter.selector.app=client"])
    t = rendered.one("Telemetry", f"{RELEASE}-tracing")
    assert t["metadata"]["namespace"] == "apps" and t["spec"]["selector"] == {"matchLabels": {"app": "client"}}


def test_tracing_without_an_istio_provider_fails_by_name(helm, tmp_path):
    _, values = traced_values(tmp_path)
    assert "tracing.istioProvider: required with the policy's tracing on" in helm.template_error([values, PIN])


@pytest.mark.parametrize("name", ["bad name", "-x", "a/b"])
def test_a_provider_name_istio_would_not_take_is_refused_by_the_schema(helm, tmp_path, name):
    _, values = traced_values(tmp_path)
    assert "at '/tracing/istioProvider'" in helm.template_error([values, PIN], set_json=[f"tracing.istioProvider={json.dumps(name)}"])


def test_policy_render_istio_gives_the_same_telemetry(helm, tmp_path):
    """`infermesh policy render POLICY istio --tracing-provider …` (istio.py) renders the chart's own Telemetry."""
    raw, values = traced_values(tmp_path, sample_ratio=1.0)
    policy = parse_policy(yaml.safe_dump(raw), "traced.yaml")
    pin = yaml.safe_load(PIN.read_text())["filter"]
    opts = istio.IstioOptions(wasm_url=pin["url"], wasm_sha256=pin["sha256"], name=RELEASE, namespace=NAMESPACE, tracing_provider=PROVIDER)
    (ours,) = [o for o in istio.resources(policy, opts, raw_policy=raw, helm=helm.binary) if o["kind"] == "Telemetry"]
    chart = helm.template([values, PIN], sets=[f"tracing.istioProvider={PROVIDER}"]).one("Telemetry", f"{RELEASE}-tracing")
    assert ours["spec"] == chart["spec"] and ours["spec"]["tracing"][0]["randomSamplingPercentage"] == 100
    with pytest.raises(istio.IstioConfigError, match="tracing.istioProvider"):
        istio.resources(policy, istio.IstioOptions(wasm_url=pin["url"], wasm_sha256=pin["sha256"]), raw_policy=raw, helm=helm.binary)
