"""Shared fixtures for tests that run real processes.

`local_mesh` starts the real thing once per session: two sidecars running vLLM with the small
local models, Envoy with the compiled filter, all on free loopback ports.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.launcher import LocalMesh, free_ports, plan_on_free_ports


def echo_server(name: str, port: int) -> EchoServer:
    """An upstream that answers with its name, the path, the headers it got and the body's length;
    a request may ask for a status (`x-test-status`, default 200) and a delay before the answer
    (`x-test-delay-ms`). Every request's headers are kept in `seen`, in arrival order."""
    class Echo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self):
            headers = {k.lower(): v for k, v in self.headers.items()}
            self.server.seen.append(headers)
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                body = b""
                while True:
                    size = int(self.rfile.readline().strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    body += self.rfile.read(size)
                    self.rfile.readline()
            else:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
            time.sleep(int(headers.get("x-test-delay-ms", "0")) / 1000)
            out = json.dumps({"upstream": name, "path": self.path, "headers": headers, "body_len": len(body)}).encode()
            try:
                self.send_response(int(headers.get("x-test-status", "200")))
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
            except OSError:
                pass  # the request was cut while it waited (a vanished client)

        do_GET = do_POST = do_PUT = _reply

        def setup(self):
            super().setup()
            self.server.connections.add(self.connection)

        def log_message(self, *a):
            pass

    srv = EchoServer(("127.0.0.1", port), Echo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


class EchoServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *a, **kw):
        self.connections: set[socket.socket] = set()
        self.seen: list[dict[str, str]] = []
        super().__init__(*a, **kw)

    def kill(self) -> None:
        """Die like a killed process: stop listening and cut every open connection."""
        self.shutdown()
        self.server_close()
        for c in list(self.connections):
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.fixture(scope="session")
def upstreams():
    p_int, p_batch = free_ports(2)
    servers = [echo_server("interactive", p_int), echo_server("batch", p_batch)]
    yield {"interactive": p_int, "batch": p_batch}
    for s in servers:
        s.shutdown()


E2E_POLICY = Path(__file__).resolve().parent / "policy-e2e.yaml"


def running_mesh(source: Path, run_dir: Path):
    """A local mesh of `source`'s policy in `run_dir`, started (progress printed), then stopped:
    the body of a mesh fixture."""
    # A copy: the invalid-policy drill writes over the file the control plane watches.
    policy = run_dir / "policy.yaml"
    shutil.copyfile(source, policy)
    mesh = LocalMesh(plan_on_free_ports(policy), run_dir, paths.models_dir(), paths.filter_wasm())
    t0 = time.monotonic()
    mesh.start(timeout=420, progress=lambda m: print(f"[mesh] {m}", flush=True))
    print(f"[mesh] up in {time.monotonic() - t0:.1f}s: {mesh.ready_after}", flush=True)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="session")
def local_mesh(tmp_path_factory) -> LocalMesh:
    yield from running_mesh(E2E_POLICY, tmp_path_factory.mktemp("mesh"))


@pytest.fixture
def mesh_at_rest(local_mesh) -> LocalMesh:
    """The session mesh with every pool at level 0, for tests of routing at rest. Its breakers
    read this 2-core machine, which the suite's own work (a gateway's istiod, Helm and Envoy
    starting; grammar compiles of the tests before) saturates for seconds: the batch CPU breaker
    (6 s) and the interactive TTFT breaker then shed and degrade, as they should. A routing test
    waits for them to recover rather than test that (docs/breakers.md, CPU-only machines)."""
    local_mesh.wait_at_rest(120, why="before a test of routing at rest")
    return local_mesh


@pytest.fixture(scope="session")
def native_module() -> Path:
    """The filter as a dynamic module (`filter.runtime: native`), built if it is not (incremental)."""
    import subprocess

    subprocess.run(["bash", str(paths.REPO_ROOT / "scripts" / "build-native-filter.sh")], check=True, capture_output=True)
    assert paths.filter_native_module().exists()
    return paths.filter_native_module()
