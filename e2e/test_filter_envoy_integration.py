"""Integration: the real Envoy binary with the compiled Wasm filter, in front of two small echo
upstreams (one per pool) that report which of them got the request and with which headers.

No vLLM here: these tests pin the filter's routing contract fast, the e2e tests then run the
same path with real sidecars.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infermesh import paths
from infermesh.launcher import free_ports
from infermesh.meshconfig.envoy_bootstrap import MeshListener, PoolEndpoint, write_bootstrap
from infermesh.meshconfig.local_mesh import LocalMeshPlan


def echo_server(name: str, port: int) -> ThreadingHTTPServer:
    class Echo(BaseHTTPRequestHandler):
        def _reply(self):
            n = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(n) if n else b""
            out = json.dumps(
                {"upstream": name, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body_len": len(body)}
            ).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = _reply

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", port), Echo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def envoy_with_filter(tmp_path_factory):
    listen, admin, p_int, p_batch = free_ports(4)
    servers = [echo_server("interactive", p_int), echo_server("batch", p_batch)]
    plan = LocalMeshPlan()
    cfg = plan.filter_config()
    listener = MeshListener(
        listen_host="127.0.0.1",
        listen_port=listen,
        admin_port=admin,
        wasm_path=paths.filter_wasm(),
        filter_config=cfg,
        pools=[PoolEndpoint("interactive", "127.0.0.1", p_int), PoolEndpoint("batch", "127.0.0.1", p_batch)],
        default_pool="batch",
    )
    d = tmp_path_factory.mktemp("envoy")
    boot = write_bootstrap(listener, d / "envoy.json")
    log = open(d / "envoy.log", "wb")
    proc = subprocess.Popen(
        [str(paths.envoy_binary()), "-c", str(boot), "--use-dynamic-base-id", "--concurrency", "1", "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("envoy did not start:\n" + (d / "envoy.log").read_text()[-3000:])
        time.sleep(0.1)
    yield {"base": f"http://127.0.0.1:{listen}", "admin": f"http://127.0.0.1:{admin}", "log": d / "envoy.log"}
    proc.terminate()
    proc.wait(timeout=10)
    for s in servers:
        s.shutdown()


def call(base: str, path: str, method: str = "POST", headers: dict | None = None, body: bytes = b"{}") -> dict:
    req = urllib.request.Request(base + path, data=body if method == "POST" else None, method=method, headers=headers or {})
    req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_chat_goes_to_interactive_pool(envoy_with_filter):
    got = call(envoy_with_filter["base"], "/v1/chat/completions")
    assert got["upstream"] == "interactive"
    h = got["headers"]
    assert (h["x-infermesh-class"], h["x-infermesh-pool"], h["x-infermesh-rule"]) == ("interactive", "interactive", "chat")


def test_everything_else_goes_to_batch_by_default(envoy_with_filter):
    for path in ("/v1/completions", "/v1/embeddings", "/anything?x=1"):
        got = call(envoy_with_filter["base"], path)
        assert got["upstream"] == "batch", path
        assert got["headers"]["x-infermesh-rule"] == "default"


def test_get_on_chat_path_is_not_the_chat_rule(envoy_with_filter):
    got = call(envoy_with_filter["base"], "/v1/chat/completions", method="GET")
    assert got["upstream"] == "batch"


def test_spoofed_routing_headers_are_replaced(envoy_with_filter):
    spoof = {"x-infermesh-pool": "interactive", "x-infermesh-class": "interactive", "x-infermesh-rule": "chat", "x-infermesh-debug": "1"}
    got = call(envoy_with_filter["base"], "/v1/completions", headers=spoof)
    assert got["upstream"] == "batch"
    h = got["headers"]
    assert (h["x-infermesh-class"], h["x-infermesh-pool"], h["x-infermesh-rule"]) == ("batch", "batch", "default")
    assert "x-infermesh-debug" not in h, "every client-sent x-infermesh-* header is stripped"
    spoof["x-infermesh-pool"] = "batch"
    assert call(envoy_with_filter["base"], "/v1/chat/completions", headers=spoof)["upstream"] == "interactive"


def test_garbage_bodies_are_still_routed(envoy_with_filter):
    got = call(envoy_with_filter["base"], "/v1/chat/completions", body=bytes(range(256)) * 64)
    assert got["upstream"] == "interactive" and got["body_len"] == 256 * 64


def test_admin_is_not_reachable_through_the_listener(envoy_with_filter):
    # Admin paths on the mesh listener are just requests to a pool, never Envoy's admin.
    got = call(envoy_with_filter["base"], "/stats", method="GET")
    assert got["upstream"] == "batch"
    with urllib.request.urlopen(envoy_with_filter["admin"] + "/stats?filter=wasm", timeout=5) as r:
        assert r.status == 200
