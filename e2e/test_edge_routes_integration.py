"""Integration: only the serving API at the edge. The real Envoy with the compiled filter (the
Wasm build, and the native dynamic module: `filter.runtime: native`) and the routes and clusters
the control plane generates for the e2e policy, in front of two fake sidecars per pool: an HTTP
one (test_pool_state_integration.FakeSidecar: echoes each request, answers /health and
/infermesh/state, reports a level the test sets) and a gRPC one (`FakeGrpcFront`, below: the
infermesh.v1.Inference service and grpc.health.v1, which say which pool answered). Fakes, because
the test drives the pools' levels; the same mesh with real vLLM sidecars is the e2e suite's.

Shows: the operational endpoints (/metrics, /health, /infermesh/state, the admin API), gRPC
health, reflection and the Admin service, and unknown paths get Envoy's JSON 404 (gRPC:
UNIMPLEMENTED) and reach no sidecar, whatever routing headers a client sends; every inference
path (OpenAI HTTP, Anthropic messages, model list, tokenizer, gRPC Generate and ListModels)
still reaches its pool; the clusters' health checks and the filter's state probe still reach the
sidecars' operational endpoints, and a degraded pool still spills and sheds on the allowed paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from e2e.test_pool_state_integration import E2E_POLICY, FakeSidecar, all_hosts_healthy, chat, request, until

from infermesh import paths
from infermesh.launcher import free_ports
from infermesh.meshconfig.envoy_bootstrap import write_bootstrap
from infermesh.meshconfig.envoy_resources import EDGE_PATHS, native_module_env
from infermesh.meshconfig.local_mesh import LocalMeshPlan, PoolPorts
from infermesh.meshconfig.policy import load_policy
from infermesh.settings import LEVEL_DOWN
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

INFERENCE = "infermesh.v1.Inference"


class FakeGrpcFront:
    """A fake of one pool's gRPC front: infermesh.v1.Inference answering with the pool's name as
    the model id (ListModels) or request id (Generate), the routing metadata it received in its
    trailing metadata, and grpc.health.v1 SERVING for the services Envoy's checks ask for."""

    def __init__(self, pool: str, port: int):
        self.pool = pool
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        fake = self

        class Inference(pb_grpc.InferenceServicer):
            def ListModels(self, req, ctx):
                fake.trail(ctx)
                return pb.ListModelsResponse(models=[pb.ModelInfo(id=fake.pool)])

            def Generate(self, req, ctx):
                fake.trail(ctx)
                yield pb.GenerateResponse(request_id=fake.pool)

        pb_grpc.add_InferenceServicer_to_server(Inference(), self.server)
        checks = health.HealthServicer()
        for name in ("", INFERENCE, *(f"infermesh.pool.below_level.{n}" for n in range(1, LEVEL_DOWN + 1))):
            checks.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checks, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def trail(self, ctx) -> None:
        got = dict(ctx.invocation_metadata())
        ctx.set_trailing_metadata([("x-served-pool", self.pool)] + [(k, v) for k, v in got.items() if k.startswith("x-infermesh-")])

    def stop(self) -> None:
        self.server.stop(0)


def envoy_stats(admin_url: str) -> dict[str, int]:
    text = urllib.request.urlopen(admin_url + "/stats?format=json", timeout=5).read().decode()
    return {s["name"]: s.get("value", 0) for s in json.loads(text)["stats"] if "name" in s}


def sidecar_requests(admin_url: str) -> int:
    """Requests Envoy sent to the pools' serving clusters (health checks and the filter's probe
    cluster `pool_NAME_state` not counted)."""
    return sum(v for k, v in envoy_stats(admin_url).items()
               if k.startswith("cluster.pool_") and k.endswith(".upstream_rq_total") and "_state." not in k)


@pytest.fixture(scope="module", params=["wasm", "native"])
def edge(request, tmp_path_factory):
    """Envoy with the e2e policy's routes over the fake fronts; yields (base URL, admin URL, HTTP
    sidecars, gRPC address)."""
    work = tmp_path_factory.mktemp(f"edge-{request.param}")
    policy = load_policy(E2E_POLICY)
    module = None
    if request.param == "native":
        module = request.getfixturevalue("native_module")
        policy = policy.model_copy(update={"filter": policy.filter.model_copy(update={"runtime": "native"})})
    listen, admin, h_int, h_batch, g_int, g_batch = free_ports(6)
    sidecars = {"interactive": FakeSidecar("interactive", h_int), "batch": FakeSidecar("batch", h_batch)}
    fronts = [FakeGrpcFront("interactive", g_int), FakeGrpcFront("batch", g_batch)]
    plan = LocalMeshPlan(policy_path=E2E_POLICY, policy=policy, listen_port=listen, admin_port=admin,
                         pools=[PoolPorts("interactive", h_int, g_int), PoolPorts("batch", h_batch, g_batch)])
    boot = write_bootstrap(plan.listener(paths.filter_wasm()), work / "envoy.json")
    log = work / "envoy.log"
    proc = subprocess.Popen([str(paths.envoy_binary()), "-c", str(boot), "--use-dynamic-base-id", "--concurrency", "2",
                             "--log-level", "info"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=os.environ | native_module_env(module) if module else None)
    base, admin_url = f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}"
    try:
        until("Envoy serving", lambda: proc.poll() is None and _serving(admin_url, base), 60, every=0.1)
        # The first health checks can time out while Envoy compiles the Wasm module; start from
        # every host in rotation (HTTP and gRPC clusters alike).
        until("every pool host healthy", lambda: all_hosts_healthy(admin_url), 30, every=0.1)
        yield base, admin_url, sidecars, f"127.0.0.1:{listen}"
    except BaseException:
        print(log.read_text()[-3000:])
        raise
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for s in sidecars.values():
            s.shutdown()
        for f in fronts:
            f.stop()


def _serving(admin_url: str, base: str) -> bool:
    try:
        return urllib.request.urlopen(admin_url + "/ready", timeout=1).status == 200 and request(base, "GET", "/v1/models")[0] == 200
    except OSError:
        return False


def raw(base: str, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    """(status, headers, body bytes): for paths the client library would refuse or reshape."""
    req = urllib.request.Request(base + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


NOT_SERVED = [
    ("GET", "/metrics"), ("GET", "/metrics?name[]=vllm:num_requests_running"), ("GET", "/health"), ("GET", "/infermesh/state"),
    ("GET", "/infermesh/state?healthy_below=%C2%B2"), ("GET", "/infermesh/state?healthy_below=1"), ("GET", "/admin/state"),
    ("GET", "/admin/events"), ("PUT", "/admin/faults/stall"), ("DELETE", "/admin/faults"), ("GET", "/unknown"), ("POST", "/v1/embeddings"),
    ("GET", "/"), ("POST", "/v1/chat/completions/"), ("POST", "/v1/chat/completions/../../metrics"), ("POST", "/V1/chat/completions"),
    ("POST", "/v1//chat/completions"), ("POST", "/metrics"),
]
SPOOFS = [{}, {"x-infermesh-pool": "interactive"}, {"x-infermesh-pool": "batch", "x-infermesh-class": "interactive"},
          {"content-type": "application/grpc"}]


def test_operational_admin_and_unknown_paths_get_the_edge_404_and_reach_no_sidecar(edge):
    base, admin_url, _, _ = edge
    before = sidecar_requests(admin_url)
    for method, path in NOT_SERVED:
        for spoof in SPOOFS:
            body = b"{}" if method in ("POST", "PUT") else None
            status, headers, got = raw(base, method, path, {"content-type": "application/json"} | spoof, body)
            if spoof.get("content-type", "").startswith("application/grpc"):
                # A gRPC caller gets the 404 as gRPC: UNIMPLEMENTED (12) in a trailers-only reply.
                assert status == 200 and headers.get("grpc-status") == "12", (method, path, spoof, status, headers)
                continue
            assert status == 404, (method, path, spoof, status, got[:200])
            assert headers["content-type"] == "application/json", (path, headers)
            error = json.loads(got)["error"]
            assert error["code"] == "not_found" and error["type"] == "invalid_request_error", (path, error)
            assert "vllm:" not in got.decode() and "level" not in error["message"]
    assert sidecar_requests(admin_url) == before, "a request the edge refuses reached a sidecar"


def test_grpc_services_other_than_inference_are_unimplemented_at_the_edge(edge):
    _, admin_url, _, target = edge
    before = sidecar_requests(admin_url)
    with grpc.insecure_channel(target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=INFERENCE), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, e.value
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.AdminStub(ch).GetState(pb.GetStateRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, e.value
    assert sidecar_requests(admin_url) == before


def test_the_inference_paths_still_reach_their_pools(edge):
    base, admin_url, _, target = edge
    # HTTP: each serving path (a query string too), to the pool the policy names.
    want = {"/v1/chat/completions": "interactive", "/v1/completions": "batch", "/v1/responses": "batch", "/v1/messages": "batch",
            "/tokenize": "batch", "/detokenize": "batch"}
    assert set(want) | {"/v1/models"} == {p for p in EDGE_PATHS if not p.startswith(f"/{INFERENCE}/")}
    for path, pool in want.items():
        for query in ("", "?api-version=2"):
            status, _, got = request(base, "POST", path + query, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "x"})
            assert status == 200 and got["upstream"] == pool and got["path"] == path + query, (path, got)
            assert got["headers"]["x-infermesh-pool"] == pool
    status, _, got = request(base, "GET", "/v1/models")
    assert status == 200 and got["upstream"] == "batch"
    # gRPC: Generate (the grpc-generate rule: interactive) and ListModels (the default class: batch).
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        call = stub.Generate(pb.GenerateRequest(text="hi"), timeout=5)
        assert [r.request_id for r in call] == ["interactive"]
        trail = dict(call.trailing_metadata())
        assert trail["x-served-pool"] == "interactive" and trail["x-infermesh-class"] == "interactive"
        models, call = stub.ListModels.with_call(pb.ListModelsRequest(), timeout=5)
        assert [m.id for m in models.models] == ["batch"] and dict(call.trailing_metadata())["x-served-pool"] == "batch"


def test_health_checks_and_the_probe_still_reach_the_sidecars(edge):
    """What the edge refuses, the clusters still call: /health, /infermesh/state?healthy_below
    and grpc.health of every pool pass, and the filter's probe reads /infermesh/state."""
    base, admin_url, sidecars, _ = edge
    probes = sidecars["interactive"].probes
    first = envoy_stats(admin_url)
    time.sleep(1.5)  # the spill pool is checked every 0.25 s, the others every 2 s; the probe every 0.5 s
    after = envoy_stats(admin_url)
    for cluster in ("pool_interactive", "pool_interactive_grpc", "pool_batch", "pool_batch_grpc"):
        key = f"cluster.{cluster}.health_check.success"
        assert after[key] > 0 and after[f"cluster.{cluster}.health_check.failure"] == first[f"cluster.{cluster}.health_check.failure"], cluster
    assert after["cluster.pool_interactive.health_check.success"] > first["cluster.pool_interactive.health_check.success"]
    until("the filter probes interactive's state", lambda: sidecars["interactive"].probes > probes, 5)
    assert request(base, "GET", "/infermesh/state")[0] == 404, "… while a client still cannot"


def test_a_degraded_pool_still_spills_and_sheds_on_the_serving_paths(edge):
    """Spill (Envoy's failover after the state health check fails) and shed (the filter's 429 on
    its routes) work on the narrowed routes; the edge's 404 stays a 404, never a 429."""
    base, _, sidecars, _ = edge
    try:
        sidecars["interactive"].level = 3
        until("a chat spilled to batch", lambda: chat(base)[2]["upstream"] == "batch", 10)
        until("batch shed at the edge", lambda: request(base, "POST", "/v1/completions", {"model": "m", "prompt": "x"})[0] == 429, 5)
        status, headers, body = request(base, "POST", "/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 429 and headers["x-infermesh-shed-by"] == "mesh" and body["error"]["code"] == "mesh_shedding"
        for method, path in (("POST", "/metrics"), ("POST", "/v1/embeddings"), ("GET", "/health")):
            status, _, got = raw(base, method, path, {"content-type": "application/json"}, b"{}" if method == "POST" else None)
            assert status == 404 and json.loads(got)["error"]["code"] == "not_found", (path, status)
        assert request(base, "GET", "/v1/models")[0] == 200, "costs no generation: never shed"
    finally:
        for s in sidecars.values():
            s.level = 0
    until("chats back on interactive", lambda: chat(base)[2]["upstream"] == "interactive", 10, every=0.1)
