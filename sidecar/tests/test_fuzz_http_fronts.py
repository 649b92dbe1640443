"""Mutation fuzz of the sidecar's HTTP fronts (issue 28): the OpenAI front (chat, completions,
responses, messages, tokenize, detokenize) on vLLM's own serving layer over a fake engine
(conftest.FakeVllmAsyncLLM: the real config and tokenizer of the small local model), the state
endpoint and the admin API. Fixed seeds (a failure names its case; infermesh/fuzz_inputs.py
replays it), a time budget per test, and for every answer: no 5xx, a JSON error body with a
message (never plain text), no in-stream error with a 5xx code, nothing counted as an internal
error; a plain request is still served afterwards."""

import json
import time

import pytest
from fastapi.testclient import TestClient

from infermesh import fuzz_inputs
from infermesh.sidecar.admin_api import SIGNALS, build_admin_app
from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.http_api import build_app

SEED = 28
BUDGET_S = 10.0
"""Per test; the cases stop there (each test runs at least MIN_CASES)."""
MIN_CASES = 60

CONFIG = SidecarConfig.model_validate(
    {"pool": "interactive", "models": [{"name": "m-large", "path": "/nonexistent", "aliases": ["m"]},
                                        {"name": "m-small", "path": "/nonexistent-too"}],
     "server": {"max_body_bytes": 64 << 10}}
)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def internal_errors(pool) -> float:
    return sum(s.value for m in pool.metrics.registry.collect() if m.name == "infermesh_internal_errors"
               for s in m.samples if s.name == "infermesh_internal_errors_total")


check = fuzz_inputs.check_answer


def run(client, cases, pool) -> int:
    deadline = time.monotonic() + BUDGET_S
    done = 0
    for case in cases:
        if done >= MIN_CASES and time.monotonic() > deadline:
            break
        r = client.request(case.method, case.path, content=case.body, headers=case.headers)
        check(r, case)
        done += 1
    assert internal_errors(pool) == 0
    return done


@pytest.fixture
def front(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    # raise_server_exceptions=False: a server error must come back as the client sees it.
    client = TestClient(build_app(pool), raise_server_exceptions=False)
    client.pool = pool
    return client


def test_mutated_openai_requests_never_get_a_5xx(front):
    n = run(front, fuzz_inputs.api_cases(SEED, 1500), front.pool)
    r = front.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    assert front.pool.inflight == 0
    print(f"{n} mutated requests")


def test_the_cases_issue_28_found(front):
    """Each kind the mesh fuzz found, answered with a 400 naming the field."""
    chat = json.dumps(CHAT)
    cases = [
        ("/v1/chat/completions", json.dumps(CHAT | {"structured_outputs": 5}), "body.structured_outputs"),
        ("/v1/chat/completions", json.dumps(CHAT | {"structured_outputs": [1]}), "body.structured_outputs"),
        ("/v1/completions", json.dumps({"prompt": "x", "structured_outputs": "s"}), "body.structured_outputs"),
        ("/v1/chat/completions", chat.replace('"hi"', '"\\ud800"'), "body.messages.0.content"),
        ("/v1/chat/completions", chat.replace('"m"', '"\\udfff"'), "body.model"),
        ("/v1/chat/completions", chat.encode().replace(b'"hi"', b'"\xed\xa0\x80"'), "body.messages.0.content"),  # raw surrogate bytes
        ("/v1/responses", json.dumps({"input": "hi\ud800"}), "body.input"),
        ("/v1/messages", json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\udbff"}]}), "body.messages.0.content"),
        ("/tokenize", json.dumps({"model": "\ud800", "prompt": "x"}), "body.model"),
        ("/detokenize", json.dumps({"tokens": [1], "model": "\ud800"}), "body.model"),
        ("/v1/chat/completions", "[" * 1024 + "]" * 1024, "body"),
        ("/v1/completions", '{"prompt":' + "[" * 1024 + "]" * 1024 + "}", "body"),
        ("/v1/chat/completions", '{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":' + "[" * 200 + "]" * 200 + "}", "body.tools"),
        ("/v1/chat/completions", json.dumps(CHAT).replace("4}", "NaN}"), "body"),
    ]
    for path, body, param in cases:
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        r = front.post(path, content=data, headers={"content-type": "application/json"})
        assert r.status_code == 400, f"{path} {body[:80]!r}: {r.status_code} {r.text[:200]}"
        err = r.json()["error"]
        assert err["message"] and (err.get("param") or "").startswith(param), (body[:80], err)
    assert not front.pool.primary.engine.requests, "a refused request must not reach the engine"
    assert internal_errors(front.pool) == 0


def test_the_state_endpoint_never_gets_a_5xx(front):
    n = run(front, fuzz_inputs.state_cases(SEED, 80), front.pool)
    r = front.get("/infermesh/state?healthy_below=%C2%B2")
    assert r.status_code == 400 and r.json()["error"]["param"] == "healthy_below"
    assert front.get("/infermesh/state?healthy_below=1").status_code == 200
    assert n >= len(fuzz_inputs.STATE_QUERIES)


def test_odd_mesh_headers_never_get_a_5xx(front):
    """The headers the mesh sets, as anything could send them to a sidecar port."""
    for value in ["²", "9" * 5000, "-1", "", "1e3", "٣", "0x10", " 5"]:
        for name in ("x-infermesh-ttft-give-up-ms", "content-length-ignored", "x-infermesh-class", "x-infermesh-pool"):
            r = front.post("/v1/chat/completions", json=CHAT, headers={name: value.encode("utf-8")})
            assert r.status_code == 200, (name, value, r.status_code, r.text[:200])
    assert internal_errors(front.pool) == 0


def test_mutated_admin_requests_never_get_a_5xx(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    client = TestClient(build_admin_app(pool), raise_server_exceptions=False)
    n = run(client, fuzz_inputs.admin_cases(SEED, 300, sorted(SIGNALS)), pool)
    for bad, param in [(b"5", "body"), (b'{"value": "0.5"}', "value"), (b'{"value": 0.5, "duration_s": true}', "duration_s"),
                       (b'{"value": NaN}', "body"), (b'{"value": 1e400}', "value"), (b"{" * 2000, "body"), (b'{"value": "\\ud800"}', "body.value")]:
        r = client.put("/admin/faults/kv_cache", content=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad[:40], r.text[:200])
    assert client.delete("/admin/faults").status_code == 200
    assert client.get("/admin/state").status_code == 200
    r = client.put("/admin/faults/kv_cache", json={"value": 0.5, "duration_s": 5})
    assert r.status_code == 200 and r.json()["value"] == 0.5
    assert n >= MIN_CASES
