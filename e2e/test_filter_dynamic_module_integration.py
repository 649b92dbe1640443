"""Integration: the filter as a native Envoy dynamic module (feature dynamic-module,
docs/filter-native-module.md) in the real Envoy binary, against the compiled Wasm filter on the
same config: both Envoys get the same requests and must reach the same pool with the same
headers. The filter's contract tests (chunked bodies, counters, a trusted source, invalid
configs) run against both runtimes in e2e/test_filter_envoy_integration.py, degraded-mode routing
(the process-wide state table) in e2e/test_pool_state_integration.py.

The shared object is built by scripts/build-native-filter.sh (incremental: seconds when built).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from e2e.test_filter_envoy_integration import FILTER_CONFIG, EnvoyUnderTest, grpc_fronts, not_found  # noqa: F401 (a fixture)
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
