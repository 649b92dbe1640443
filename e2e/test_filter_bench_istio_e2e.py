"""e2e: the filter benchmark's Istio form runs: istiod (the harness of infermesh/istiod_gateway.py, as in test_istiod_e2e.py) turns
the chart's rendered resources into the gateway config, the benchmark replays it in the real
Envoy with the compiled filter in front of its sink, and every request of the quick run is a 200.
The numbers themselves are docs/filter-benchmark.md's (a quick run on a shared machine proves
nothing about them)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_the_quick_istio_form_benchmark_runs_every_form(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "filter" / "bench" / "run_bench.py"), "--quick", "--rounds", "1", "--seconds", "1",
         "--variants", "istio-headers-only,istio-headers-wasm,istio-body", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "NON-200" not in r.stdout, r.stdout
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {f"{v}/2KB" for v in ("no-filter", "istio-no-filter", "istio-headers-only", "istio-headers-wasm", "istio-body")}
    assert all(s["rps"] > 0 for s in summary.values()), summary
