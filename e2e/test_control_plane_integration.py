"""Integration: the real control plane (ADS over grpcio) driving the real Envoy with the compiled
filter, in front of echo upstreams. Live policy edits, a rejected policy, and a control plane
killed and restarted while traffic flows."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.launcher import free_ports
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
    def __init__(self, tmp: Path, upstreams: dict[str, int]):
        self.tmp = tmp
        self.policy = tmp / "policy.yaml"
        self.policy.write_text(POLICY.replace("CHAT_CLASS", "interactive"))
        self.xds_port, self.listen, self.admin = free_ports(3)
        self.upstreams = upstreams
        self.cp: subprocess.Popen | None = None
        self.start_cp()
        boot = tmp / "envoy.json"
        boot.write_text(json.dumps(xds_bootstrap(self.admin, "127.0.0.1", self.xds_port)))
        self.envoy = subprocess.Popen(
            [str(paths.envoy_binary()), "-c", str(boot), "--use-dynamic-base-id", "--concurrency", "1", "--log-level", "warn"],
            stdout=open(tmp / "envoy.log", "wb"), stderr=subprocess.STDOUT)
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
    """Requests in a loop from a thread; every failure is kept."""

    def __init__(self, base: str):
        self.base, self.stop_ev, self.failures, self.count = base, threading.Event(), [], 0
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop_ev.is_set():
            try:
                post(self.base)
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
