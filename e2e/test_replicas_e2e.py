"""e2e: a pool of two real vLLM replicas behind the real Envoy, compiled filter and control plane
(policy-replicas-e2e.yaml: interactive has a 600 ms TTFT deadline and hedges; batch backs it).

- a stalled replica (admin fault `stall`): interactive streams still get their first token within
  the deadline plus a margin, from the other replica, and the stalled replica's vLLM holds none of
  them once it runs again (Envoy reset the losing attempts, the sidecar aborted them);
- one replica loaded with long streams: new requests go mostly to the other, from the load the
  sidecars report to Envoy (ORCA) — and no client ever sees that report;
- the `slow-replica` drill (infermesh/drill.py) on this mesh: a steady mixed load, one replica
  stalled, every check of its report (none lost, first tokens within the deadline + margin from
  the other replica, no flapping, nothing left in the stalled vLLM, recovery), per-replica load;
- a replica killed: no request is lost.

Which replica served is what the sidecars report (`x-infermesh-served-by`).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from infermesh.drill import SCENARIOS, Drill
from infermesh.drill_report import format_report
from infermesh.launcher import LocalMesh

from e2e.conftest import running_mesh

pytestmark = pytest.mark.e2e

POLICY = Path(__file__).resolve().parent / "policy-replicas-e2e.yaml"
DEADLINE_S = 0.6
MARGIN_S = 0.5
"""Above the deadline: the other replica's own TTFT on this shared 2-core machine."""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    yield from running_mesh(POLICY, tmp_path_factory.mktemp("replicas"))


def chat(base: str, max_tokens: int = 8, stream: bool = True, timeout: float = 60) -> dict:
    """One chat through `base`; TTFT is the time to the first content delta."""
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
            "stream": stream, "temperature": 0}
    t0 = time.monotonic()
    out = {"ttft": None, "text": "", "status": None, "served_by": None, "headers": {}}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=timeout) as r:
        out["status"], out["headers"] = r.status_code, dict(r.headers)
        out["served_by"] = r.headers.get("x-infermesh-served-by")
        for line in r.iter_lines():
            if out["ttft"] is None and '"content":"' in line and '"content":""' not in line:
                out["ttft"] = time.monotonic() - t0
            out["text"] += line + "\n"
    out["total"] = time.monotonic() - t0
    return out


def unfinished(mesh: LocalMesh, replica: int) -> int:
    return sum(e["unfinished"] for e in mesh.admin_state("interactive", replica)["engines"])


def host_stat(mesh: LocalMesh, stat: str = "rq_total") -> dict[int, int]:
    """One per-host value of the interactive cluster in Envoy's /clusters (rq_total: its attempts;
    weight: what weighted round robin made of its reports), by the replica's port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.plan.admin_port}/clusters", timeout=5) as r:
        lines = r.read().decode().splitlines()
    out = {}
    for line in lines:
        parts = line.split("::")
        if parts[0] == "pool_interactive" and len(parts) == 4 and parts[2] == stat:
            out[int(parts[1].rsplit(":", 1)[1])] = int(parts[3])
    return out


def test_both_replicas_serve_and_no_client_sees_the_load_report(mesh):
    served = [chat(mesh.base_url)["served_by"] for _ in range(8)]
    attempts = host_stat(mesh)
    print(f"[replicas] served by {served}; Envoy's attempts per port {attempts}")
    # Both replicas get attempts (on a loaded machine one may lose its hedges to the other).
    assert all(attempts.get(p.http_port, 0) > 0 for p in mesh.plan.replicas("interactive")), attempts
    assert set(served) <= {"interactive/0", "interactive/1", "batch/0"}
    for stream in (True, False):
        r = chat(mesh.base_url, stream=stream)
        assert r["status"] == 200
        assert "endpoint-load-metrics" not in r["headers"], r["headers"]
    # The sidecar itself does send it (to Envoy).
    direct = chat(mesh.sidecar_url("interactive", 1))
    assert direct["headers"]["endpoint-load-metrics"].startswith("TEXT rps_fractional=")


def test_a_stalled_replica_is_hedged_within_the_deadline_and_holds_nothing_afterwards(mesh):
    admin = mesh.admin_url("interactive", 0)
    r = httpx.put(admin + "/admin/faults/stall", json={"value": 0.95, "duration_s": 60, "period_s": 10}, timeout=5)
    assert r.status_code == 200, r.text
    try:
        time.sleep(0.2)
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: chat(mesh.base_url, max_tokens=8), range(12)))
    finally:
        httpx.delete(admin + "/admin/faults/stall", timeout=5)
    print(f"[stall] TTFTs (s): {[x['ttft'] and round(x['ttft'], 3) for x in results]}; served by {[x['served_by'] for x in results]}")
    assert all(x["status"] == 200 and x["ttft"] is not None for x in results), [(x["status"], x["text"][:200]) for x in results]
    ttfts = sorted(x["ttft"] for x in results)
    assert ttfts[-1] <= DEADLINE_S + MARGIN_S, ttfts
    # Hedging never duplicates a response: one stream, ended once.
    assert all(x["text"].count("data: [DONE]") == 1 for x in results)
    assert any(x["served_by"] == "interactive/1" for x in results)
    # The losing attempts were reset by Envoy and aborted in vLLM (it runs again now).
    deadline = time.monotonic() + 15
    while unfinished(mesh, 0) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert unfinished(mesh, 0) == 0
    assert mesh.admin_state("interactive", 0)["in_flight"] == 0


def test_a_loaded_replica_gets_fewer_new_requests_from_its_own_reports(mesh):
    stop = threading.Event()
    direct = mesh.sidecar_url("interactive", 0)
    statuses: list[int] = []

    def long_stream():
        # 200 prompt tokens + 700: inside max_model_len (1024), far beyond the KV cache's share.
        body = {"model": "tiny-llama", "prompt": "x " * 100, "max_tokens": 700, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", direct + "/v1/completions", json=body, timeout=120) as r:
            statuses.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    loaders = [threading.Thread(target=long_stream, daemon=True) for _ in range(12)]
    try:
        # One at a time, each once the one before has its headers (its first token): the sidecar
        # hands vLLM a measured number of requests at once, grown by first tokens in time
        # (sidecar/admission.py), and refuses a burst it has nothing measured to wait by.
        for t in loaders:
            n = len(statuses)
            t.start()
            started = time.monotonic()
            while len(statuses) == n and time.monotonic() - started < 30:
                time.sleep(0.02)
        assert statuses == [200] * len(loaders), statuses  # the load is real
        # Envoy learns the load only from the responses it routes (the loaders go to the sidecar
        # directly) and counts a report after its blackout period: chats until its weights show it.
        loaded, other = (mesh.plan.replica("interactive", i).http_port for i in (0, 1))
        deadline = time.monotonic() + 15
        tried = []
        while not (w := host_stat(mesh, "weight")).get(loaded, 0) < w.get(other, 0):
            assert time.monotonic() < deadline, f"Envoy never weighed the loaded replica down: {w}; chats (status, served by): {tried}"
            r = chat(mesh.base_url, max_tokens=4)
            tried.append((r["status"], r["served_by"]))
        served = [chat(mesh.base_url, max_tokens=4)["served_by"] for _ in range(30)]
        weights = host_stat(mesh, "weight")
    finally:
        stop.set()
        for t in loaders:
            t.join(timeout=30)
    share = served.count("interactive/1") / len(served)
    print(f"[load] served by the unloaded replica: {share:.0%} ({served}); Envoy's weights by port {weights}, "
          f"replica ports {[p.http_port for p in mesh.plan.replicas('interactive')]}")
    assert share >= 0.7, served


def test_the_slow_replica_drill_passes_and_reports_per_replica_load(mesh, tmp_path):
    rep = asyncio.run(Drill(mesh, progress=lambda m: print(f"[drill] {m}", flush=True)).run(SCENARIOS["slow-replica"]))
    print(format_report(rep), flush=True)
    out = Path(os.environ.get("INFERMESH_DRILL_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drill-slow-replica.json").write_text(json.dumps(rep, indent=1))
    failed = [f"{c['name']}: {c['detail']}" for c in rep["checks"] if not c["passed"]]
    assert rep["passed"] and not failed, failed
    assert rep["requests"]["interactive"]["sent"] >= 20, rep["requests"]["interactive"]
    # Per-replica load, from the responses and from the sidecars' own counters.
    assert set(rep["replica_load"]) == {"interactive/0", "interactive/1"}
    assert rep["served_by"]["interactive"]["interactive/1"]["during"] > 0, rep["served_by"]
    assert sum(rep["replica_load"]["interactive/1"]["finished"].values()) > 0, rep["replica_load"]


def test_a_killed_replica_loses_no_request(mesh):
    results: list[int] = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            r = chat(mesh.base_url, max_tokens=4, stream=False)
            results.append(r["status"])

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    time.sleep(2)
    before = len(results)
    mesh.kill(LocalMesh.sidecar_name("interactive", 1))
    time.sleep(6)
    stop.set()
    for w in workers:
        w.join(timeout=60)
    print(f"[kill] {len(results)} requests, {len(results) - before} after the kill; statuses {set(results)}")
    assert len(results) - before >= 4
    assert results and all(s == 200 for s in results), results
