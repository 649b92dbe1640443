"""e2e: the sidecar's serving contract against real vLLM, with the real openai SDK and grpcio.

n > 1, client disconnects, gRPC deadlines and the mesh's TTFT give-up limit (streamed or not)
abort the vLLM request (checked with vLLM's own count of unfinished requests), duplicate request
ids, the gRPC Admin service, and SIGTERM drain.
"""

from __future__ import annotations

import asyncio

import json
import signal
import subprocess
import sys
import threading

import grpc
import httpx
import openai
import pytest

from infermesh import paths
from infermesh.launcher import free_ports, wait_until as wait_for
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e


def engines(mesh, pool: str) -> dict:
    return {e["model"]: e for e in mesh.admin_state(pool)["engines"]}


def grpc_port(mesh, pool: str) -> int:
    return next(p for p in mesh.plan.pools if p.name == pool).grpc_port


def test_n_choices_through_the_mesh(local_mesh):
    client = openai.OpenAI(base_url=local_mesh.base_url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15
    stream = client.completions.create(model="tiny-llama", prompt="Once", n=2, max_tokens=4, stream=True)
    got: dict[int, str] = {}
    finish: dict[int, str] = {}
    for ch in stream:
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(got) == {0, 1} and finish == {0: "length", 1: "length"}


def test_a_vanished_http_client_frees_its_vllm_request(local_mesh):
    mesh = local_mesh
    assert wait_for(lambda: engines(mesh, "interactive")["tiny-llama-large"]["unfinished"] == 0, 30, what="an idle engine")
    with httpx.stream(
        "POST", mesh.base_url + "/v1/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 900, "stream": True},
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        assert engines(mesh, "interactive")["tiny-llama-large"]["unfinished"] == 1
    # The client closed the connection mid-stream: Envoy resets the upstream, the sidecar aborts.
    wait_for(lambda: engines(mesh, "interactive")["tiny-llama-large"]["unfinished"] == 0, 10, what="vLLM to drop the request")
    wait_for(lambda: engines(mesh, "interactive")["tiny-llama-large"]["in_flight"] == 0, 10, what="the sidecar to forget it")


def test_grpc_deadline_and_cancel_abort_the_request(local_mesh):
    mesh = local_mesh
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port(mesh, 'interactive')}") as ch:
        stub = pb_grpc.InferenceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            for _ in stub.Generate(pb.GenerateRequest(text="count", max_tokens=900), timeout=0.5):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: engines(mesh, "interactive")["tiny-llama-large"]["unfinished"] == 0, 10, what="abort after deadline")
        call = stub.Generate(pb.GenerateRequest(text="count", max_tokens=900), timeout=60)
        next(call)
        call.cancel()
        wait_for(lambda: engines(mesh, "interactive")["tiny-llama-large"]["unfinished"] == 0, 10, what="abort after cancel")


def test_no_first_token_at_the_give_up_limit_is_a_504_and_an_abort_streamed_or_not(local_mesh):
    """The sidecar's side of a hedging class's give-up (docs/replicas.md): Envoy's route sets
    `x-infermesh-ttft-give-up-ms` (a client's own is stripped), so it is sent to the sidecar here,
    with the primary engine stalled (SIGSTOP) so that no first token can come."""
    mesh = local_mesh
    model = "tiny-llama-large"
    assert wait_for(lambda: engines(mesh, "interactive")[model]["unfinished"] == 0, 30, what="an idle engine")
    admin = mesh.admin_url("interactive")
    r = httpx.put(admin + "/admin/faults/stall", json={"value": 0.95, "duration_s": 20, "period_s": 10}, timeout=5)
    assert r.status_code == 200, r.text
    try:
        for stream in (False, True):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": stream}
            r = httpx.post(mesh.sidecar_url("interactive") + "/v1/chat/completions", json=body, timeout=30,
                           headers={"x-infermesh-ttft-give-up-ms": "1000"})
            assert r.status_code == 504, (stream, r.text)
            assert r.json()["error"]["code"] == "ttft_deadline_exceeded" and r.headers["retry-after"] == "1"
            assert r.elapsed.total_seconds() < 5, r.elapsed
            # Still stalled (9.5 s of every 10): vLLM cannot have finished it, so it was aborted.
            assert engines(mesh, "interactive")[model]["unfinished"] == 0, stream
    finally:
        httpx.delete(admin + "/admin/faults/stall", timeout=5)
    wait_for(lambda: mesh.admin_state("interactive")["level"] == 0, 60, every=1, what="the pool back to level 0")


def test_duplicate_request_id_is_rejected_while_in_flight(local_mesh):
    mesh = local_mesh
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port(mesh, 'interactive')}") as ch:
        stub = pb_grpc.InferenceStub(ch)
        first = stub.Generate(pb.GenerateRequest(request_id="dup-1", text="a", max_tokens=600), timeout=60)
        next(first)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(request_id="dup-1", text="b", max_tokens=2), timeout=10))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        first.cancel()
        wait_for(lambda: engines(mesh, "interactive")["tiny-llama-large"]["in_flight"] == 0, 10, what="cancel")
        done = list(stub.Generate(pb.GenerateRequest(request_id="dup-1", text="b", max_tokens=2), timeout=30))
        assert done[-1].HasField("final"), "the id is free again once the first request ended"


def test_grpc_admin_service(local_mesh):
    pool = next(p for p in local_mesh.plan.pools if p.name == "interactive")
    with grpc.insecure_channel(f"127.0.0.1:{pool.admin_grpc_port}") as ch:
        stub = pb_grpc.AdminStub(ch)
        st = stub.GetState(pb.GetStateRequest(), timeout=5)
        assert st.pool == "interactive" and st.primary_model == "tiny-llama-large"
        assert {b.signal for b in st.breakers} >= {"kv_cache", "cpu_load"}
        watch = stub.WatchState(pb.WatchStateRequest(), timeout=30)
        first = next(watch)
        assert first.HasField("state")
        httpx.put(local_mesh.admin_url("interactive") + "/admin/faults/kv_cache", json={"value": 0.99, "duration_s": 3}, timeout=5)
        try:
            ev = next(watch)
            assert ev.HasField("transition") and ev.transition.to_state == "open" and ev.transition.breaker == "kv-cache"
        finally:
            watch.cancel()
            httpx.delete(local_mesh.admin_url("interactive") + "/admin/faults", timeout=5)


def test_admin_port_is_not_reachable_through_the_mesh(local_mesh):
    r = httpx.get(local_mesh.base_url + "/admin/state", timeout=10)
    assert r.status_code == 404, "the mesh routes /admin/* to a pool's serving port, which has no admin API"


def test_sigterm_drains_in_flight_streams_and_refuses_new_work(tmp_path):
    http_port, grpc_p, admin_port = free_ports(3)
    cfg = {
        "pool": "drain-test",
        "models": [{"name": "tiny-llama-small", "path": str(paths.models_dir() / "tiny-llama-small"), "max_model_len": 1024,
                    "kv_cache_bytes": 32 << 20}],
        "server": {"http_port": http_port, "grpc_port": grpc_p, "drain_grace_s": 30},
        "admin": {"port": admin_port},
    }
    (tmp_path / "sidecar.json").write_text(json.dumps(cfg))
    log = open(tmp_path / "sidecar.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "infermesh.sidecar.server", "--config", str(tmp_path / "sidecar.json")],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_for(lambda: proc.poll() is None and _ok(base + "/health"), 240, every=0.5, what="the sidecar to start")
        result: dict = {}

        def long_stream():
            with httpx.stream("POST", base + "/v1/completions",
                              json={"prompt": "a", "max_tokens": 600, "stream": True, "ignore": 1}, timeout=60) as r:
                text = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                result["status"], result["last"] = r.status_code, text[-1] if text else ""
                result["finish"] = [json.loads(t[6:])["choices"][0].get("finish_reason") for t in text[:-1] if json.loads(t[6:])["choices"]]

        t = threading.Thread(target=long_stream)
        t.start()
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin_port}/admin/state", timeout=5).json()["in_flight"] == 1, 20, what="stream start")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(base + "/health", timeout=5).status_code == 503, 10, what="health to turn unavailable")
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "retry-after" in r.headers
        t.join(timeout=60)
        assert result["status"] == 200 and result["last"] == "data: [DONE]", result
        assert result["finish"][-1] == "length", "the in-flight stream ran to its end during the drain"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_oversize_requests_get_clear_errors(local_mesh):
    mesh = local_mesh
    big = "x" * (5 << 20)  # over the sidecar's 4 MiB max_body_bytes
    r = httpx.post(mesh.base_url + "/v1/completions", json={"model": "tiny-llama", "prompt": big, "max_tokens": 2}, timeout=60)
    assert r.status_code == 413, r.text[:300]
    assert "limit" in r.json()["error"]["message"]

    # Many at once, through Envoy: every client reads its 413. Answering before the body was in
    # reset the connection under 2 in 5 of them (found by the bad-requests drill).
    async def many() -> list:
        body = json.dumps({"model": "tiny-llama", "prompt": big}).encode()
        async with httpx.AsyncClient(base_url=mesh.base_url, timeout=60) as c:
            async def one():
                try:
                    return (await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})).status_code
                except httpx.HTTPError as e:
                    return type(e).__name__
            return await asyncio.gather(*[one() for _ in range(12)])

    assert asyncio.run(many()) == [413] * 12
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port(mesh, 'interactive')}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(text=big, max_tokens=2), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The pool is unharmed.
    ok = httpx.post(mesh.base_url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
