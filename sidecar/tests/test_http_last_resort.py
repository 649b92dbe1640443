"""The HTTP fronts' last resort (sidecar/internal_errors.py): an exception nothing answered is a
JSON 500 of type internal_error, logged with its traceback and counted in
infermesh_internal_errors_total{front, api}; inside a stream that has started, a last error event."""

import json
import logging

import pytest
from fastapi.testclient import TestClient

from infermesh.sidecar import http_api
from infermesh.sidecar.admin_api import build_admin_app
from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.http_api import build_app

CONFIG = SidecarConfig.model_validate({"pool": "interactive", "models": [{"name": "m-large", "path": "/nonexistent"}]})
CHAT = {"model": "m-large", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def counted(pool, front: str, api: str) -> float | None:
    return pool.metrics.registry.get_sample_value("infermesh_internal_errors_total", {"front": front, "api": api})


@pytest.fixture
def client(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    c = TestClient(build_app(pool), raise_server_exceptions=False)
    c.pool = pool
    return c


def test_an_unexpected_exception_is_a_logged_counted_json_500(client, monkeypatch, caplog):
    def broken(bound_for):
        raise KeyError("a bug")

    monkeypatch.setattr(client.pool, "note_bound_for", broken)
    with caplog.at_level(logging.ERROR, logger="infermesh.sidecar.internal"):
        r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "internal_error" and "KeyError" in r.json()["error"]["message"]
    assert r.headers["x-infermesh-pool-level"], "the pool-level header is on every answer, this one too"
    assert counted(client.pool, "http", "chat") == 1
    rec, = [rec for rec in caplog.records if rec.name == "infermesh.sidecar.internal"]
    assert rec.exc_info and rec.exc_info[0] is KeyError and rec.front == "http" and rec.api == "chat"
    assert "infermesh_internal_errors_total" in client.get("/metrics").text


def test_an_exception_inside_a_started_stream_ends_it_with_an_error_event(client, monkeypatch):
    def broken(chunk, infermesh):
        raise RuntimeError("a bug in the usage chunk")

    monkeypatch.setattr(http_api, "_with_infermesh", broken)
    with client.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200  # already sent with the first token
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(lines[-1][6:])
    assert last["error"]["type"] == "internal_error"
    assert counted(client.pool, "http", "chat") == 1
    assert client.pool.inflight == 0, "the request is released however its stream ends"


def test_a_preparation_exception_vllm_would_answer_with_500_is_a_400(client, monkeypatch):
    """An input error raised while vLLM's layer prepares a request (before the engine): a 400."""
    serving = client.app.state.serving.of(client.pool.primary).chat

    def odd(*args, **kwargs):
        raise AttributeError("'int' object has no attribute 'get'")

    monkeypatch.setattr(serving, "_effective_chat_template_kwargs", odd)
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400 and "AttributeError" in r.json()["error"]["message"], r.text
    assert counted(client.pool, "http", "chat") is None
    assert not client.pool.primary.engine.requests


def test_the_admin_api_has_the_same_last_resort(make_vllm_pool, monkeypatch):
    pool = make_vllm_pool(CONFIG)
    client = TestClient(build_admin_app(pool), raise_server_exceptions=False)

    def broken():
        raise ValueError("a bug")

    monkeypatch.setattr(pool, "state", broken)
    r = client.get("/admin/state")
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert counted(pool, "admin", "state") == 1
    r = client.get("/admin/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


def test_a_client_that_leaves_mid_body_is_not_an_internal_error(client):
    """Starlette raises ClientDisconnect from the body stream: the client's going, not a bug."""
    import asyncio

    app = client.app
    sent = []

    async def go():
        messages = iter([{"type": "http.request", "body": b'{"model": "m-large", ', "more_body": True}, {"type": "http.disconnect"}])

        async def receive():
            return next(messages)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
                 "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "root_path": ""}
        await app(scope, receive, send)

    asyncio.run(go())
    assert counted(client.pool, "http", "chat") is None
    assert client.pool.inflight == 0
