"""Integration: content rules (`match.content`, issue 32) through the real Envoy with the compiled
filter, in both runtimes, in front of the echo upstreams (which return the headers they got).

The model is a small one built here in the model format (docs/content-classes.md): labels `chat`
and `code`, words that say code weigh for `code`. A code-ish prompt gets the content rule's class
and `x-infermesh-rule` names the content rule; a prompt whose label is `code` below the rule's
`min_score` falls through to the next rule, as does a prompt of another label or with no text, a
body that is not JSON and a gRPC call; the content condition composes with a header condition.
Each prompt's label and score are first asked of the filter's classifier natively
(filter/examples/content_eval.rs), so the test's premises are the filter's own numbers.
"""

from __future__ import annotations

import base64
import json
import subprocess

import grpc
import pytest

from e2e.test_filter_envoy_integration import RUNTIMES, call, filter_envoy, grpc_fronts, metric, prom  # noqa: F401 (a fixture)
from infermesh import paths
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

DIM = 1024
CODE_WORDS = ("def", "return", "import", "class", "function", "compile", "compiler", "error", "rust", "python", "segfault",
              "borrow", "checker", "stack", "trace", "null", "pointer", "exception", "regex", "lambda")


def fnv1a(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def code_model() -> dict:
    """Labels chat (0) and code (1): each code word's unigram bucket weighs 100 for code."""
    weights = bytearray(DIM * 2)
    for w in CODE_WORDS:
        weights[(fnv1a(b"w" + w.encode()) & (DIM - 1)) * 2 + 1] = 100
    return {"version": 1, "labels": ["chat", "code"], "dim": DIM, "word_ngrams": 2, "char_ngrams": [3, 4],
            "max_text_bytes": 4096, "scale": 0.5, "bias": [0.0, 0.0], "weights": base64.b64encode(bytes(weights)).decode()}


CONFIG = {
    "version": 1,
    "default_class": "batch",
    "content_model": code_model(),
    "classes": {"interactive": {"pool": "interactive"}, "code": {"pool": "interactive"}, "batch": {"pool": "batch"}},
    "rules": [
        {"name": "eval-code", "class": "batch",
         "match": {"headers": [{"name": "x-tenant", "exact": "eval"}], "content": {"label": "code", "min_score": 0.5}}},
        {"name": "code", "class": "code", "match": {"content": {"label": "code", "min_score": 0.9}}},
        {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
    ],
}

CODE = "my python function raises an exception: def f(x): return x.y -- null pointer, stack trace below"
MIXED = "we talked about the weather, a recipe and our trip, then about a rust compiler error"
CHAT = "thanks so much, the weather is lovely and the trip was fun"


def user(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[str, tuple[str | None, float | None]]:
    """The filter's classifier, natively, on the test's prompts: the premises of the tests."""
    model = tmp_path_factory.mktemp("content-model") / "model.json"
    model.write_text(json.dumps(CONFIG["content_model"]))
    binary = paths.REPO_ROOT / "filter" / "target" / "release" / "examples" / "content_eval"
    assert binary.exists(), "built by scripts/build-native-filter.sh (the native_module fixture)"
    lines = "".join(json.dumps({"text": t}) + "\n" for t in (CODE, MIXED, CHAT))
    out = subprocess.run([str(binary), str(model)], input=lines, capture_output=True, text=True, check=True, timeout=60).stdout
    got = [json.loads(line) for line in out.splitlines()]
    return {name: (g["label"], g["score"]) for name, g in zip(("code", "mixed", "chat"), got)}


@pytest.fixture(scope="module", params=RUNTIMES)
def envoy(request, upstreams, grpc_fronts, native_module, tmp_path_factory):
    e = filter_envoy(request, tmp_path_factory.mktemp(f"content-{request.param}"), CONFIG, upstreams, request.param,
                     grpc_pools=grpc_fronts)
    assert e.wait_ready(), "envoy did not start:\n" + e.log()[-3000:]
    yield e
    e.stop()


def routed(got: dict) -> tuple[str, str, str]:
    h = got["headers"]
    return got["upstream"], h["x-infermesh-class"], h["x-infermesh-rule"]


def test_the_premises_are_the_filters_own_numbers(verdicts):
    assert verdicts["code"][0] == "code" and verdicts["code"][1] >= 0.9, verdicts
    assert verdicts["mixed"][0] == "code" and 0.5 <= verdicts["mixed"][1] < 0.9, verdicts
    assert verdicts["chat"][0] == "chat", verdicts


def test_a_code_prompt_gets_the_content_rules_class(envoy, verdicts):
    before = metric(prom(envoy), "infermesh_requests_total", rule="code")
    got = call(envoy.base, "/v1/chat/completions", body=user(CODE))
    assert routed(got) == ("interactive", "code", "code")
    assert got["body_len"] == len(json.dumps(user(CODE))), "the buffered body reaches the upstream whole"
    # The completions prompt and the Responses input are read too, and an array content's text parts.
    assert routed(call(envoy.base, "/v1/completions", body={"prompt": CODE})) == ("interactive", "code", "code")
    assert routed(call(envoy.base, "/v1/responses", body={"input": [{"role": "user", "content": CODE}]})) == ("interactive", "code", "code")
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": CODE}]}]}
    assert routed(call(envoy.base, "/v1/chat/completions", body=parts)) == ("interactive", "code", "code")
    assert metric(prom(envoy), "infermesh_requests_total", rule="code") == before + 4


def test_below_the_score_or_another_label_falls_through(envoy, verdicts):
    assert routed(call(envoy.base, "/v1/chat/completions", body=user(MIXED))) == ("interactive", "interactive", "chat")
    assert routed(call(envoy.base, "/v1/chat/completions", body=user(CHAT))) == ("interactive", "interactive", "chat")
    assert routed(call(envoy.base, "/v1/completions", body={"prompt": MIXED})) == ("batch", "batch", "default")
    # Only the user's turns are read: code in the system prompt or an answer does not count.
    others = {"messages": [{"role": "system", "content": CODE}, {"role": "assistant", "content": CODE}, {"role": "user", "content": CHAT}]}
    assert routed(call(envoy.base, "/v1/chat/completions", body=others)) == ("interactive", "interactive", "chat")


def test_no_text_not_json_and_grpc_fall_through(envoy):
    for body in ({"messages": []}, {"messages": [{"role": "assistant", "content": CODE}]}, {"prompt": [1, 2, 3]}, {}):
        assert routed(call(envoy.base, "/v1/chat/completions", body=body))[2] == "chat", body
    before = metric(prom(envoy), "infermesh_body_fallbacks_total", reason="invalid_json")
    assert routed(call(envoy.base, "/v1/chat/completions", body=CODE.encode())) == ("interactive", "interactive", "chat")
    assert metric(prom(envoy), "infermesh_body_fallbacks_total", reason="invalid_json") == before + 1
    # gRPC: the body is protobuf (not JSON, not read): the content rules are skipped.
    with grpc.insecure_channel(f"127.0.0.1:{envoy.listen}") as ch:
        call_ = pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(text=CODE), timeout=10)
        assert [r.request_id for r in call_] == ["batch"]
        trail = dict(call_.trailing_metadata())
        assert (trail["x-infermesh-class"], trail["x-infermesh-rule"]) == ("batch", "default")


def test_content_composes_with_a_header_condition(envoy):
    eval_tenant = {"x-tenant": "eval"}
    assert routed(call(envoy.base, "/v1/chat/completions", headers=eval_tenant, body=user(MIXED))) == ("batch", "batch", "eval-code")
    assert routed(call(envoy.base, "/v1/chat/completions", headers=eval_tenant, body=user(CODE))) == ("batch", "batch", "eval-code")
    # The header without the label, the label without the header: neither is the tenant's rule.
    assert routed(call(envoy.base, "/v1/chat/completions", headers=eval_tenant, body=user(CHAT)))[2] == "chat"
    assert routed(call(envoy.base, "/v1/chat/completions", headers={"x-tenant": "other"}, body=user(MIXED)))[2] == "chat"
