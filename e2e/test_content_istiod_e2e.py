"""e2e: a content rule (issue 32) through the chart and real istiod: the model's weights travel in
the filter's config of the chart's EnvoyFilter, istiod serves them to the gateway (ECDS), and a
coding question is routed by what it says, in front of the real vLLM sidecars.

The policy is the chart's default with the example model (e2e/content-model-e2e.json) and one
content rule before `chat`: a chat the model calls `code` at 0.8 or more goes to the batch class
(the local mesh has two pools; a cluster would give code a pool of its own).
"""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from infermesh.chart_render import Helm, setup_outputs
from infermesh.istiod_gateway import DEFAULT_POLICY, GATEWAY_NS, Form, istiod_binary, on_loopback, pool_service_entries, render, start_gateway
from infermesh.launcher import free_ports
from infermesh.meshconfig.content_model import load_model
from infermesh.paths import REPO_ROOT

pytestmark = pytest.mark.e2e

MODEL = REPO_ROOT / "e2e" / "content-model-e2e.json"
CODE = "Write a function in JavaScript that sorts an array of numbers."
CHAT = "Tell me about the sea and the lighthouses on its shore."
FILTER_NAME = f"{GATEWAY_NS}.infermesh-filter"


def content_policy() -> dict:
    policy = yaml.safe_load(DEFAULT_POLICY.read_text())
    policy["content_model"] = json.loads(MODEL.read_text())
    rule = {"name": "code-questions", "class": "batch",
            "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}, "content": {"label": "code", "min_score": 0.8}}}
    policy["rules"].insert(0, rule)
    return policy


@pytest.fixture(scope="module")
def gateway(local_mesh, tmp_path_factory):
    helm = Helm.from_tools(setup_outputs("setup-chart-tools.sh"))
    form = Form("content-rules", content_policy(), "EnvoyFilter", body_rules=True, native=True)
    work = tmp_path_factory.mktemp("istiod-content")
    (port,) = free_ports(1)
    objects = render(helm, form, port, work)
    gw = start_gateway(istiod_binary(), form, objects, on_loopback(objects, port) + pool_service_entries(objects, local_mesh.plan.pools),
                       work, port)
    yield gw
    gw.stop()


def test_the_model_reaches_the_gateway_in_the_filters_config(gateway):
    dump = gateway.config_dump()
    found = [f["ecds_filter"]["typed_config"] for c in dump["configs"] if c["@type"].endswith("EcdsConfigDump")
             for f in c.get("ecds_filters", []) if f["ecds_filter"]["name"] == FILTER_NAME]
    assert len(found) == 1
    served = json.loads(found[0]["config"]["configuration"]["value"])
    assert served["content_model"] == json.loads(MODEL.read_text()), "the weights istiod serves are the policy's, unchanged"
    assert served["rules"][0]["name"] == "code-questions"


def test_a_coding_question_is_routed_by_its_content(gateway):
    model = load_model(MODEL)
    assert model.classify(CODE).label == "code" and model.classify(CODE).score >= 0.8
    assert model.classify(CHAT).label != "code" or model.classify(CHAT).score < 0.8

    def served_by(text: str) -> str:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
        r = httpx.post(gateway.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text[:300]
        return r.headers["x-infermesh-served-by"]

    assert served_by(CODE) == "batch/0"
    assert served_by(CHAT) == "interactive/0"
