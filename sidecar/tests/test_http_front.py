"""The OpenAI HTTP front on a pool of fake engines (conftest.py, no vLLM): request parsing, SSE
framing, error JSON and status codes, identity headers. The real engine is covered by the e2e tests."""

import json

import pytest
from fastapi.testclient import TestClient

from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.http_api import build_app

CONFIG = SidecarConfig.model_validate(
    {"pool": "interactive", "models": [{"name": "m-large", "path": "/nonexistent", "aliases": ["m"]}], "server": {"max_body_bytes": 2048}}
)


@pytest.fixture
def client(make_pool):
    pool = make_pool(CONFIG)
    c = TestClient(build_app(pool))
    c.pool = pool
    c.llm = pool.primary.engine  # the FakeAsyncLLM
    return c


def test_chat_non_stream(client):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world!"}
    assert body["usage"] == body["usage"] | {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert body["usage"]["infermesh"]["served_by"] == "interactive/0"
    assert r.headers["x-infermesh-served-by"] == "interactive/0"
    assert r.headers["x-infermesh-model"] == "m-large"
    assert r.headers["x-infermesh-degraded"] == "false"


def test_chat_stream_is_sse_with_usage_and_done(client):
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world!"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert client.pool.inflight == 0, "the stream's request must be released when the response ends"
    assert not client.llm.aborted, "a finished request has nothing to abort"
    reg = client.pool.metrics.registry
    labels = {"front": "http", "request_class": ""}
    assert reg.get_sample_value("infermesh_sidecar_requests_total", labels | {"api": "chat", "status": "200"}) == 1
    assert reg.get_sample_value("infermesh_sidecar_time_to_first_token_seconds_count", labels) == 1
    assert reg.get_sample_value("infermesh_sidecar_inter_token_latency_seconds_count", labels) == 2
    assert reg.get_sample_value("infermesh_sidecar_completion_tokens_total", {"model": "m-large"}) == 3


def test_stream_of_n_choices_frames_each_choice(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "n": 2, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)}
    assert text == {0: "Hello world!", 1: "Hello world!"}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == ["stop", "stop"]


def test_completions_prompt(client):
    r = client.post("/v1/completions", json={"prompt": "say", "max_tokens": 3})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "Hello world!"
    assert client.pool.metrics.registry.get_sample_value("infermesh_sidecar_prompt_tokens_total", {"model": "m-large"}) == 3


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1,2]", 400, None),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
        ("/v1/chat/completions", json.dumps({"messages": [{"content": "x"}]}).encode(), 400, "messages[0]"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), 400, "temperature"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 99}).encode(), 400, "n"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), 400, "n"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}).encode(), 404, "model"),
        ("/v1/completions", json.dumps({"prompt": 5}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": "x" * 4000}).encode(), 413, None),
    ],
)
def test_bad_requests_get_openai_errors(client, path, body, status, param):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] in ("invalid_request_error",)
    assert err["param"] == param
    assert not client.llm.priorities, "a rejected request must not reach the engine"


def test_overload_is_429_with_retry_after(client):
    client.pool.admission.inflight.update({f"r{i}": client.pool.primary for i in range(CONFIG.server.max_concurrent_requests)})
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_not_ready_is_503(client):
    client.pool.primary.engine = None
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "retry-after" in r.headers
    assert client.get("/health").status_code == 503


def test_models_and_metrics(client):
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m-large"]
    client.post("/v1/completions", json={"prompt": "x"})
    text = client.get("/metrics").text
    assert 'infermesh_sidecar_requests_total{api="completions",front="http",request_class="",status="200"} 1.0' in text



@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_delta_frames_are_byte_for_byte_the_generic_encoding(api, include_usage):
    from infermesh.sidecar.http_api import delta_framer

    rid, model = 'cmpl-a"b\\c', "m-\u00e9\u4e2d"
    frame = delta_framer(api, rid, 1733000000, model, include_usage)
    texts = ["", " hello", 'q"uote', "back\\slash", "nl\n\ttab\r", "\x00\x1f\x7f", "\u00e9\u4e2d\U0001f600", "\ud800"]
    for index in (0, 7, 123):
        for text in texts:
            choice = {"index": index, "delta": {"content": text}} if api == "chat" else {"index": index, "text": text}
            choice |= {"logprobs": None, "finish_reason": None}
            payload = {"id": rid, "object": "chat.completion.chunk" if api == "chat" else "text_completion",
                       "created": 1733000000, "model": model, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            assert frame(index, text) == b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def test_every_response_carries_the_pool_level_and_the_state_endpoint_is_read_only(client, monkeypatch):
    """The filter's pool state table reads `x-infermesh-pool-level` (POOL;LEVEL;REPLICA) from
    generation responses, refusals included, and probes GET /infermesh/state for idle pools."""
    r = client.post("/v1/completions", json={"prompt": "say", "max_tokens": 3})
    assert r.headers["x-infermesh-pool-level"] == "interactive;0;0"
    assert r.headers.get_list("x-infermesh-pool-level") == ["interactive;0;0"]
    bad = client.post("/v1/completions", json={"prompt": 3})
    assert bad.status_code == 400 and bad.headers["x-infermesh-pool-level"] == "interactive;0;0"
    s = client.get("/infermesh/state")
    assert s.status_code == 200 and s.json() == {"pool": "interactive", "instance": "0", "level": 0, "ready": True}
    assert s.headers["x-infermesh-pool-level"] == "interactive;0;0"
    monkeypatch.setattr(type(client.pool.policy), "level", property(lambda self: 3))  # breakers at critical-only
    assert client.get("/infermesh/state").json()["level"] == 3
    assert client.post("/v1/completions", json={"prompt": "say"}).headers["x-infermesh-pool-level"].split(";")[1] == "3"
    client.pool.admission.draining = True  # not serving: past every level, as the control plane counts it
    assert client.get("/infermesh/state").headers["x-infermesh-pool-level"] == "interactive;4;0"
    # Nothing to act on: no other method, no sub-path.
    assert client.post("/infermesh/state").status_code == 405
    assert client.delete("/infermesh/state").status_code == 405
    assert client.get("/infermesh/state/faults").status_code == 404
