"""Integration: the filter as a native Envoy dynamic module (feature dynamic-module,
docs/filter-native-module.md) in the real Envoy binary, against the compiled Wasm filter on the
same config: both Envoys get the same requests and must reach the same pool with the same
headers. Then degraded-mode routing through the native module, with the fake sidecars of
e2e/test_pool_state_integration.py (level header, state endpoint and its faults chosen by the
test). The filter's contract tests (chunked bodies, counters, a trusted source, invalid
configs) run against both runtimes in e2e/test_filter_envoy_integration.py.

The shared object is built by scripts/build-native-filter.sh (incremental: seconds when built).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from e2e.test_filter_envoy_integration import FILTER_CONFIG, EnvoyUnderTest, filter_stats, grpc_fronts, not_found  # noqa: F401 (a fixture)
from e2e.test_pool_state_integration import (
    LEVEL, STATE_FAULTS, back_to_normal, batch, chat, get, pool_state_mesh, request, unreadable_state_leaves_routing_normal, until)
from infermesh import paths
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

sys.path.insert(0, str(paths.REPO_ROOT / "filter" / "bench"))
from native_module import NATIVE_SO  # noqa: E402

@pytest.fixture(scope="module")
def native_so(native_module) -> Path:
    assert native_module == NATIVE_SO, "the benchmark and the mesh load the same build"
    return native_module


def NativeEnvoy(workdir: Path, filter_config: dict | str, pools: dict[str, int], module: Path, native_rules: bool = True,
                grpc_pools: dict[str, int] | None = None) -> EnvoyUnderTest:
    """EnvoyUnderTest's Envoy with the filter as the native module (MeshListener's filter_runtime native)."""
    return EnvoyUnderTest(workdir, filter_config, pools, native_rules, native_module=module, grpc_pools=grpc_pools)


def envoy_stat(admin: str, name: str) -> int:
    text = urllib.request.urlopen(admin + "/stats?filter=^" + name.replace(".", r"\.") + "$", timeout=5).read().decode()
    return int(text.partition(": ")[2] or 0)


def stats(admin: str) -> dict[str, int]:
    """The native module's counters (Envoy's dynamic-modules namespace, the Wasm filter's names)."""
    return filter_stats(admin, "native")


@pytest.fixture(scope="module")
def pair(upstreams, grpc_fronts, native_so, tmp_path_factory):
    """The Wasm filter and the native module, each deciding every request (native rules off)."""
    envoys = {"wasm": EnvoyUnderTest(tmp_path_factory.mktemp("wasm"), FILTER_CONFIG, upstreams, native_rules=False, grpc_pools=grpc_fronts),
              "native": NativeEnvoy(tmp_path_factory.mktemp("native"), FILTER_CONFIG, upstreams, native_so, native_rules=False,
                                    grpc_pools=grpc_fronts)}
    for name, e in envoys.items():
        assert e.wait_ready(), f"{name} envoy did not start:\n" + e.log()[-3000:]
    yield envoys
    for e in envoys.values():
        e.stop()


def test_envoy_loads_the_module_with_a_matching_abi(pair):
    log = pair["native"].log()
    assert "Dynamic module ABI version v0.2.0 matched" in log, log[-2000:]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
REQUESTS = [
    ("POST", "/v1/chat/completions", {}, CHAT | {"stream": True}),
    ("POST", "/v1/completions", {}, {}),
    ("GET", "/v1/chat/completions", {}, None),
    ("GET", "/v1/models?x=1", {}, None),
    ("POST", "/v1/completions", {"x-priority": "high"}, {"max_tokens": 5000, "model": "eval-x"}),
    ("POST", "/v1/chat/completions", {}, {"messages": [], "max_tokens": 4096}),
    ("POST", "/v1/chat/completions", {}, {"messages": [], "max_completion_tokens": 4096, "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {}, {"messages": [], "max_tokens": 4096, "stream": True}),
    ("POST", "/v1/chat/completions", {}, {"messages": [], "n": 8}),
    ("POST", "/v1/completions", {}, {"prompt": "x", "service_tier": "priority"}),
    ("POST", "/v1/completions", {}, {"prompt": "x", "model": "eval-llama"}),
    ("POST", "/v1/chat/completions", {}, {"model": "eval-llama", "stream": True}),
    ("POST", "/v1/chat/completions?api-version=2", {}, CHAT | {"stream": False, "max_tokens": 2000}),
    ("POST", "/v1/chat/completions", {"content-type": "text/plain"}, {"max_tokens": 5000}),
    ("POST", "/v1/chat/completions", {"content-type": "application/grpc"}, {"max_tokens": 5000}),
    ("POST", "/v1/chat/completions", {}, bytes(range(256)) * 64),
    ("POST", "/v1/chat/completions", {}, b""),
    ("POST", "/v1/chat/completions", {}, {"max_tokens": 5000, "messages": [{"role": "user", "content": "x" * (1536 * 1024)}]}),
    # Spoofed routing headers: replaced by the decision, every x-infermesh-* one stripped.
    ("POST", "/v1/completions", {"x-infermesh-pool": "interactive", "x-infermesh-class": "interactive", "x-infermesh-rule": "chat",
                                 "x-infermesh-debug": "1"}, {}),
    ("POST", "/v1/chat/completions", {"x-infermesh-pool": "batch"}, CHAT | {"stream": True}),
]


def send(base: str, method: str, path: str, headers: dict, body) -> tuple:
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers={"content-type": "application/json"} | headers)
    with urllib.request.urlopen(req, timeout=20) as r:
        assert r.status == 200
        got = json.loads(r.read())
    h = got["headers"]
    internal = sorted(k for k in h if k.startswith("x-infermesh-") and k not in ("x-infermesh-class", "x-infermesh-pool", "x-infermesh-rule"))
    return (got["upstream"], h.get("x-infermesh-pool"), h.get("x-infermesh-class"), h.get("x-infermesh-rule"),
            h.get("x-gateway-inference-objective"), got["body_len"], internal)


@pytest.mark.parametrize("method, path, headers, body", REQUESTS, ids=[f"{m} {p} {sorted(h)}" for m, p, h, _ in REQUESTS])
def test_same_verdict_as_the_wasm_filter(pair, method, path, headers, body):
    wasm = send(pair["wasm"].base, method, path, headers, body)
    native = send(pair["native"].base, method, path, headers, body)
    assert native == wasm
    assert native[0] == native[1], "the route follows the pool header"


def test_same_grpc_verdict_as_the_wasm_filter(pair):
    """A gRPC call is decided by its method alone, the same in both runtimes (the pools' fake gRPC
    fronts return the routing metadata they got as trailing metadata)."""
    verdicts = {}
    for name, e in pair.items():
        with grpc.insecure_channel(f"127.0.0.1:{e.listen}") as ch:
            call_ = pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=10)
            assert [r.request_id for r in call_] == ["interactive"], name
            trail = dict(call_.trailing_metadata())
            verdicts[name] = tuple(trail.get(k) for k in ("x-served-pool", "x-infermesh-pool", "x-infermesh-class", "x-infermesh-rule"))
    assert verdicts["native"] == verdicts["wasm"] == ("interactive", "interactive", "interactive", "grpc-generate")


def test_paths_the_edge_does_not_serve_get_the_same_404_from_both(pair):
    for path in ("/anything?x=1", "/v1/embeddings", "/metrics", "/infermesh/state"):
        assert not_found(pair["wasm"].base, path, "GET") == not_found(pair["native"].base, path, "GET"), path


# ---- degraded-mode routing: the process-wide state table ----------------------------------------

@pytest.fixture(scope="module")
def mesh(native_so, tmp_path_factory):
    """test_pool_state_integration's mesh (the e2e policy: interactive spills to batch and batch
    is shed at level 3; two workers, two fake sidecars) with the native module in place of the Wasm filter."""
    yield from pool_state_mesh(tmp_path_factory.mktemp("native-pool-state"), native_module=native_so)


def test_the_level_header_never_reaches_the_client_and_cannot_be_faked(mesh):
    base, _, sidecars = mesh
    back_to_normal(base, sidecars)
    status, headers, got = chat(base)
    assert status == 200 and got["upstream"] == "interactive"
    assert LEVEL not in {k.lower() for k in headers}
    for _ in range(20):
        status, headers, got = chat(base, {LEVEL: "interactive;3;0"})
        assert got["upstream"] == "interactive" and LEVEL not in got["headers"]
    assert batch(base)[0] == 200


def test_a_degraded_pool_spills_within_a_second_sheds_batch_and_recovers(mesh):
    base, admin_url, sidecars = mesh
    back_to_normal(base, sidecars)
    before = stats(admin_url)
    failed_checks = envoy_stat(admin_url, "cluster.pool_interactive.health_check.failure")
    sidecars["interactive"].level = 3
    spill_s, (_, _, got) = until("a chat spilled to batch", lambda: (r := chat(base))[2]["upstream"] == "batch" and r, 5)
    print(f"[native pool-state] under traffic: first spilled chat {spill_s * 1000:.0f} ms after the sidecar reported level 3")
    assert spill_s < 1.0
    # Bound for interactive, served by batch: Envoy's failover after the state health check failed.
    assert got["headers"]["x-infermesh-class"] == "interactive" and got["headers"]["x-infermesh-pool"] == "interactive"
    assert envoy_stat(admin_url, "cluster.pool_interactive.health_check.failure") > failed_checks
    # The chats' routes are native (interactive only spills): the filter learns the level from its
    # probe (every 500 ms); one process-wide table, so every worker sheds from that reading on.
    until("batch shed at the edge", lambda: batch(base)[0] == 429, 1.0)
    status, headers, body = batch(base)
    assert status == 429 and headers["retry-after"] == "5" and headers["x-infermesh-shed-by"] == "mesh"
    assert body["error"]["code"] == "mesh_shedding" and body["error"]["type"] == "rate_limit_error"
    assert get(base, "/v1/models")[0] == 200, "costs no generation: never shed"
    assert request(base, "POST", "/tokenize", {"prompt": "x"})[0] == 200
    for _ in range(20):
        assert chat(base)[2]["upstream"] == "batch" and batch(base)[0] == 429
    after = stats(admin_url)
    assert after["infermesh.shed_requests_total.class.batch"] > before.get("infermesh.shed_requests_total.class.batch", 0)
    sidecars["interactive"].level = 0
    recover_s, _ = until("chats back on interactive", lambda: chat(base)[2]["upstream"] == "interactive", 10)
    print(f"[native pool-state] back to normal {recover_s * 1000:.0f} ms after level 0 (4 checks of 0.25 s)")
    assert batch(base)[0] == 200


def test_an_idle_pool_is_learned_by_the_probe_within_two_seconds(mesh):
    base, _, sidecars = mesh
    back_to_normal(base, sidecars)
    time.sleep(1.0)  # no chat since: only the probe reads the interactive pool
    probes = sidecars["interactive"].probes
    sidecars["interactive"].level = 3
    shed_s, _ = until("batch shed for an idle degraded pool", lambda: batch(base)[0] == 429, 5)
    print(f"[native pool-state] idle pool: first shed request {shed_s * 1000:.0f} ms after level 3 (probe)")
    assert shed_s < 2.0 and sidecars["interactive"].probes > probes
    # One probe per interval (500 ms) for the whole process, whatever the number of workers.
    n0, t0 = sidecars["interactive"].probes, time.monotonic()
    time.sleep(3)
    rate = (sidecars["interactive"].probes - n0) / (time.monotonic() - t0)
    assert rate <= 2.6, f"{rate:.1f} probes/s"
    assert batch(base)[0] == 429
    back_to_normal(base, sidecars)


@pytest.mark.parametrize("fault, reason", STATE_FAULTS)
def test_garbage_levels_and_failing_probes_leave_routing_normal(mesh, fault, reason):
    base, admin_url, sidecars = mesh
    unreadable_state_leaves_routing_normal(
        base, sidecars, fault, reason, lambda r: stats(admin_url).get(f"infermesh.pool_state_errors_total.reason.{r}", 0))
