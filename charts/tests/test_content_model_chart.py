"""The chart carries the content classifier's model (issue 32): a policy with a `content_model`
and a content rule, through `infermesh policy render POLICY helm-values` and `helm template`,
gives the filter's config in the EnvoyFilter (a content rule reads the body) with the model in it,
the same JSON the plain-Envoy filter config has. istiod loading it: e2e/test_istiod_e2e.py's forms."""

from __future__ import annotations

import json

import yaml
from helm_render import HERE, RELEASE, REPO

from infermesh.meshconfig import istio
from infermesh.meshconfig.policy import load_policy

EXAMPLE = REPO / "e2e" / "policy-content-e2e.yaml"


def test_the_filter_config_in_the_chart_carries_the_model(helm, schemas, tmp_path):
    policy = load_policy(EXAMPLE)
    values = tmp_path / "content-values.json"
    values.write_text(json.dumps(istio.helm_values(policy, yaml.safe_load(EXAMPLE.read_text()))))
    rendered = helm.template([values, HERE / "values" / "filter-pin.yaml"])
    for o in rendered.objects:
        schemas.validate(o)
    ef = rendered.one("EnvoyFilter", f"{RELEASE}-filter")
    config = ef["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]["configuration"]
    fc = json.loads(config["value"])
    assert fc["content_model"] == policy.filter_config()["content_model"]
    assert fc["content_model"]["labels"] == ["chat", "code"]
    assert fc["rules"][0] == {"name": "code-questions", "class": "code",
                              "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"},
                                        "content": {"label": "code", "min_score": 0.8}}}
