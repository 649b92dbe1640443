"""Integration: the real Envoy binary with the compiled filter, in front of two small echo
upstreams (one per pool) that report which of them got the request and with which headers.
The filter's contract is one for both runtimes: a test of it runs against the Wasm module and
the native dynamic module (`runtime`: RUNTIMES), which run the same request flow
(filter/src/request_flow.rs).

No vLLM here: these tests pin the filter's routing contract fast; the e2e tests then run the
same path with real sidecars.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import grpc
import pytest
from e2e.test_edge_routes_integration import FakeGrpcFront

from infermesh import paths
from infermesh.launcher import free_ports
from infermesh.meshconfig.envoy_bootstrap import MeshListener, PoolEndpoint, write_bootstrap
from infermesh.meshconfig.envoy_resources import NOT_FOUND_BODY, native_module_env
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import load_policy
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

FILTER_CONFIG = {
    "version": 1,
    "default_class": "batch",
    "classes": {
        "interactive": {"pool": "interactive", "objective": "chat-latency"},
        "batch": {"pool": "batch"},
    },
    "rules": [
        {"name": "hdr-priority", "class": "interactive", "match": {"headers": [{"name": "x-priority", "exact": "high"}]}},
        {"name": "chat-bulk", "class": "batch",
         "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}, "body": {"stream": False, "max_tokens": {"min": 1024}}}},
        {"name": "chat-many", "class": "batch", "match": {"path": {"prefix": "/v1/chat/completions"}, "body": {"n": {"min": 4}}}},
        {"name": "premium", "class": "interactive", "match": {"path": {"prefix": "/v1/"}, "body": {"service_tier": {"exact": "priority"}}}},
        {"name": "eval-models", "class": "batch", "match": {"path": {"prefix": "/v1/"}, "body": {"model": {"regex": "^eval-"}}}},
        {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
        {"name": "grpc-generate", "class": "interactive", "match": {"path": {"exact": "/infermesh.v1.Inference/Generate"}}},
    ],
    "trusted_sources": {"cidrs": ["10.99.0.0/16"]},
    "emit_objective_header": True,
}


class EnvoyUnderTest:
    def __init__(self, workdir: Path, filter_config: dict | str, pools: dict[str, int], native_rules: bool = True,
                 edit: Callable[[dict], None] | None = None, native_module: Path | None = None,
                 grpc_pools: dict[str, int] | None = None, edge_paths: tuple[str, ...] = (), concurrency: int = 1):
        """`edit` changes the generated bootstrap before Envoy reads it; `native_module`: the filter
        as that dynamic module (filter.runtime: native) instead of the Wasm build; `grpc_pools`:
        the pools' gRPC fronts (pool -> port; none: no gRPC routes); `edge_paths`: the paths the
        listener serves (default EDGE_PATHS; every other path gets the edge's 404)."""
        self.listen, self.admin_port = free_ports(2)
        listener = MeshListener(
            listen_host="127.0.0.1",
            listen_port=self.listen,
            admin_port=self.admin_port,
            wasm_path=paths.filter_wasm(),
            filter_config=filter_config if isinstance(filter_config, dict) else {},
            pools=[PoolEndpoint(n, "127.0.0.1", p, (grpc_pools or {}).get(n, 0)) for n, p in pools.items()],
            default_pool="batch",
            native_rules=native_rules,
            filter_runtime="native" if native_module else "wasm",
            edge_paths=edge_paths,
        )
        boot = write_bootstrap(listener, workdir / "envoy.json")
        if not isinstance(filter_config, dict) or edit is not None:
            doc = json.loads(boot.read_text())
            if not isinstance(filter_config, dict):  # a raw (possibly invalid) config string
                hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
                typed = hcm["http_filters"][0]["typed_config"]
                (typed["filter_config"] if native_module else typed["config"]["configuration"])["value"] = filter_config
            if edit is not None:
                edit(doc)
            boot.write_text(json.dumps(doc))
        self.log_path = workdir / "envoy.log"
        self.proc = subprocess.Popen(
            [str(paths.envoy_binary()), "-c", str(boot), "--use-dynamic-base-id", "--concurrency", str(concurrency), "--log-level", "info"],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
            env=os.environ | native_module_env(native_module) if native_module else None,
        )
        self.base = f"http://127.0.0.1:{self.listen}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"

    def wait_ready(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.admin + "/ready", timeout=1) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def grpc_fronts():
    """Fake gRPC fronts for the echo pools (pool -> port): each answers with its pool's name and
    returns the routing metadata it got as trailing metadata."""
    ports = dict(zip(("interactive", "batch"), free_ports(2)))
    fronts = [FakeGrpcFront(pool, port) for pool, port in ports.items()]
    yield ports
    for f in fronts:
        f.stop()


# The filter's two runtimes, and where Envoy keeps each one's counters.
RUNTIMES = ("wasm", "native")
STATS_PREFIX = {"wasm": "wasmcustom.", "native": "dynamicmodulescustom."}


def filter_envoy(request, workdir: Path, filter_config: dict | str, pools: dict[str, int], runtime: str, **kw) -> EnvoyUnderTest:
    """EnvoyUnderTest with the filter in `runtime`: the Wasm module or the native dynamic module
    (built by the session's `native_module` fixture)."""
    module = request.getfixturevalue("native_module") if runtime == "native" else None
    e = EnvoyUnderTest(workdir, filter_config, pools, native_module=module, **kw)
    e.runtime = runtime
    return e


def filter_stats(admin: str, runtime: str) -> dict[str, int]:
    """The filter's counters by name (after the runtime's prefix), from Envoy's /stats."""
    prefix = STATS_PREFIX[runtime]
    text = urllib.request.urlopen(admin + "/stats?filter=^" + prefix.replace(".", r"\.") + "infermesh", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name[len(prefix):]] = int(value)
    return out


@pytest.fixture(scope="module", params=RUNTIMES)
def envoy(request, upstreams, grpc_fronts, tmp_path_factory):
    e = filter_envoy(request, tmp_path_factory.mktemp(f"envoy-{request.param}"), FILTER_CONFIG, upstreams, request.param,
                     grpc_pools=grpc_fronts)
    assert e.wait_ready(), "envoy did not start:\n" + e.log()[-3000:]
    yield e
    e.stop()


def call(base: str, path: str, method: str = "POST", headers: dict | None = None, body: bytes | dict = b"{}") -> dict:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    h = {"content-type": "application/json"} | (headers or {})
    req = urllib.request.Request(base + path, data=body if method == "POST" else None, method=method, headers=h)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        return json.loads(r.read())


def not_found(base: str, path: str, method: str = "POST", headers: dict | None = None) -> dict:
    """The edge's JSON 404 for a path it does not serve (its error object)."""
    req = urllib.request.Request(base + path, data=b"{}" if method == "POST" else None, method=method,
                                 headers={"content-type": "application/json"} | (headers or {}))
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 404 and e.value.headers["content-type"] == "application/json", (path, e.value.code)
    body = e.value.read().decode()
    assert body == NOT_FOUND_BODY, (path, body)
    return json.loads(body)["error"]


def decided(got: dict) -> tuple[str, str, str, str]:
    h = got["headers"]
    assert got["upstream"] == h["x-infermesh-pool"], "the route follows the pool header"
    return got["upstream"], h["x-infermesh-class"], h["x-infermesh-rule"], h.get("x-gateway-inference-objective", "")


def prom(envoy: EnvoyUnderTest) -> str:
    with urllib.request.urlopen(envoy.admin + "/stats/prometheus", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- routing by path, method, headers --------------------------------------------------------

def test_chat_goes_to_interactive_pool(envoy):
    got = call(envoy.base, "/v1/chat/completions", body={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert decided(got) == ("interactive", "interactive", "chat", "chat-latency")


def test_everything_else_goes_to_batch_by_default(envoy):
    for path in ("/v1/completions", "/v1/responses", "/v1/messages?x=1", "/tokenize", "/detokenize"):
        assert decided(call(envoy.base, path)) == ("batch", "batch", "default", "batch"), path
    # Paths outside the serving API reach no pool at all: the edge's 404, not the default class.
    before = prom(envoy)
    for path in ("/v1/embeddings", "/anything?x=1"):
        assert not_found(envoy.base, path)["code"] == "not_found"
    after = prom(envoy)
    assert metric(after, "infermesh_requests_total", **{"class": "batch", "pool": "batch", "rule": "default"}) == \
        metric(before, "infermesh_requests_total", **{"class": "batch", "pool": "batch", "rule": "default"}), "the filter classified a 404"


def test_get_on_chat_path_is_not_the_chat_rule(envoy):
    assert decided(call(envoy.base, "/v1/chat/completions", method="GET"))[2] == "default"


def test_header_rule_decides_first(envoy):
    got = call(envoy.base, "/v1/completions", headers={"x-priority": "high"}, body={"max_tokens": 5000, "model": "eval-x"})
    assert decided(got)[:3] == ("interactive", "interactive", "hdr-priority")


# ---- routing by body fields ------------------------------------------------------------------

@pytest.mark.parametrize(
    "path, body, want",
    [
        ("/v1/chat/completions", {"messages": [], "max_tokens": 4096}, ("batch", "chat-bulk")),
        ("/v1/chat/completions", {"messages": [], "max_completion_tokens": 4096, "max_tokens": 1}, ("batch", "chat-bulk")),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 4096, "stream": True}, ("interactive", "chat")),
        ("/v1/chat/completions", {"messages": [], "n": 8}, ("batch", "chat-many")),
        ("/v1/completions", {"prompt": "x", "service_tier": "priority"}, ("interactive", "premium")),
        ("/v1/completions", {"prompt": "x", "model": "eval-llama"}, ("batch", "eval-models")),
        ("/v1/chat/completions", {"model": "eval-llama", "stream": True}, ("batch", "eval-models")),
    ],
)
def test_body_fields_decide(envoy, path, body, want):
    got = call(envoy.base, path, body=body)
    assert (got["upstream"], got["headers"]["x-infermesh-rule"]) == want
    assert got["body_len"] == len(json.dumps(body)), "the buffered body reaches the upstream whole"


# ---- fallbacks: every odd body still gets a header-only decision and a 200 --------------------

def test_garbage_body_falls_back_to_header_rules(envoy):
    before = metric(prom(envoy), "infermesh_body_fallbacks_total", reason="invalid_json")
    got = call(envoy.base, "/v1/chat/completions", body=bytes(range(256)) * 64)
    assert decided(got)[:3] == ("interactive", "interactive", "chat") and got["body_len"] == 256 * 64
    assert metric(prom(envoy), "infermesh_body_fallbacks_total", reason="invalid_json") == before + 1


def test_non_json_content_type_is_not_buffered(envoy):
    body = json.dumps({"max_tokens": 5000}).encode()
    got = call(envoy.base, "/v1/chat/completions", headers={"content-type": "text/plain"}, body=body)
    assert decided(got)[2] == "chat"
    assert metric(prom(envoy), "infermesh_body_fallbacks_total", reason="not_json") >= 1


def test_body_over_one_mib_with_content_length(envoy):
    big = json.dumps({"max_tokens": 5000, "messages": [{"role": "user", "content": "x" * (1536 * 1024)}]}).encode()
    got = call(envoy.base, "/v1/chat/completions", body=big)
    assert decided(got)[2] == "chat", "over the limit: body rules are skipped"
    assert got["body_len"] == len(big), "the whole body still reaches the pool (no 413)"
    assert metric(prom(envoy), "infermesh_body_fallbacks_total", reason="too_large") >= 1


def test_chunked_body_that_overflows_the_limit(envoy):
    conn = http.client.HTTPConnection("127.0.0.1", envoy.listen, timeout=20)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("content-type", "application/json")
    conn.putheader("transfer-encoding", "chunked")
    conn.endheaders()
    piece = b"x" * 65536
    head = b'{"max_tokens": 5000, "messages": [{"role":"user","content":"'
    conn.send(b"%x\r\n%s\r\n" % (len(head), head))
    for _ in range(20):  # 1.25 MiB in 64 KiB chunks
        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    tail = b'"}]}'
    conn.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
    r = conn.getresponse()
    assert r.status == 200
    got = json.loads(r.read())
    assert decided(got)[2] == "chat"
    assert got["body_len"] > 20 * 65536


def test_small_chunked_body_is_classified(envoy):
    conn = http.client.HTTPConnection("127.0.0.1", envoy.listen, timeout=20)
    body = json.dumps({"n": 5}).encode()
    conn.request("POST", "/v1/chat/completions", body=iter([body[:3], body[3:]]), headers={"content-type": "application/json"}, encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["headers"]["x-infermesh-rule"] == "chat-many"


def test_empty_body_and_bodyless_requests(envoy):
    assert decided(call(envoy.base, "/v1/chat/completions", body=b""))[2] == "chat"
    assert decided(call(envoy.base, "/v1/chat/completions", method="GET"))[2] == "default"


def test_grpc_is_classified_by_method_without_buffering(envoy):
    # The method path decides (the body is protobuf, not JSON: not parsed); the pools' fake gRPC
    # fronts return the routing metadata they got as trailing metadata.
    with grpc.insecure_channel(f"127.0.0.1:{envoy.listen}") as ch:
        stub = pb_grpc.InferenceStub(ch)
        call_ = stub.Generate(pb.GenerateRequest(text="hi"), timeout=10)
        assert [r.request_id for r in call_] == ["interactive"]
        trail = dict(call_.trailing_metadata())
        assert (trail["x-served-pool"], trail["x-infermesh-pool"], trail["x-infermesh-class"], trail["x-infermesh-rule"]) == \
            ("interactive", "interactive", "interactive", "grpc-generate")
        # ListModels matches no rule: the default class, on batch's gRPC front.
        models, call_ = stub.ListModels.with_call(pb.ListModelsRequest(), timeout=10)
        trail = dict(call_.trailing_metadata())
        assert [m.id for m in models.models] == ["batch"]
        assert (trail["x-served-pool"], trail["x-infermesh-class"], trail["x-infermesh-rule"]) == ("batch", "batch", "default")


# ---- headers from outside --------------------------------------------------------------------

def test_spoofed_routing_headers_are_replaced(envoy):
    spoof = {"x-infermesh-pool": "interactive", "x-infermesh-class": "interactive", "x-infermesh-rule": "chat", "x-infermesh-debug": "1"}
    got = call(envoy.base, "/v1/completions", headers=spoof)
    assert decided(got)[:3] == ("batch", "batch", "default")
    assert "x-infermesh-debug" not in got["headers"], "every client-sent x-infermesh-* header is stripped"
    spoof["x-infermesh-pool"] = "batch"
    assert call(envoy.base, "/v1/chat/completions", headers=spoof)["upstream"] == "interactive"
    assert metric(prom(envoy), "infermesh_stripped_requests_total") >= 2
    # Counted once per request, whatever it sent.
    before = filter_stats(envoy.admin, envoy.runtime).get("infermesh.stripped_requests_total", 0)
    call(envoy.base, "/v1/completions", headers={"x-infermesh-pool": "interactive"})
    assert filter_stats(envoy.admin, envoy.runtime).get("infermesh.stripped_requests_total", 0) == before + 1


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("native_rules", (True, False), ids=("native-rules", "filter-only"))
def test_trusted_source_keeps_an_upstream_decision(request, upstreams, tmp_path, runtime, native_rules):
    cfg = dict(FILTER_CONFIG, trusted_sources={"cidrs": ["127.0.0.0/8"]})
    e = filter_envoy(request, tmp_path, cfg, upstreams, runtime, native_rules=native_rules)
    try:
        assert e.wait_ready(), e.log()[-2000:]
        got = call(e.base, "/v1/completions", headers={"x-infermesh-pool": "interactive", "x-infermesh-class": "interactive"})
        h = got["headers"]
        assert got["upstream"] == "interactive" and got["headers"]["x-infermesh-class"] == "interactive"
        assert (got["upstream"], h.get("x-infermesh-pool"), h.get("x-infermesh-class"), h.get("x-infermesh-rule")) == \
            ("interactive", "interactive", "interactive", None), "kept as the trusted hop sent it"
        # Without a complete decision the trusted hop's partial headers do not skip classification.
        got = call(e.base, "/v1/chat/completions", headers={"x-infermesh-rule": "x"})
        assert decided(got)[2] == "chat"
        assert filter_stats(e.admin, e.runtime).get("infermesh.requests_total.class.interactive.pool.interactive.rule.trusted") == 1
    finally:
        e.stop()


def test_admin_is_not_reachable_through_the_listener(envoy):
    # Admin paths on the mesh listener are not the serving API: the edge's 404, from no pool.
    for path in ("/stats", "/ready", "/config_dump"):
        assert not_found(envoy.base, path, method="GET")["code"] == "not_found", path
    with urllib.request.urlopen(envoy.admin + "/ready", timeout=5) as r:
        assert r.status == 200


# ---- metrics and config ----------------------------------------------------------------------

def test_decisions_are_counted_by_class_pool_and_rule(envoy):
    before = metric(prom(envoy), "infermesh_requests_total", **{"class": "batch", "pool": "batch", "rule": "chat-many"})
    call(envoy.base, "/v1/chat/completions", body={"n": 9})
    assert metric(prom(envoy), "infermesh_requests_total", **{"class": "batch", "pool": "batch", "rule": "chat-many"}) == before + 1


@pytest.mark.parametrize(
    "bad, field",
    [
        ('{"version": 1, "default_class": "nope", "classes": {"batch": {"pool": "batch"}}}', "default_class"),
        ('{"version": 2, "default_class": "batch", "classes": {"batch": {"pool": "batch"}}}', "version"),
        ("not json at all", "$"),
    ],
)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_invalid_config_is_refused_with_the_field_named(request, upstreams, tmp_path, runtime, bad, field):
    e = filter_envoy(request, tmp_path, bad, upstreams, runtime)
    try:
        assert not e.wait_ready(timeout=15), "a static config the filter refuses: Envoy does not start"
        time.sleep(0.5)
        assert f"invalid infermesh filter config at `{field}`" in e.log()
    finally:
        e.stop()


def test_local_default_config_is_valid(upstreams, tmp_path):
    e = EnvoyUnderTest(tmp_path, LocalMeshPlan().filter_config(), upstreams)
    try:
        assert e.wait_ready(), e.log()[-2000:]
        assert "config accepted" in e.log()
        assert decided(call(e.base, "/v1/chat/completions", body={"max_tokens": 2000}))[2] == "chat-bulk"
    finally:
        e.stop()


def test_production_policy_filter_config_is_accepted_by_the_filter(upstreams, tmp_path):
    policy = load_policy(Path(__file__).resolve().parents[1] / "mesh-config" / "policies" / "production.yaml")
    cfg = policy.filter_config()
    # Point the production pools at the two echo upstreams of this test.
    cfg["classes"] = {c: dict(v, pool="interactive" if v["pool"] == "h100" else "batch") for c, v in cfg["classes"].items()}
    e = EnvoyUnderTest(tmp_path, cfg, upstreams)
    try:
        assert e.wait_ready(), e.log()[-2000:]
        assert "config accepted: 7 rules" in e.log()
        got = call(e.base, "/v1/completions", body={"model": "eval-llama", "prompt": "x"})
        assert (got["headers"]["x-infermesh-rule"], got["headers"]["x-gateway-inference-objective"]) == ("eval-models", "bulk")
    finally:
        e.stop()
