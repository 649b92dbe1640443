"""The OpenAI HTTP front: vLLM's own serving layer on a fake engine (conftest.FakeVllmAsyncLLM: the
real config and tokenizer of the small local model, scripted outputs). What infermesh adds is
checked here: admission before vLLM's layer, the class's priority, identity headers and
`usage.infermesh`, headers only with the first token, errors as statuses, release on every way
out. That vLLM's layer answers like `vllm serve` is the differential e2e test's job."""

import asyncio
import json

import httpx
import pytest
import vllm  # noqa: F401  a hard dependency: a vLLM that is missing or moved fails here, never skips
from fastapi.testclient import TestClient

from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.http_api import build_app

CONFIG = SidecarConfig.model_validate(
    {"pool": "interactive", "models": [{"name": "m-large", "path": "/nonexistent", "aliases": ["m"]},
                                        {"name": "m-small", "path": "/nonexistent-too"}],
     "classes": {"interactive": {"priority": 0, "vllm_priority": 0}, "batch": {"priority": 10, "sheddable": True, "vllm_priority": 7}},
     "server": {"max_body_bytes": 2048}, "mesh_pools": ["interactive", "gpu-large"]}
)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def client(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    c = TestClient(build_app(pool))
    c.pool = pool
    c.llm = pool.primary.engine  # the FakeVllmAsyncLLM
    return c


def sample(client, name, **labels):
    return client.pool.metrics.registry.get_sample_value(name, labels)


def sse(r) -> list:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_chat_non_stream_is_vllms_answer_with_infermesh_additions(client):
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "m-large"
    assert body["choices"][0]["message"]["content"] == "Hello world!"
    assert body["choices"][0]["message"]["role"] == "assistant"
    n = len(client.llm.reply_ids)
    assert body["usage"]["completion_tokens"] == n
    assert body["usage"]["infermesh"] == {"model": "m-large", "degraded": False, "degraded_reason": None, "served_by": "interactive/0"}
    assert r.headers["x-infermesh-served-by"] == "interactive/0"
    assert r.headers["x-infermesh-model"] == "m-large" and r.headers["x-infermesh-degraded"] == "false"
    assert client.pool.inflight == 0 and not client.llm.unfinished
    assert sample(client, "infermesh_sidecar_requests_total", front="http", api="chat", request_class="", status="200") == 1
    assert sample(client, "infermesh_sidecar_completion_tokens_total", model="m-large") == n
    assert sample(client, "infermesh_sidecar_prompt_tokens_total", model="m-large") == body["usage"]["prompt_tokens"]


def test_chat_stream_is_sse_with_usage_and_done(client):
    with client.stream("POST", "/v1/chat/completions",
                       json=CHAT | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no" and r.headers["x-infermesh-model"] == "m-large"
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello world!"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    n = len(client.llm.reply_ids)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == n
    assert chunks[-1]["usage"]["infermesh"]["served_by"] == "interactive/0"
    assert client.pool.inflight == 0, "the stream's request must be released when the response ends"
    assert not client.llm.aborted, "a finished request has nothing to abort"
    labels = {"front": "http", "request_class": ""}
    assert sample(client, "infermesh_sidecar_requests_total", **labels, api="chat", status="200") == 1
    assert sample(client, "infermesh_sidecar_time_to_first_token_seconds_count", **labels) == 1
    assert sample(client, "infermesh_sidecar_inter_token_latency_seconds_count", **labels) == n - 1
    assert sample(client, "infermesh_sidecar_completion_tokens_total", model="m-large") == n


def test_stream_of_n_choices_and_several_prompts(client):
    with client.stream("POST", "/v1/completions", json={"prompt": ["x", "y"], "n": 2, "stream": True}) as r:
        chunks = [json.loads(e) for e in sse(r) if e.startswith("{")]
    text: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            text[ch["index"]] = text.get(ch["index"], "") + ch["text"]
    assert text == {i: "Hello world!" for i in range(4)}, "two prompts x two choices, as vLLM numbers them"
    assert len(client.llm.requests) == 2 and client.pool.inflight == 0


def test_token_id_prompts_and_echo(client):
    ids = client.llm.reply_ids[:2]
    r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 2})
    assert r.status_code == 200, r.text
    prompt_text = client.llm.renderer.tokenizer.decode(ids)
    assert r.json()["choices"][0]["text"] == prompt_text + prompt_text, "echo: the token-id prompt, then the completion"


def test_client_priority_and_request_id_never_reach_vllm(client):
    r = client.post("/v1/chat/completions", json=CHAT | {"priority": 99, "request_id": "mine"},
                    headers={"x-infermesh-class": "batch", "X-Request-Id": "mine-too"})
    assert r.status_code == 200, r.text
    (rid, _, priority), = client.llm.requests
    assert priority == 7, "the class's vLLM priority, not the body's"
    assert "mine" not in rid and r.json()["id"] == rid


def test_degraded_request_is_served_by_the_fallback_under_its_name(client):
    from types import SimpleNamespace

    client.pool.admission.policy = SimpleNamespace(actions={"degrade"}, reasons=lambda: ["kv:kv_cache"])  # an open breaker
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "m-small" and r.headers["x-infermesh-model"] == "m-small"
    assert r.headers["x-infermesh-degraded"] == "true" and r.headers["x-infermesh-degraded-reason"] == "kv:kv_cache"
    assert r.json()["usage"]["infermesh"]["degraded"] is True
    assert client.pool.ladder[1].engine.requests and not client.llm.requests


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1,2]", 400, "body"),
        ("/v1/chat/completions", json.dumps({"messages": [{"content": "x"}]}).encode(), 400, None),
        ("/v1/chat/completions", json.dumps(CHAT | {"temperature": "hot"}).encode(), 400, "body.temperature"),
        ("/v1/chat/completions", json.dumps(CHAT | {"stream": True, "stream_options": 5}).encode(), 400, "body.stream_options"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(), 400, None),
        ("/v1/chat/completions", json.dumps(CHAT | {"model": "gpt-9"}).encode(), 404, "model"),  # vLLM's NotFoundError
        ("/v1/chat/completions", json.dumps(CHAT | {"n": 99}).encode(), 400, "n"),
        ("/v1/chat/completions", json.dumps(CHAT | {"max_tokens": 5000}).encode(), 400, None),
        ("/v1/completions", json.dumps({"prompt": {"a": 1}}).encode(), 400, None),
        ("/v1/completions", json.dumps({"prompt": "x" * 4000}).encode(), 413, None),
    ],
)
def test_bad_requests_get_4xx_openai_errors(client, path, body, status, param):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if param is not None:
        assert (err["param"] or "").startswith(param), err
    assert not client.llm.requests, "a rejected request must not reach the engine"
    assert client.pool.inflight == 0


def test_a_non_json_content_type_is_refused_as_vllm_does(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]


def test_overload_is_429_with_retry_after(client):
    client.pool.admission.inflight.update({f"r{i}": client.pool.primary for i in range(CONFIG.server.max_concurrent_requests)})
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_not_ready_is_503(client):
    client.pool.primary.engine = None
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "retry-after" in r.headers
    assert client.get("/health").status_code == 503


def test_an_engine_failure_before_the_first_token_is_a_status_not_a_200_stream(client):
    client.llm.fail_after = 0
    r = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert r.status_code >= 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["message"]
    assert client.pool.inflight == 0


def test_models_tokenize_detokenize_and_metrics(client):
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["m-large", "m-small"]
    assert cards[0]["max_model_len"] == 1024 and cards[0]["root"] == "/nonexistent"
    tok = client.post("/tokenize", json={"model": "m", "prompt": "Hello world!"})
    assert tok.status_code == 200, tok.text
    ids = tok.json()["tokens"]
    assert client.post("/detokenize", json={"model": "m", "tokens": ids}).json()["prompt"].endswith("Hello world!")
    assert client.post("/tokenize", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    client.post("/v1/completions", json={"prompt": "x"})
    text = client.get("/metrics").text
    assert 'infermesh_sidecar_requests_total{api="completions",front="http",request_class="",status="200"} 1.0' in text


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages(client, stream):
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-infermesh-model"] == "m-large" and client.pool.inflight == 0
    if stream:
        assert "message_stop" in r.text and "text_delta" in r.text
    else:
        assert r.json()["content"][0]["text"] == "Hello world!"


def test_a_vanished_non_streaming_client_releases_its_request_at_once(client):
    """Raw ASGI: the body, then the client hangs up while the engine holds the request."""
    app, llm = client.app, client.llm

    async def run():
        llm.gate = asyncio.Event()
        body = json.dumps({"prompt": "x", "max_tokens": 5}).encode()
        sent = asyncio.Event()
        msgs = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if msgs:
                return msgs.pop()
            while not llm.unfinished:
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await asyncio.wait_for(app(scope, receive, send), timeout=5)

    asyncio.run(run())
    assert not client.llm.unfinished and client.pool.inflight == 0 and len(client.llm.aborted) == 1
    assert sample(client, "infermesh_sidecar_requests_total", front="http", api="completions", request_class="", status="499") == 1


def test_vllm_series_of_every_engine_are_served_as_one_family_each():
    """Each engine has its own vLLM logger; the second unregistered the first's (vLLM does that)."""
    from prometheus_client import Counter

    from infermesh.sidecar.metrics import process_metrics

    engines = []
    for model in ("big", "small"):
        c = Counter("vllm:fake_tokens", "Tokens.", ["model_name"], registry=None)
        c.labels(model).inc(3)
        engines.append({c})
    text = process_metrics(engines).decode()
    assert text.count("# TYPE vllm:fake_tokens_total counter") == 1
    assert 'vllm:fake_tokens_total{model_name="big"} 3.0' in text and 'vllm:fake_tokens_total{model_name="small"} 3.0' in text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api(client, stream):
    r = client.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 8, "stream": stream})
    assert r.status_code == 200, r.text
    assert r.headers["x-infermesh-model"] == "m-large" and client.pool.inflight == 0
    if stream:
        assert "response.completed" in r.text and "Hello world!" in r.text
    else:
        assert r.json()["output"][-1]["content"][0]["text"] == "Hello world!"


def test_top_logprobs_without_logprobs_is_vllms_400(client):
    r = client.post("/v1/chat/completions", json=CHAT | {"top_logprobs": 3})
    assert r.status_code == 400, r.text


def test_no_first_token_within_the_meshs_ttft_limit_is_a_504(client):
    client.llm.reply_ids = []  # never a token: the fake's stream ends without output; hold it instead
    client.llm.gate = asyncio.Event()

    async def silent(prompt, params, request_id, priority=0, **kw):
        client.llm.unfinished.add(request_id)
        try:
            await asyncio.sleep(30)
            yield None
        finally:
            client.llm.unfinished.discard(request_id)

    client.llm.generate = silent
    r = client.post("/v1/chat/completions", json=CHAT | {"stream": True}, headers={"x-infermesh-ttft-give-up-ms": "200"})
    assert r.status_code == 504 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "ttft_deadline_exceeded"
    assert client.pool.inflight == 0 and not client.llm.unfinished


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


def test_the_state_endpoint_is_the_spill_health_check_below_a_level(client, monkeypatch):
    """Envoy's health check of a pool that spills (envoy_resources.health_checks): 200 while the
    replica is below the level, 503 from it up and while not serving; a bad bound is a 400."""
    def status(n) -> int:
        return client.get(f"/infermesh/state?healthy_below={n}").status_code

    assert [status(n) for n in (1, 3, 4)] == [200, 200, 200]
    monkeypatch.setattr(type(client.pool.policy), "level", property(lambda self: 3))
    assert [status(n) for n in (1, 3, 4)] == [503, 503, 200]
    r = client.get("/infermesh/state?healthy_below=3")
    assert r.json()["level"] == 3 and r.headers["x-infermesh-pool-level"] == "interactive;3;0"
    client.pool.admission.draining = True
    assert status(4) == 503
    for bad in ("0", "5", "x", "", "-1"):
        r = client.get(f"/infermesh/state?healthy_below={bad}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "healthy_below", bad


def test_a_request_the_mesh_bound_for_another_pool_is_counted_as_spilled_in(client):
    """Envoy's failover keeps the route's x-infermesh-pool: the pool that served a spill counts it."""
    client.post("/v1/completions", json={"prompt": "say", "max_tokens": 2}, headers={"x-infermesh-pool": "interactive"})
    assert sample(client, "infermesh_sidecar_spilled_in_requests_total", bound_for="interactive") is None, "its own pool"
    for _ in range(2):
        r = client.post("/v1/completions", json={"prompt": "say", "max_tokens": 2}, headers={"x-infermesh-pool": "gpu-large"})
        assert r.status_code == 200
    assert sample(client, "infermesh_sidecar_spilled_in_requests_total", bound_for="gpu-large") == 2
