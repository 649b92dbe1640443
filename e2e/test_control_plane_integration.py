"""Integration: the real control plane (ADS over grpcio) driving the real Envoy with the compiled
filter, in front of echo upstreams. Live policy edits, a rejected policy, and a control plane
killed and restarted while traffic flows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.launcher import free_ports, wait_until
from infermesh.meshconfig.envoy_resources import native_module_env
from infermesh.meshconfig.xds_server import xds_bootstrap

POLICY = """\
version: 1
default_class: batch
classes:
  interactive: {pool: interactive, priority: 0}
  batch: {pool: batch, priority: 10, sheddable: true}
rules:
  - name: chat
    class: CHAT_CLASS
    match: {methods: [POST], path: {prefix: /v1/chat/completions}}
pools:
  interactive:
    models: [{name: tiny-llama-large}]
  batch:
    models: [{name: tiny-llama-small}]
"""


def post(base: str, path: str = "/v1/chat/completions") -> dict:
    req = urllib.request.Request(base + path, data=b"{}", method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200
        return json.loads(r.read())


class Harness:
    def __init__(self, tmp: Path, upstreams: dict[str, int], policy: str = POLICY.replace("CHAT_CLASS", "interactive")):
        self.tmp = tmp
        self.policy = tmp / "policy.yaml"
        self.policy.write_text(policy)
        self.xds_port, self.listen, self.admin = free_ports(3)
        self.upstreams = upstreams
        self.cp: subprocess.Popen | None = None
        self.start_cp()
        boot = tmp / "envoy.json"
        boot.write_text(json.dumps(xds_bootstrap(self.admin, "127.0.0.1", self.xds_port)))
        self.envoy = subprocess.Popen(
            # Drain times as the launcher's: a replaced listener (and its filter's counters) goes within seconds.
            [str(paths.envoy_binary()), "-c", str(boot), "--use-dynamic-base-id", "--concurrency", "1", "--log-level", "warn",
             "--drain-time-s", "1", "--parent-shutdown-time-s", "2"],
            stdout=open(tmp / "envoy.log", "wb"), stderr=subprocess.STDOUT,
            # As the launcher does: where a policy's `filter.runtime: native` module is found.
            env=os.environ | native_module_env(paths.filter_native_module()))
        self.base = f"http://127.0.0.1:{self.listen}"

    def start_cp(self):
        argv = [sys.executable, "-m", "infermesh.meshconfig.xds_server", "--policy", str(self.policy), "--port", str(self.xds_port),
                "--listen-port", str(self.listen)]
        for name, port in self.upstreams.items():
            argv += ["--pool", f"{name}=127.0.0.1:{port}"]
        self.cp_log = open(self.tmp / f"xds-{time.monotonic_ns()}.log", "wb")
        self.cp = subprocess.Popen(argv, stdout=self.cp_log, stderr=subprocess.STDOUT)

    def cp_logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("xds-*.log")))

    def wait_serving(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return post(self.base)
            except OSError:
                time.sleep(0.1)
        raise AssertionError("envoy never served:\n" + (self.tmp / "envoy.log").read_text()[-2000:] + self.cp_logs()[-2000:])

    def stop(self):
        for p in (self.envoy, self.cp):
            if p and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


@pytest.fixture
def harness(upstreams, tmp_path):
    h = Harness(tmp_path, upstreams)
    yield h
    h.stop()


class Traffic:
    """Requests in a loop from a thread; every failure is kept, and which upstream served each."""

    def __init__(self, base: str, served: list[str] | None = None):
        self.base, self.stop_ev, self.failures, self.count = base, threading.Event(), [], 0
        self.served = served if served is not None else []
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop_ev.is_set():
            try:
                self.served.append(post(self.base)["upstream"])
                self.count += 1
            except Exception as e:  # noqa: BLE001 — any failure counts
                self.failures.append(repr(e))
            time.sleep(0.005)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *a):
        self.stop_ev.set()
        self.t.join(timeout=10)


def test_policy_edits_reach_envoy_within_a_second_without_dropping_requests(harness):
    assert harness.wait_serving()["upstream"] == "interactive"
    times = []
    with Traffic(harness.base) as traffic:
        for target, cls in (("batch", "batch"), ("interactive", "interactive"), ("batch", "batch")):
            t0 = time.monotonic()
            harness.policy.write_text(POLICY.replace("CHAT_CLASS", cls))
            while post(harness.base)["upstream"] != target:
                assert time.monotonic() - t0 < 5, "the edit never reached Envoy"
                time.sleep(0.01)
            times.append(time.monotonic() - t0)
    print(f"[xds] propagation: {', '.join(f'{t * 1000:.0f}' for t in times)} ms; {traffic.count} requests during the edits")
    assert max(times) < 1.0, times
    assert not traffic.failures and traffic.count >= 5


def test_an_invalid_policy_is_rejected_and_envoy_keeps_the_last_good_config(harness):
    assert harness.wait_serving()["upstream"] == "interactive"
    with Traffic(harness.base) as traffic:
        harness.policy.write_text(POLICY.replace("CHAT_CLASS", "no-such-class"))
        time.sleep(1.0)
        assert post(harness.base)["upstream"] == "interactive"
    assert not traffic.failures
    logs = harness.cp_logs()
    assert "policy rejected; keeping the last good config" in logs and "rules.0.class" in logs
    harness.policy.write_text(POLICY.replace("CHAT_CLASS", "batch"))
    deadline = time.monotonic() + 5
    while post(harness.base)["upstream"] != "batch":
        assert time.monotonic() < deadline, "a valid edit after a rejected one must still apply"
        time.sleep(0.02)


def test_envoy_keeps_serving_when_the_control_plane_dies_and_resyncs_when_it_returns(harness):
    assert harness.wait_serving()["upstream"] == "interactive"
    with Traffic(harness.base) as traffic:
        harness.cp.send_signal(signal.SIGKILL)
        harness.cp.wait()
        time.sleep(1.5)
        assert post(harness.base)["upstream"] == "interactive"
        harness.policy.write_text(POLICY.replace("CHAT_CLASS", "batch"))  # edited while it is down
        harness.start_cp()
        t0 = time.monotonic()
        while post(harness.base)["upstream"] != "batch":
            assert time.monotonic() - t0 < 30, "envoy did not resync with the restarted control plane"
            time.sleep(0.05)
        print(f"[xds] resynced {time.monotonic() - t0:.1f}s after the restart")
    assert not traffic.failures, traffic.failures[:5]
    assert traffic.count >= 10


FAILOVER_POLICY = POLICY.replace("CHAT_CLASS", "interactive").replace(
    "    models: [{name: tiny-llama-large}]\n",
    "    models: [{name: tiny-llama-large}]\n    when_degraded: {at_level: 3, spill_to: batch}\n")


def test_a_dead_pool_fails_over_to_its_spill_pool_without_a_failed_request(tmp_path):
    """EDS gives the interactive clusters the batch endpoints at priority 1; when the interactive
    upstream dies, requests that cannot connect are retried there — before any health check or
    the control plane notices (this control plane follows no sidecar state)."""
    from e2e.conftest import echo_server

    p_int, p_batch = free_ports(2)
    servers = {"interactive": echo_server("interactive", p_int), "batch": echo_server("batch", p_batch)}
    h = Harness(tmp_path, {"interactive": p_int, "batch": p_batch}, policy=FAILOVER_POLICY)
    try:
        assert h.wait_serving()["upstream"] == "interactive"
        served: list[str] = []
        with Traffic(h.base, served) as traffic:
            time.sleep(0.5)
            servers["interactive"].kill()
            t_kill = time.monotonic()
            wait_until(lambda: served and served[-1] == "batch", 5, every=0.01, what="traffic to fail over")
            failover_s = time.monotonic() - t_kill
            time.sleep(0.5)
        # Both pools gone: Envoy's own reply, as an OpenAI error with Retry-After.
        servers["batch"].kill()
        req = urllib.request.Request(h.base + "/v1/chat/completions", data=b"{}", method="POST", headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 503 and int(e.value.headers["retry-after"]) >= 1
        assert json.loads(e.value.read())["error"]["code"] == "pool_unavailable"
    finally:
        h.stop()
    print(f"[failover] first request served by the spill pool {failover_s * 1000:.0f} ms after the upstream died; "
          f"{traffic.count} requests, none failed")
    assert served.index("batch") > 0 and served[-1] == "batch"
    assert not traffic.failures, traffic.failures[:5]


# A body rule before the header rule, so the filter decides chats (a header-only rule is a native route).
BODY_POLICY = POLICY.replace("rules:\n", """rules:
  - name: bulk
    class: batch
    match: {methods: [POST], path: {prefix: /v1/chat/completions}, body: {max_tokens: {min: 1000}}}
""").replace("CHAT_CLASS", "interactive")


def prometheus(admin: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats/prometheus", timeout=5) as r:
        return r.read().decode()


def listener_updates(admin: int) -> dict[str, int]:
    """Envoy's counts of listeners replaced, in place (filter chains) or whole, and of filter chains drained."""
    names = ("listener_manager.listener_modified", "listener_manager.listener_in_place_updated", "listener_manager.total_filter_chains_draining")
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=^listener_manager\\.", timeout=5) as r:
        stats = dict(line.split(": ", 1) for line in r.read().decode().splitlines() if ": " in line)
    return {n: int(stats[n]) for n in names}


def chats_counted(admin: int, namespace: str) -> int:
    """The filter's count of chats it sent to interactive, in one runtime's stats namespace."""
    name = f"{namespace}.infermesh.requests_total.class.interactive.pool.interactive.rule.chat"
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=^{name}$", timeout=5) as r:
        text = r.read().decode()
    return int(text.partition(": ")[2] or 0)


def test_the_filter_runtime_switches_between_wasm_and_the_native_module_live(native_module, tmp_path, upstreams):
    """`filter.runtime: native` edited into a served policy: the filter's config (ECDS) names the
    dynamic module in the Wasm filter's place, the listener stays as it is (nothing drains, so
    nothing in flight is cut), Envoy goes on deciding the same way, no request fails; its
    counters carry the same Prometheus names and tags; and back."""
    h = Harness(tmp_path, upstreams, policy=BODY_POLICY)
    series = 'infermesh_requests_total{class="interactive",pool="interactive",rule="chat"}'
    try:
        assert h.wait_serving()["upstream"] == "interactive"
        assert chats_counted(h.admin, "wasmcustom") > 0 and series in prometheus(h.admin)
        listeners = listener_updates(h.admin)
        with Traffic(h.base) as traffic:
            for policy, namespace in ((BODY_POLICY + "filter:\n  runtime: native\n", "dynamicmodulescustom"), (BODY_POLICY, "wasmcustom")):
                before = chats_counted(h.admin, namespace)
                h.policy.write_text(policy)
                t0 = time.monotonic()
                # Counting in this runtime's namespace: this runtime decides the requests now.
                wait_until(lambda: chats_counted(h.admin, namespace) > before + 2, 10, every=0.05, what=f"{namespace} counting chats")
                print(f"[runtime] {namespace}: deciding {time.monotonic() - t0:.2f} s after the edit")
                big = urllib.request.Request(h.base + "/v1/chat/completions", data=json.dumps({"max_tokens": 4096}).encode(), method="POST",
                                             headers={"content-type": "application/json"})
                with urllib.request.urlopen(big, timeout=5) as r:
                    assert json.loads(r.read())["upstream"] == "batch", "the body rule, decided by the filter in either runtime"
                # One series per labels once the replaced filter config is released (both runtimes'
                # counters are `infermesh_*` in /stats/prometheus: while both live there are two).
                wait_until(lambda: len([x for x in prometheus(h.admin).splitlines() if x.startswith(series + " ")]) == 1, 10,
                           every=0.2, what="the replaced filter config's counters to go")
                assert 'infermesh_requests_total{class="batch",pool="batch",rule="bulk"}' in prometheus(h.admin)
        assert listener_updates(h.admin) == listeners, "a filter change replaced the listener (its drain cuts what is in flight)"
    finally:
        h.stop()
    assert not traffic.failures, traffic.failures[:5]
    assert traffic.served and set(traffic.served) == {"interactive"}
    assert "rejected" not in h.cp_logs() and "generation failed" not in h.cp_logs()
