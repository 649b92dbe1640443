"""A stream's response headers go out with its first token (fake engines, conftest.py): an error
before it is a real HTTP status, and a client that leaves before it (Envoy resetting the losing
attempt of a hedge) aborts the generation. gRPC's initial metadata also waits for the first message."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from fastapi.testclient import TestClient

from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.http_api import build_app

CONFIG = SidecarConfig.model_validate({"pool": "interactive", "models": [{"name": "m-large", "path": "/nonexistent"}]})
CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


def _hold_first_token(llm) -> asyncio.Event:
    """Make every generation wait on the returned event before its first token."""
    opened = asyncio.Event()
    inner = llm.generate

    async def generate(*a, **kw):
        gen = inner(*a, **kw)
        await opened.wait()
        async for out in gen:
            yield out

    llm.generate = generate
    return opened


def test_an_error_before_the_first_token_is_a_real_status(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    pool.primary.engine.fail_after = 0
    r = TestClient(build_app(pool)).post("/v1/chat/completions", json=CHAT)
    assert r.status_code >= 500, r.text
    assert r.json()["error"]["type"]
    assert pool.inflight == 0


def test_a_stream_still_begins_with_its_first_token(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    with TestClient(build_app(pool)).stream("POST", "/v1/chat/completions", json=CHAT) as r:
        assert r.status_code == 200
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert lines[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert lines[1]["choices"][0]["delta"] == {"content": "Hello"}


async def _asgi(app, body: bytes, disconnect_after: float | None, opened: asyncio.Event | None = None, open_after: float = 0,
                headers: list[tuple[bytes, bytes]] = ()):
    """Drive the app over raw ASGI; returns (seconds until the response start, messages sent)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    sent: list[tuple[float, dict]] = []
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if msgs:
            return msgs.pop(0)
        if disconnect_after is not None:
            await asyncio.sleep(max(0.0, t0 + disconnect_after - loop.time()))
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()

    async def send(m):
        sent.append((loop.time() - t0, m))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    if opened is not None:
        loop.call_later(open_after, opened.set)
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


def test_headers_wait_for_the_first_token(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    opened = _hold_first_token(pool.primary.engine)
    sent = asyncio.run(_asgi(build_app(pool), json.dumps(CHAT).encode(), None, opened, open_after=0.3))
    start = next(t for t, m in sent if m["type"] == "http.response.start")
    assert start >= 0.3, f"headers went out {start:.3f}s in, before the first token (0.3 s)"
    assert pool.inflight == 0


def test_a_client_gone_before_the_first_token_aborts_the_generation(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    llm = pool.primary.engine
    _hold_first_token(llm)  # never opened: a stalled engine
    sent = asyncio.run(_asgi(build_app(pool), json.dumps(CHAT).encode(), disconnect_after=0.2))
    assert not any(m.get("status") == 200 for _, m in sent)
    assert len(llm.aborted) == 1 and not llm.unfinished
    assert pool.inflight == 0


@pytest.mark.parametrize("first_after", [0.3])
def test_grpc_initial_metadata_waits_for_the_first_message(make_pool, first_after):
    from infermesh.sidecar.grpc_api import InferenceServicer
    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

    async def main():
        pool = make_pool(CONFIG)
        opened = _hold_first_token(pool.primary.engine)
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(pool), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                loop.call_later(first_after, opened.set)
                call = pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(text="hi"))
                await call.initial_metadata()
                waited = loop.time() - t0
                [m async for m in call]
        finally:
            await server.stop(0)
        return waited

    waited = asyncio.run(main())
    assert waited >= first_after, f"initial metadata came {waited:.3f}s in, before the first message"


def test_no_first_token_within_the_give_up_limit_is_a_504_and_an_abort(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    llm = pool.primary.engine
    _hold_first_token(llm)  # a stalled engine
    r = TestClient(build_app(pool)).post("/v1/chat/completions", json=CHAT, headers={"x-infermesh-ttft-give-up-ms": "200"})
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "ttft_deadline_exceeded"
    assert r.headers["retry-after"] == "1"
    assert len(llm.aborted) == 1 and not llm.unfinished and pool.inflight == 0


def test_a_first_token_in_time_streams_as_usual(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    r = TestClient(build_app(pool)).post("/v1/chat/completions", json=CHAT, headers={"x-infermesh-ttft-give-up-ms": "5000"})
    assert r.status_code == 200 and "data: [DONE]" in r.text


NON_STREAMED = {"messages": [{"role": "user", "content": "hi"}], "n": 2}


def test_a_non_streamed_request_without_a_first_token_at_the_give_up_limit_is_a_504_and_an_abort(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    llm = pool.primary.engine
    client = TestClient(build_app(pool))
    assert client.post("/v1/chat/completions", json=NON_STREAMED).status_code == 200  # warm: the first render is slow
    _hold_first_token(llm)  # a stalled engine
    r = client.post("/v1/chat/completions", json=NON_STREAMED, headers={"x-infermesh-ttft-give-up-ms": "500"})
    assert r.status_code == 504, r.text
    assert r.json()["error"] == {"message": "no first token within 500 ms", "type": "server_error", "param": None,
                                 "code": "ttft_deadline_exceeded"}
    assert r.headers["retry-after"] == "1" and r.headers["x-infermesh-model"] == "m-large"
    assert len(llm.aborted) == 1
    assert not llm.unfinished and pool.inflight == 0
    assert pool.metrics.requests.labels("http", "chat", "", "504")._value.get() == 1


def test_a_non_streamed_request_with_its_first_token_in_time_may_finish_after_the_give_up_limit(make_vllm_pool):
    pool = make_vllm_pool(CONFIG)
    llm = pool.primary.engine
    app = build_app(pool)
    assert TestClient(app).post("/v1/chat/completions", json=NON_STREAMED).status_code == 200  # warm: the first render is slow
    llm.gate = asyncio.Event()  # every choice's first token, then a pause past the limit

    async def main():
        asyncio.get_running_loop().call_later(1.0, llm.gate.set)
        body = json.dumps(NON_STREAMED).encode()
        return await _asgi(app, body, None, headers=[(b"x-infermesh-ttft-give-up-ms", b"500")])

    sent = asyncio.run(main())
    start = next((t, m) for t, m in sent if m["type"] == "http.response.start")
    assert start[1]["status"] == 200 and start[0] >= 1.0
    out = json.loads(b"".join(m.get("body", b"") for _, m in sent))
    # Both choices in full, as vLLM's FINAL_ONLY output gathers them (the front watched the
    # cumulative outputs for the first token).
    assert [c["message"]["content"] for c in out["choices"]] == ["Hello world!", "Hello world!"]
    assert out["usage"]["completion_tokens"] == 2 * len(llm.reply_ids)
    assert not llm.aborted and pool.inflight == 0


def test_without_a_give_up_limit_a_non_streamed_request_stays_final_only(make_vllm_pool):
    from vllm.sampling_params import RequestOutputKind

    pool = make_vllm_pool(CONFIG)
    r = TestClient(build_app(pool)).post("/v1/chat/completions", json=NON_STREAMED)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert pool.primary.engine.requests[0][1].output_kind == RequestOutputKind.FINAL_ONLY


@pytest.mark.parametrize("value", ["", "abc", "-5", "0"])
def test_a_bad_give_up_value_is_ignored(value):
    from infermesh.sidecar.requests import ttft_give_up_s

    assert ttft_give_up_s(value) is None
