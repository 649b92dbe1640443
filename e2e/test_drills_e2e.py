"""Drills: every scenario of `infermesh drill` on the real local mesh (Envoy + compiled filter +
control plane + vLLM sidecars), under a steady mixed load. Each report must pass every check:
zero lost requests, zero unexpected failures (only documented shed responses), interactive
success >= 99 %, degradation within 1 s of the sustained threshold, recovery after the fault,
no flapping — plus the scenario's own checks.

The reports are printed; with INFERMESH_DRILL_OUT=DIR they are also written there as JSON and
PNG timelines (docs/drills.md shows one)."""

from __future__ import annotations

import asyncio
import json
import os
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
    rep = asyncio.run(Drill(local_mesh, progress=lambda m: print(f"[drill] {m}", flush=True)).run(SCENARIOS[name]))
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
