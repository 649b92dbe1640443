"""Integration: degraded-mode routing in the data plane, for both filter runtimes (the Wasm filter
with its shared-data table, the native dynamic module with its process-wide table: each test runs
against both). The real Envoy (two workers) with the
compiled filter and the routes and clusters the control plane generates for the e2e policy
(interactive spills to batch, by Envoy's health check of the state endpoint and priority
failover, and the filter sheds batch at the edge while interactive is at level 3), in front of two
fake sidecars (`FakeSidecar`, below: the level, the header and the state endpoint's behaviour
are the test's to choose, which no real sidecar can be made to do on demand, e.g. answer
garbage). The same behaviour on real sidecars with vLLM: e2e/test_breakers_e2e.py
(test_critical_interactive_pool_spills_to_batch_and_the_mesh_sheds_batch), and through istiod:
e2e/test_istiod_e2e.py.

What is measured is printed: the time from a sidecar reporting the level to the first spilled
request under traffic, and to the first shed request for an idle pool (learned by the probe).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest

from infermesh import paths
from infermesh.launcher import free_ports
from infermesh.meshconfig.envoy_bootstrap import write_bootstrap
from infermesh.meshconfig.envoy_resources import native_module_env
from infermesh.meshconfig.local_mesh import LocalMeshPlan, PoolPorts
from infermesh.meshconfig.policy import load_policy

E2E_POLICY = Path(__file__).resolve().parent / "policy-e2e.yaml"
LEVEL = "x-infermesh-pool-level"


class FakeSidecar(ThreadingHTTPServer):
    """A fake of one pool's sidecar: echoes each request (pool, path, headers) and reports
    `level` in x-infermesh-pool-level, as the real one does; `header` = "garbage" sends junk
    instead; `state` = "ok" | "500" | "hang" is how GET /infermesh/state answers, the filter's
    probe (counted in `probes`) and Envoy's health check `?healthy_below=N` alike (503 from
    level N up, as sidecar/state_api.py answers it)."""

    daemon_threads = True

    def __init__(self, pool: str, port: int):
        self.pool, self.level, self.header, self.state = pool, 0, "ok", "ok"
        self.probes = 0
        super().__init__(("127.0.0.1", port), _FakeHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def level_value(self) -> str:
        return f"{self.pool};{self.level};0" if self.header == "ok" else "level=3 pool=" + self.pool


class _FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _reply(self):
        srv: FakeSidecar = self.server  # type: ignore[assignment]
        self.rfile.read(int(self.headers.get("content-length") or 0))
        status = 200
        if self.path.startswith("/infermesh/state"):
            below = self.path.partition("?healthy_below=")[2]
            srv.probes += not below
            if srv.state == "hang":
                time.sleep(2)
            status = 500 if srv.state == "500" else 503 if below and srv.level >= int(below) else 200
        out = json.dumps({"upstream": srv.pool, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        if self.path != "/health":
            self.send_header(LEVEL, srv.level_value())
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _reply

    def log_message(self, *a):
        pass


ROUND_TRIP_S = 0.2
"""One request through Envoy and back on this 2-core machine, with margin: the time between two
of the test's polls, not a property of the filter."""


def filter_stats(admin: str, runtime: str) -> dict[str, int]:
    # Imported here: test_filter_envoy_integration imports test_edge_routes_integration, which imports this module.
    from e2e.test_filter_envoy_integration import filter_stats as stats

    return stats(admin, runtime)


@pytest.fixture(scope="module", params=("wasm", "native"))
def mesh(request, tmp_path_factory):
    """(base URL, admin URL, sidecars, runtime) of pool_state_mesh with the filter in that runtime."""
    module = request.getfixturevalue("native_module") if request.param == "native" else None
    started = pool_state_mesh(tmp_path_factory.mktemp(f"pool-state-{request.param}"), native_module=module)
    base, admin_url, sidecars = next(started)
    yield base, admin_url, sidecars, request.param
    next(started, None)  # stops Envoy and the fake sidecars


def pool_state_mesh(work: Path, native_module: Path | None = None):
    """Envoy with the e2e policy's routes and filter config over two fake sidecars, two workers;
    yields (base URL, admin URL, sidecars) and stops everything after. `native_module`: the
    policy's `filter.runtime: native`, with that module."""
    policy = load_policy(E2E_POLICY)
    if native_module is not None:
        policy = policy.model_copy(update={"filter": policy.filter.model_copy(update={"runtime": "native"})})
    listen, admin, p_int, p_batch = free_ports(4)
    sidecars = {"interactive": FakeSidecar("interactive", p_int), "batch": FakeSidecar("batch", p_batch)}
    plan = LocalMeshPlan(policy_path=E2E_POLICY, policy=policy, listen_port=listen, admin_port=admin,
                         pools=[PoolPorts("interactive", p_int, 0), PoolPorts("batch", p_batch, 0)])
    m = plan.listener(paths.filter_wasm())
    # A pool the filter watches whose cluster this Envoy does not have (a pool that went away).
    m.filter_config["degraded_routing"]["pools"]["gone"] = {"at_level": 3, "probe_cluster": "pool_gone"}
    boot = write_bootstrap(m, work / "envoy.json")
    log = work / "envoy.log"
    proc = subprocess.Popen([str(paths.envoy_binary()), "-c", str(boot), "--use-dynamic-base-id", "--concurrency", "2",
                             "--log-level", "info"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=os.environ | native_module_env(native_module) if native_module else None)
    base, admin_url = f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if urllib.request.urlopen(admin_url + "/ready", timeout=1).status == 200 and get(base, "/v1/models")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    else:
        pytest.fail("envoy did not start:\n" + log.read_text()[-3000:])
    # Its first health checks can time out while Envoy's main thread compiles the Wasm module;
    # a host that failed them is back after four passes. Start from every host in rotation.
    until("every pool host healthy", lambda: all_hosts_healthy(admin_url), 30, every=0.1)
    yield base, admin_url, sidecars
    proc.terminate()
    proc.wait(timeout=10)
    for s in sidecars.values():
        s.shutdown()


def all_hosts_healthy(admin_url: str) -> bool:
    text = urllib.request.urlopen(admin_url + "/clusters", timeout=5).read().decode()
    return all(line.endswith("::healthy") for line in text.splitlines() if "::health_flags::" in line)


def request(base: str, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers={"content-type": "application/json"} | (headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers.items()), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), json.loads(e.read() or b"null")


def get(base: str, path: str):
    return request(base, "GET", path)


def chat(base: str, headers: dict | None = None):
    return request(base, "POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, headers)


def batch(base: str):
    return request(base, "POST", "/v1/completions", {"model": "m", "prompt": "x"})


def until(what: str, cond, timeout: float, every: float = 0.02):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = cond()
        if got:
            return time.monotonic() - t0, got
        time.sleep(every)
    pytest.fail(f"not within {timeout} s: {what}")


def metric(admin_url: str, name: str, **labels) -> float:
    text = urllib.request.urlopen(admin_url + "/stats/prometheus", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def envoy_stat(admin: str, name: str) -> int:
    """One of Envoy's own counters (the same in both runtimes), by its dotted name."""
    text = urllib.request.urlopen(admin + "/stats?filter=^" + name.replace(".", r"\.") + "$", timeout=5).read().decode()
    return int(text.partition(": ")[2] or 0)


def back_to_normal(base: str, sidecars: dict) -> None:
    for s in sidecars.values():
        s.level, s.header, s.state = 0, "ok", "ok"
    until("chats back on the interactive pool", lambda: chat(base)[2]["upstream"] == "interactive", 10, every=0.1)
    until("batch served again", lambda: batch(base)[0] == 200, 10, every=0.1)


def test_normal_routing_and_the_level_header_never_reaches_the_client(mesh):
    base, admin_url, sidecars, _ = mesh
    back_to_normal(base, sidecars)
    status, headers, got = chat(base)
    assert status == 200 and got["upstream"] == "interactive"
    assert LEVEL not in {k.lower() for k in headers}, "stripped before the client"
    assert batch(base)[2]["upstream"] == "batch"
    # A client cannot fake a pool's state: its header is stripped and changes nothing.
    for _ in range(20):
        status, headers, got = chat(base, {LEVEL: "interactive;3;0"})
        assert got["upstream"] == "interactive" and LEVEL not in got["headers"]
    assert batch(base)[0] == 200


def test_a_degraded_pool_under_traffic_spills_within_a_second_sheds_batch_and_recovers(mesh):
    base, admin_url, sidecars, runtime = mesh
    back_to_normal(base, sidecars)
    before = filter_stats(admin_url, runtime)
    failed_checks = envoy_stat(admin_url, "cluster.pool_interactive.health_check.failure")
    sidecars["interactive"].level = 3
    t0 = time.monotonic()
    spill_s, (status, headers, got) = until("a chat spilled to batch", lambda: (r := chat(base))[2]["upstream"] == "batch" and r, 5)
    print(f"[pool-state {runtime}] under traffic: first spilled chat {spill_s * 1000:.0f} ms after the sidecar reported level 3")
    assert spill_s < 1.0
    # Bound for interactive (the route's headers), served by batch: Envoy's failover, because the
    # health check of the state endpoint failed.
    assert got["headers"]["x-infermesh-class"] == "interactive" and got["headers"]["x-infermesh-pool"] == "interactive"
    assert envoy_stat(admin_url, "cluster.pool_interactive.health_check.failure") > failed_checks
    # The chats' routes are native (interactive only spills): the filter learns the level from its
    # probe (every 500 ms). Wasm: another worker may still hold its normal view of the pool for up
    # to 100 ms (docs/filter.md, "Shared across workers"); native: one process-wide table. Either
    # way batch is shed at the edge within the same second, not at once.
    until("batch shed at the edge", lambda: batch(base)[0] == 429, 5)
    shed_s = time.monotonic() - t0
    assert shed_s < 1.0, shed_s
    time.sleep(0.15)  # every worker's cached normal view has expired: from here on, all agree
    status, headers, body = batch(base)
    assert status == 429 and headers["retry-after"] == "5" and headers["x-infermesh-shed-by"] == "mesh"
    assert body["error"]["code"] == "mesh_shedding" and body["error"]["type"] == "rate_limit_error"
    # What costs no generation is never shed (it falls to the shed default class here).
    assert get(base, "/v1/models")[0] == 200
    assert request(base, "POST", "/tokenize", {"prompt": "x"})[0] == 200
    for _ in range(20):  # steady: every chat spilled, every batch shed, no flapping
        assert chat(base)[2]["upstream"] == "batch" and batch(base)[0] == 429
    key = "infermesh.shed_requests_total.class.batch"
    assert filter_stats(admin_url, runtime)[key] > before.get(key, 0)
    if runtime == "wasm":  # the Wasm filter's counters also carry Prometheus tags (envoy_resources.FILTER_STATS_TAGS)
        assert metric(admin_url, "infermesh_shed_requests_total", **{"class": "batch"}) > 0
    sidecars["interactive"].level = 0
    t_normal = time.monotonic()
    recover_s, _ = until("chats back on interactive", lambda: chat(base)[2]["upstream"] == "interactive", 10)
    print(f"[pool-state {runtime}] back to normal {recover_s * 1000:.0f} ms after the sidecar reported level 0 (4 checks of 0.25 s)")
    # Two mechanisms, each with its own clock: Envoy's health check brings the chats back after
    # 4 passes of 0.25 s; the filter stops shedding once a normal reading came (the probe, within
    # probe_interval_ms) and the pool's last high reading (before level 0) is recover_hold_ms old
    # (docs/filter.md; a degraded view is never reused, so every worker sees it at once). Either
    # may come first (clean-clone run on 482d744: chats back at 816 ms, batch still shed).
    d = load_policy(E2E_POLICY).filter_config()["degraded_routing"]
    bound_s = (d["recover_hold_ms"] + d["probe_interval_ms"]) / 1000 + ROUND_TRIP_S
    until("batch served again", lambda: batch(base)[0] == 200, 5, every=0.05)
    shed_s = time.monotonic() - t_normal
    print(f"[pool-state {runtime}] batch served again {shed_s * 1000:.0f} ms after level 0 (bound {bound_s * 1000:.0f} ms)")
    assert shed_s < bound_s, shed_s
    for _ in range(20):  # steady again: no flapping back
        assert chat(base)[2]["upstream"] == "interactive" and batch(base)[0] == 200


def test_an_idle_pool_is_learned_by_the_probe_within_two_seconds(mesh):
    base, admin_url, sidecars, runtime = mesh
    back_to_normal(base, sidecars)
    time.sleep(1.0)  # no chat since: the interactive pool is idle, only the probe reads it
    probes = sidecars["interactive"].probes
    sidecars["interactive"].level = 3
    t0 = time.monotonic()
    shed_s, _ = until("batch shed for an idle degraded pool", lambda: batch(base)[0] == 429, 5)
    # The health check runs at the same interval with or without traffic (no_traffic_interval).
    until("the first chat after the idle spell spilled to batch", lambda: chat(base)[2]["upstream"] == "batch", 5)
    spill_s = time.monotonic() - t0
    print(f"[pool-state {runtime}] idle pool: first shed request {shed_s * 1000:.0f} ms (probe), "
          f"chats spilled by {spill_s * 1000:.0f} ms (health check) after the sidecar reported level 3")
    assert shed_s < 2.0 and spill_s < 2.0 and sidecars["interactive"].probes > probes
    # Two workers, one probe an interval between them (500 ms): not one per worker.
    n0, t0 = sidecars["interactive"].probes, time.monotonic()
    time.sleep(3)
    rate = (sidecars["interactive"].probes - n0) / (time.monotonic() - t0)
    assert rate <= 2.6, f"{rate:.1f} probes/s"
    # A degraded pool that gets no traffic (all spilled) stays known: still shed after the hold.
    assert batch(base)[0] == 429
    back_to_normal(base, sidecars)


STATE_FAULTS = [("garbage", "bad_header"), ("500", "probe_status"), ("hang", "probe_status")]
"""(fault, the error reason it counts as). A hanging state endpoint: Envoy ends the callout at
probe_timeout_ms with its own 504, so it counts as probe_status (probe_failed is a reset or a
connection that never came)."""


def unreadable_state_leaves_routing_normal(base: str, sidecars: dict, fault: str, reason: str,
                                           errors: Callable[[str], float]) -> None:
    """The body of the state-fault test, for either filter runtime; `errors(reason)` reads its
    `pool_state_errors_total` counter."""
    back_to_normal(base, sidecars)
    s = sidecars["interactive"]
    before = errors(reason)
    s.level = 3  # the pool is degraded, but what it says of it cannot be read
    if fault == "garbage":
        s.header = "garbage"
        # The health check reads the state endpoint's status, not the header: the spill holds;
        # the filter cannot read the level, so nothing is shed (below).
        until("chats spilled by the health check", lambda: chat(base)[2]["upstream"] == "batch", 5)
        for _ in range(10):
            status, _, got = chat(base)
            assert status == 200 and got["upstream"] == "batch"
    else:
        s.state = fault
        time.sleep(3)  # no traffic: only the probe, which fails (and the health check: spilled)
    until(f"{reason} counted", lambda: errors(reason) > before, 5, every=0.1)
    assert batch(base)[0] == 200 and chat(base)[0] == 200
    # A pool whose cluster is gone: counted at every probe, nothing else happens.
    assert errors("no_cluster") > 0
    back_to_normal(base, sidecars)


@pytest.mark.parametrize("fault, reason", STATE_FAULTS)
def test_a_sidecar_that_answers_garbage_or_a_state_endpoint_that_fails_leaves_routing_normal(mesh, fault, reason):
    base, admin_url, sidecars, runtime = mesh
    unreadable_state_leaves_routing_normal(
        base, sidecars, fault, reason, lambda r: filter_stats(admin_url, runtime).get(f"infermesh.pool_state_errors_total.reason.{r}", 0))
    if runtime == "wasm":
        assert metric(admin_url, "infermesh_pool_state_errors_total", reason=reason) > 0



def test_when_the_spill_pool_is_at_the_level_too_envoy_spreads_over_both(mesh):
    """Both pools' endpoints fail interactive's state check: Envoy's panic mode routes over all of
    them (both pools serve; 58/42 and 73/27 of 100 in two runs), so nothing is refused for want
    of a healthy pool (docs/filter.md, "Several replicas")."""
    base, admin_url, sidecars, runtime = mesh
    back_to_normal(base, sidecars)
    sidecars["interactive"].level = sidecars["batch"].level = 3
    until("batch's endpoints out of interactive's cluster too", lambda: not any(
        line.endswith("::healthy") for line in urllib.request.urlopen(admin_url + "/clusters", timeout=5).read().decode().splitlines()
        if line.startswith("pool_interactive::") and "::health_flags::" in line), 5)
    got = [chat(base) for _ in range(100)]
    assert all(status == 200 for status, _, _ in got)
    served = {pool: sum(r[2]["upstream"] == pool for r in got) for pool in ("interactive", "batch")}
    print(f"[pool-state {runtime}] both pools at the level: chats served {served}")
    assert min(served.values()) >= 5, served
    back_to_normal(base, sidecars)
