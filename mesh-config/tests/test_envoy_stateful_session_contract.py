"""Contract: what the pinned Envoy's stateful session filter (header-based session state) does,
the behaviour prefix-aware picking (issue 30, docs/prefix-routing.md) rests on.

The real Envoy binary with three fake upstreams (plain Python HTTP servers, named as fakes): a
request naming a replica in the header goes to it; the response names the replica only when
another served; a retry (how a TTFT hedge reaches a second replica) does not reuse the named
host; a named host that is unhealthy or unknown is passed over for the cluster's own pick.
"""

from __future__ import annotations

import base64
import http.server
import json
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.launcher import free_ports, wait_until

HEADER = "x-infermesh-prefix-host"


class FakeReplica(http.server.BaseHTTPRequestHandler):
    """Answers its own port; 503 on /fail; /health follows the server's `sick` flag."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        port = self.server.server_address[1]
        code = 503 if self.path == "/fail" or (self.path == "/health" and self.server.sick) else 200
        body = str(port).encode()
        self.send_response(code)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def envoy_config(listen: int, admin: int, replicas: list[int]) -> dict:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "t",
        "route_config": {"virtual_hosts": [{"name": "a", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": {
            "cluster": "pool",
            "retry_policy": {"retry_on": "5xx", "num_retries": 1, "host_selection_retry_max_attempts": 3, "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}]},
        }}]}]},
        "http_filters": [
            {"name": "envoy.filters.http.stateful_session", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.stateful_session.v3.StatefulSession",
                "strict": False,
                "session_state": {"name": "envoy.http.stateful_session.header", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.http.stateful_session.header.v3.HeaderBasedSessionState",
                    "name": HEADER}}}},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{"address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                           "filter_chains": [{"filters": [{"name": "hcm", "typed_config": hcm}]}]}],
            "clusters": [{
                "name": "pool", "type": "STATIC", "connect_timeout": "1s",
                "health_checks": [{"timeout": "1s", "interval": "0.2s", "no_traffic_interval": "0.2s",
                                   "unhealthy_threshold": 1, "healthy_threshold": 1, "http_health_check": {"path": "/health"}}],
                "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in replicas]}]},
            }],
        },
    }


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("stateful-session")
    listen, admin, *ports = free_ports(5)
    servers = []
    for p in ports:
        s = http.server.ThreadingHTTPServer(("127.0.0.1", p), FakeReplica)
        s.sick = False
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    cfg = tmp / "envoy.json"
    cfg.write_text(json.dumps(envoy_config(listen, admin, ports)))
    envoy = subprocess.Popen([str(paths.envoy_binary()), "-c", str(cfg), "--concurrency", "1", "--use-dynamic-base-id",
                              "-l", "warning"], stdout=subprocess.DEVNULL, stderr=(tmp / "envoy.log").open("w"))
    try:
        wait_until(lambda: healthy(admin) == set(ports), 20, what="every fake replica healthy in Envoy")
        yield {"url": f"http://127.0.0.1:{listen}", "admin": admin, "ports": ports, "servers": servers}
    finally:
        envoy.terminate()
        envoy.wait(10)
        for s in servers:
            s.shutdown()


def healthy(admin: int) -> set[int]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters", timeout=2) as r:
            lines = r.read().decode().splitlines()
    except OSError:
        return set()
    return {int(line.split("::")[1].rsplit(":", 1)[1]) for line in lines
            if line.startswith("pool::127.0.0.1:") and line.endswith("::health_flags::healthy")}


def named(port: int) -> str:
    return base64.b64encode(f"127.0.0.1:{port}".encode()).decode()


def get(mesh, path: str = "/x", host: str | None = None) -> tuple[int, str | None]:
    """(port that served, the session header of the response)."""
    req = urllib.request.Request(mesh["url"] + path, headers={HEADER: host} if host else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return int(r.read()), r.headers.get(HEADER)


def test_without_the_header_the_response_names_the_replica_the_cluster_picked(mesh):
    for _ in range(6):
        port, said = get(mesh)
        assert said == named(port)


def test_a_named_replica_serves_and_the_response_says_nothing(mesh):
    for p in mesh["ports"]:
        for _ in range(3):
            assert get(mesh, host=named(p)) == (p, None)


def test_a_retry_does_not_reuse_the_named_replica_and_the_response_names_the_new_one(mesh):
    # Every replica answers 503 on /fail: the one retry goes elsewhere (previous_hosts), and the
    # client still gets the 503 of the second attempt, from another port than the named one.
    first = mesh["ports"][0]
    req = urllib.request.Request(mesh["url"] + "/fail", headers={HEADER: named(first)})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    served = int(e.value.read())
    assert served != first and e.value.headers.get(HEADER) == named(served)


def test_an_unknown_or_unhealthy_named_replica_is_passed_over(mesh):
    port, said = get(mesh, host=named(9))
    assert port in mesh["ports"] and said == named(port)
    sick_port, sick = mesh["ports"][1], mesh["servers"][1]
    sick.sick = True
    try:
        wait_until(lambda: sick_port not in healthy(mesh["admin"]), 10, what="the sick replica failing its health check")
        for _ in range(4):
            port, said = get(mesh, host=named(sick_port))
            assert port != sick_port and said == named(port)
    finally:
        sick.sick = False
    wait_until(lambda: sick_port in healthy(mesh["admin"]), 10, what="the replica healthy again")
    assert get(mesh, host=named(sick_port)) == (sick_port, None)
