"""e2e: the real local mesh (Envoy + compiled filter + two vLLM sidecars), real clients.

Which sidecar served is proven by what the sidecars themselves report: their own request and
token counters on /metrics (read straight from each sidecar, not through Envoy) and the
`served_by` they put in the response, never the filter's request header.
"""

from __future__ import annotations

import re
import urllib.request

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infermesh.launcher import wait_until
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("mesh_at_rest")]


def counter(mesh, pool: str, name: str, **labels) -> float:
    """Sum of a counter on one sidecar's own /metrics, over series matching `labels`."""
    with urllib.request.urlopen(mesh.sidecar_url(pool) + "/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def client(local_mesh):
    return openai.OpenAI(base_url=local_mesh.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_openai_sdk_streams_chat_through_envoy_from_the_interactive_pool(local_mesh, client):
    chat_before = {p: counter(local_mesh, p, "infermesh_sidecar_requests_total", api="chat") for p in ("interactive", "batch")}
    tokens_before = counter(local_mesh, "interactive", "infermesh_sidecar_completion_tokens_total")

    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Write a short poem about the sea."}],
        stream=True,
        max_tokens=24,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert raw.headers["x-infermesh-served-by"] == "interactive/0"
    pieces, usage, finish = [], None, None
    for chunk in raw.parse():
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            finish = ch.finish_reason or finish
    text = "".join(pieces)
    assert len(pieces) >= 2, "tokens arrive as several SSE events, not one buffered body"
    assert text and finish == "length"
    assert usage.completion_tokens == 24
    assert usage.model_extra["infermesh"]["served_by"] == "interactive/0"
    assert usage.model_extra["infermesh"]["model"] == "tiny-llama-large"

    # The interactive sidecar itself counted this chat request and its 24 tokens; batch did not.
    assert counter(local_mesh, "interactive", "infermesh_sidecar_requests_total", api="chat") == chat_before["interactive"] + 1
    assert counter(local_mesh, "batch", "infermesh_sidecar_requests_total", api="chat") == chat_before["batch"]
    assert counter(local_mesh, "interactive", "infermesh_sidecar_completion_tokens_total") == tokens_before + 24

    # The tokens are vLLM's: greedy decoding straight from the interactive sidecar gives the same text.
    direct = openai.OpenAI(base_url=local_mesh.sidecar_url("interactive") + "/v1", api_key="unused", max_retries=0)
    same = direct.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Write a short poem about the sea."}], max_tokens=24, temperature=0
    )
    assert same.choices[0].message.content == text


def test_completions_are_served_by_the_batch_pool(local_mesh, client):
    before = {p: counter(local_mesh, p, "infermesh_sidecar_requests_total", api="completions") for p in ("interactive", "batch")}
    raw = client.completions.with_raw_response.create(model="tiny-llama", prompt="Summarize: the mesh routes", max_tokens=8)
    done = raw.parse()
    assert done.model == "tiny-llama-small"
    assert done.usage.completion_tokens == 8 and done.choices[0].text
    assert raw.headers["x-infermesh-served-by"] == "batch/0"
    assert counter(local_mesh, "batch", "infermesh_sidecar_requests_total", api="completions") == before["batch"] + 1
    assert counter(local_mesh, "interactive", "infermesh_sidecar_requests_total", api="completions") == before["interactive"]


def test_a_client_cannot_pick_its_pool(local_mesh):
    before = counter(local_mesh, "interactive", "infermesh_sidecar_requests_total", api="completions")
    r = httpx.post(
        local_mesh.base_url + "/v1/completions",
        json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
        headers={"x-infermesh-pool": "interactive", "x-infermesh-class": "interactive"},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.json()["usage"]["infermesh"]["served_by"] == "batch/0"
    assert counter(local_mesh, "interactive", "infermesh_sidecar_requests_total", api="completions") == before


def test_errors_through_the_mesh_are_openai_errors(local_mesh, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    # vLLM's own error bodies, as `vllm serve` answers them (the HTTP front is vLLM's serving layer).
    assert e.value.body["type"] == "NotFoundError" and e.value.body["param"] == "model"
    r = httpx.post(local_mesh.base_url + "/v1/chat/completions", content=b"{broken", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"


def test_grpc_client_streams_tokens_from_generate(local_mesh):
    pool = next(p for p in local_mesh.plan.pools if p.name == "interactive")
    with grpc.insecure_channel(f"127.0.0.1:{pool.grpc_port}") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="infermesh.v1.Inference"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.InferenceStub(ch)
        call = stub.Generate(
            pb.GenerateRequest(
                chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hello!")]), max_tokens=12, temperature=0
            ),
            timeout=60,
        )
        chunks, finals = [], []
        for msg in call:
            (chunks if msg.HasField("chunk") else finals).append(msg)
        trailers = dict(call.trailing_metadata())
    assert len(chunks) >= 2 and all(c.chunk.token_ids for c in chunks)
    assert len(finals) == 1 and finals[0] is not None
    final = finals[0].final
    assert final.usage.completion_tokens == 12 == sum(len(c.chunk.token_ids) for c in chunks)
    assert final.served_by == "interactive/0" and final.model == "tiny-llama-large"
    assert trailers["x-infermesh-served-by"] == "interactive/0"

    with grpc.insecure_channel(f"127.0.0.1:{pool.grpc_port}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(model="nope", text="x"), timeout=10))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_through_the_mesh_is_classified_and_routed_to_the_pools_grpc_front(local_mesh):
    """Envoy's listener speaks HTTP/2 without TLS too: the filter classifies Generate by its method
    (rule grpc-generate), the route sends it to the interactive pool's gRPC front, and a client's
    own routing metadata is stripped. gRPC health is Envoy's own check of the pools, not part of
    the API the edge serves (docs/security.md)."""
    with grpc.insecure_channel(f"127.0.0.1:{local_mesh.plan.listen_port}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="infermesh.v1.Inference"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        call = pb_grpc.InferenceStub(ch).Generate(
            pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hi")]), max_tokens=6, temperature=0),
            metadata=(("x-infermesh-pool", "batch"), ("x-infermesh-class", "batch")),
            timeout=60,
        )
        msgs = list(call)
        trailers = dict(call.trailing_metadata())
    final = msgs[-1].final
    assert final.served_by == "interactive/0" and final.model == "tiny-llama-large"
    assert final.usage.completion_tokens == 6
    assert trailers["x-infermesh-served-by"] == "interactive/0"
    stats = httpx.get(f"http://127.0.0.1:{local_mesh.plan.admin_port}/stats?filter=cluster.pool_interactive_grpc.upstream_rq_total", timeout=5).text
    assert int(stats.split(":")[-1]) >= 1, stats


def filter_count(mesh, namespace: str, rule: str, cls: str) -> int:
    """Envoy's count of requests the filter (in one runtime's stats namespace) gave `rule`."""
    name = f"{namespace}.infermesh.requests_total.class.{cls}.pool.{cls}.rule.{rule}"
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.plan.admin_port}/stats?filter=^{re.escape(name)}$", timeout=5) as r:
        return int(r.read().decode().partition(": ")[2] or 0)


def test_the_mesh_serves_the_same_with_the_native_filter_runtime(local_mesh, client, native_module):
    """`filter.runtime: native` edited into the running mesh's policy: Envoy (started by the
    launcher with the module's search path) takes the module in the Wasm filter's place and the
    OpenAI API is served as before, each request decided by the module; then back to Wasm."""
    path = local_mesh.plan.policy_path
    good = path.read_text()
    assert "\nfilter:" not in good
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def decided_by(runtime: str, above: float) -> bool:
        # The switch replaces only the filter's ECDS config, not the listener: no connection is
        # drained, so every chat sent while it happens (max_retries=0) must be answered.
        client.chat.completions.create(**chat)
        return filter_count(local_mesh, runtime, "chat", "interactive") > above

    try:
        path.write_text(good.replace("\npools:\n", "\nfilter:\n  runtime: native\npools:\n", 1))
        wait_until(lambda: decided_by("dynamicmodulescustom", 0), 20, every=0.2, what="the native module deciding chats")
        raw = client.chat.completions.with_raw_response.create(**chat, stream=True)
        assert raw.headers["x-infermesh-served-by"] == "interactive/0"
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        done = client.completions.with_raw_response.create(model="tiny-llama", prompt="Summarize:", max_tokens=4)
        assert done.headers["x-infermesh-served-by"] == "batch/0"
        # A body rule, read by the module from Envoy's buffer: the bulk chat goes to batch (whose
        # sidecar refuses the unknown model at once: the route is what is checked).
        bulk = filter_count(local_mesh, "dynamicmodulescustom", "chat-bulk", "batch")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(**(chat | {"model": "gpt-nope", "max_tokens": 2000, "stream": False}))
        assert filter_count(local_mesh, "dynamicmodulescustom", "chat-bulk", "batch") == bulk + 1
    finally:
        path.write_text(good)
        before = filter_count(local_mesh, "wasmcustom", "chat", "interactive")
        wait_until(lambda: decided_by("wasmcustom", before), 20, every=0.2, what="the Wasm filter deciding chats again")


def test_a_repeated_prompt_hits_vllms_prefix_cache(local_mesh, client):
    # Prefix caching is set explicitly per model (settings.ModelSettings.prefix_caching, on by
    # default); vLLM's own counters show it on the sidecar's /metrics (issue 30).
    system = "You are a careful assistant for the lighthouse keepers' guild. " * 30
    q_before = counter(local_mesh, "interactive", "vllm:prefix_cache_queries_total")
    h_before = counter(local_mesh, "interactive", "vllm:prefix_cache_hits_total")
    for question in ("What is a lens?", "What is a lamp?"):
        client.chat.completions.create(model="tiny-llama", max_tokens=2, temperature=0,
                                       messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    # vLLM publishes its scheduler stats a moment after each step: wait for the second request's.
    assert wait_until(lambda: counter(local_mesh, "interactive", "vllm:prefix_cache_hits_total") > h_before, 10,
                      what="prefix cache hits on the interactive sidecar")
    queries = counter(local_mesh, "interactive", "vllm:prefix_cache_queries_total") - q_before
    hits = counter(local_mesh, "interactive", "vllm:prefix_cache_hits_total") - h_before
    assert queries > 0 and hits >= 0.3 * queries, (hits, queries)


def test_vllms_ipc_sockets_are_in_the_meshs_own_directory(local_mesh):
    """vLLM never removes its ZeroMQ IPC sockets: the mesh gives them a directory of its own
    (removed at stop) instead of the system's temp dir."""
    sockets = [p for p in local_mesh.ipc_dir.iterdir() if p.is_socket()]
    assert len(sockets) >= len(local_mesh.plan.pools), sorted(p.name for p in local_mesh.ipc_dir.iterdir())
