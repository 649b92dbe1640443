"""Drills: every scenario of `infermesh drill` on the real local mesh (Envoy + compiled filter +
control plane + vLLM sidecars), under a steady mixed load. Each report must pass every check:
zero lost requests, zero unexpected failures (only documented shed responses), interactive
success >= 99 %, degradation within 1 s of the sustained threshold, recovery after the fault,
no flapping — plus the scenario's own checks.

The reports are printed; with INFERMESH_DRILL_OUT=DIR they are also written there as JSON and
PNG timelines (docs/drills.md shows one)."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import time
from pathlib import Path

import pytest

from infermesh.drill import SCENARIOS, Drill
from infermesh.drill_report import format_report, plot_report
from infermesh.meshconfig.policy import load_policy

pytestmark = pytest.mark.e2e


# What the one-replica-per-pool drill mesh can run (slow-replica runs on the replicas mesh, in
# e2e/test_replicas_e2e.py).
E2E_POLICY = load_policy(Path(__file__).resolve().parent / "policy-e2e.yaml")


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s.unfit(E2E_POLICY, None) is None])
def test_drill(local_mesh, name, tmp_path):
    # One drill with the mesh's own Prometheus: the report links the dashboards' queries in it.
    prom = local_mesh.start_prometheus() if name == "kv-cache" else None
    try:
        rep = asyncio.run(Drill(local_mesh, progress=lambda m: print(f"[drill] {m}", flush=True)).run(SCENARIOS[name]))
        if prom is not None:
            time.sleep(2.5)  # the last scrapes
            start, end = (datetime.datetime.fromisoformat(rep["window"][k]).timestamp() for k in ("start", "end"))
            level = next(q for q in rep["queries"] if q["panel"] == "Degradation level")
            assert level["link"].startswith(prom.url + "/graph?"), level
            # What the link shows: the fault pool degraded during the drill, as its own state said.
            series = prom.query_range(level["exprs"][0], start, end + 2, 1)
            assert max(float(v) for s in series for _, v in s["values"]) >= 1, series
    finally:
        if prom is not None:
            local_mesh.stop_child("prometheus")
    print(format_report(rep), flush=True)
    out = Path(os.environ.get("INFERMESH_DRILL_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"drill-{name}.json").write_text(json.dumps(rep, indent=1))
    plot_report(rep, str(out / f"drill-{name}.png"))
    assert (out / f"drill-{name}.png").stat().st_size > 10_000
    failed = [f"{c['name']}: {c['detail']}" for c in rep["checks"] if not c["passed"]]
    assert rep["passed"] and not failed, failed
    # Something really ran: a steady load of both kinds (1 chat/s, 0.5 completions/s by default).
    assert rep["requests"]["interactive"]["sent"] >= 12, rep["requests"]["interactive"]
    assert rep["requests"]["batch"]["sent"] >= 5, rep["requests"]["batch"]
    # The report names the chart dashboards' queries over its window, on the fault pool.
    assert rep["window"]["start"] < rep["window"]["end"] and len(rep["queries"]) == 8
    assert all(q["exprs"] for q in rep["queries"])
