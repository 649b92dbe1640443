"""Integration: hot reload that no policy file can stop, and a config Envoy refuses, through the
real control plane (its process, its file watch, its ADS server) and the real Envoy with the
compiled filter, in front of echo upstreams (test_control_plane_integration.py's harness).

- An undecodable write, 10k nested brackets and a YAML bomb are each refused and counted
  (`infermesh_policy_rejections_total{reason}` on the control plane's --metrics-port), Envoy
  keeps the last good config, and a valid edit written a moment later is applied (the issue saw
  the watch die on the first undecodable write and the edit never applied).
- A config Envoy NACKs (the native filter module, swapped for a file that is no shared object) is
  counted, the last ACKed config is served again, and a later valid edit is still applied.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import e2e.test_control_plane_integration as cpi
from e2e.test_control_plane_integration import POLICY, Harness, Traffic, post
from infermesh.meshconfig.envoy_resources import NATIVE_SEARCH_PATH_ENV

APPLY_BOUND_S = 3.0
"""An edit after a refused file must be served within this (measured: docs/policy-and-control-plane.md)."""


class ReloadHarness(Harness):
    """The control plane with its metrics served (on a port it picks and logs), and optionally a
    given `--native-module`."""

    native_module: Path | None = None

    def start_cp(self):
        import subprocess

        argv = [sys.executable, "-m", "infermesh.meshconfig.xds_server", "--policy", str(self.policy), "--port", str(self.xds_port),
                "--listen-port", str(self.listen), "--metrics-port", "0"]
        if self.native_module is not None:
            argv += ["--native-module", str(self.native_module)]
        for name, port in self.upstreams.items():
            argv += ["--pool", f"{name}=127.0.0.1:{port}"]
        self.cp_log = open(self.tmp / f"xds-{time.monotonic_ns()}.log", "wb")
        self.cp = subprocess.Popen(argv, stdout=self.cp_log, stderr=subprocess.STDOUT)

    def metrics(self) -> str:
        m = re.findall(r'"metrics_port": (\d+)', self.cp_logs())
        assert m, "the control plane never logged its metrics port:\n" + self.cp_logs()[-2000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{m[-1]}/metrics", timeout=5) as r:
            return r.read().decode()

    def counted(self, series: str) -> float:
        for line in self.metrics().splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def wait_for(what: str, check, timeout: float) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.02)
    return time.monotonic() - t0


CHAT = {cls: POLICY.replace("CHAT_CLASS", cls) for cls in ("interactive", "batch")}
UNUSABLE = {
    "encoding": CHAT["batch"].encode()[:60] + b"\xff\xfe\xc3(" + CHAT["batch"].encode()[60:],
    "depth": b"classes: " + b"[" * 10_000,
    "size": ("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))).encode(),
}


def test_no_policy_file_stops_the_watch_and_the_next_valid_edit_is_applied(upstreams, tmp_path):
    h = ReloadHarness(tmp_path, upstreams)
    try:
        assert h.wait_serving()["upstream"] == "interactive"
        served, applied = "interactive", []
        with Traffic(h.base) as traffic:
            for reason, data in UNUSABLE.items():
                h.policy.write_bytes(data)
                series = f'infermesh_policy_rejections_total{{reason="{reason}"}}'
                wait_for(f"the {reason} rejection counted", lambda: h.counted(series) == 1, 10)
                assert post(h.base)["upstream"] == served, "the last good config stays served"
                assert h.cp.poll() is None, "the control plane is alive"
                served = "batch" if served == "interactive" else "interactive"
                time.sleep(0.05)  # "a valid edit written a moment later"
                h.policy.write_text(CHAT[served])
                applied.append(wait_for(f"the edit after the {reason} file applied", lambda: post(h.base)["upstream"] == served,
                                        APPLY_BOUND_S))
        logs = h.cp_logs()
        for says in ("(encoding): not valid UTF-8", "nested more than 64 levels", "expands to more than"):
            assert says in logs, says
        assert f"{h.policy}:" in logs, "the rejections name the file"
        assert h.counted("infermesh_policy_reloads_total") == 1 + len(UNUSABLE)
        assert h.counted('infermesh_policy_rejections_total{reason="internal"}') == 0
    finally:
        h.stop()
    print(f"[reload] valid edit served {', '.join(f'{t * 1000:.0f}' for t in applied)} ms after each refused file; "
          f"{traffic.count} requests")
    assert not traffic.failures, traffic.failures[:5]


def test_a_config_envoy_refuses_is_counted_the_last_acked_is_served_and_a_later_edit_applies(upstreams, tmp_path, monkeypatch):
    """A real NACK: the policy switches to the native filter module, and the module Envoy finds
    is a file that is no shared object (the control plane only checks that it exists)."""
    broken = tmp_path / "broken-module"
    broken.mkdir()
    (broken / "libinfermesh_filter.so").write_bytes(b"not an ELF shared object\n")
    monkeypatch.setattr(cpi, "native_module_env", lambda module: {NATIVE_SEARCH_PATH_ENV: str(broken)})
    ReloadHarness.native_module = broken / "libinfermesh_filter.so"
    try:
        h = ReloadHarness(tmp_path, upstreams)
    finally:
        ReloadHarness.native_module = None
    try:
        assert h.wait_serving()["upstream"] == "interactive"
        with Traffic(h.base) as traffic:
            h.policy.write_text(CHAT["interactive"] + "filter:\n  runtime: native\n")
            wait_for("Envoy's NACK counted", lambda: h.counted('infermesh_xds_nacks_total{type="TypedExtensionConfig"}') >= 1, 10)
            wait_for("the last ACKed config served again", lambda: h.counted("infermesh_xds_rollbacks_total") == 1, 5)
            time.sleep(0.5)
            assert post(h.base)["upstream"] == "interactive"
            h.policy.write_text(CHAT["batch"])
            took = wait_for("a later valid edit applied", lambda: post(h.base)["upstream"] == "batch", APPLY_BOUND_S)
        logs = [json.loads(line) for line in h.cp_logs().splitlines() if line.startswith("{")]
        nack = [r for r in logs if r.get("msg") == "envoy rejected a config (NACK)"]
        assert nack and nack[0].get("reason"), "Envoy's error_detail is logged"
        assert any(r.get("msg") == "envoy refused the config; serving the last ACKed one again" for r in logs)
        assert h.cp.poll() is None
    finally:
        h.stop()
    print(f"[nack] Envoy said: {nack[0]['reason'][:200]!r}; the later edit served {took * 1000:.0f} ms after it was written; "
          f"{traffic.count} requests")
    assert not traffic.failures, traffic.failures[:5]
